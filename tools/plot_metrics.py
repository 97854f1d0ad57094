"""Plots loss, learning rate and throughput from a run's metrics.jsonl into one PNG.

    bazel run //tools:plot_metrics -- --metrics=runs/ling2-tiny/metrics.jsonl --out=curves.png

The image format follows --out's suffix (.png when it has none, which is then added). Bad input (a
missing or malformed metrics file; an --out that is a directory, in no directory, of an unknown format or
unwritable) is one `error:` line naming the file, line or flag, and exit status 2; the output is written to
a temporary file and renamed into place, so a failed run leaves an existing image untouched.
"""

import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from absl import app, flags  # noqa: E402

from ling2.config.paths import replaced, user_path  # noqa: E402
from ling2.data.jsonl import json_type  # noqa: E402
from ling2.train.metrics import read_metrics  # noqa: E402

flags.DEFINE_string("metrics", None, "Path to metrics.jsonl.")
flags.DEFINE_string("out", None, "Output image, PNG unless its suffix names another format (default: next to "
                    "metrics.jsonl).")
FLAGS = flags.FLAGS


def figure(rows: list[dict]):
    """The loss / learning-rate / throughput figure. Non-finite values (a skipped step's NaN loss) are gaps in
    numeric axes; a metric a record lacks is a gap too."""
    steps = [r["step"] for r in rows]
    col = lambda k: [float(r.get(k, float("nan"))) for r in rows]  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, col("loss"), label="train loss")
    ev = [(r["step"], float(r["eval_loss"])) for r in rows if "eval_loss" in r]
    if ev:
        axes[0].plot(*zip(*ev), "o-", label="eval loss")
    mtp = sorted({k for r in rows for k in r if k.startswith("mtp_loss/")})
    for k in mtp:
        axes[0].plot(steps, col(k), "--", label=k)
    axes[0].set_title("loss")
    axes[0].legend()
    axes[1].plot(steps, col("lr"))
    axes[1].set_title("learning rate")
    axes[2].plot(steps, col("tokens_per_s"))
    axes[2].set_title("tokens/s")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def check_values(rows: list[dict], path) -> None:
    """ValueError naming the file, step and metric of a plotted value that is not a number (a string, a list,
    null, a boolean), which matplotlib would fail on, or plot as 0 or 1, after the output was opened.
    NaN and Inf (read_metrics gives them back as floats) are numbers: gaps in the curves."""
    for r in rows:
        for k, v in r.items():
            if k in ("loss", "eval_loss", "lr", "tokens_per_s") or k.startswith("mtp_loss/"):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{path}: step {r['step']}: {k} is {json_type(v)}, not a number")


def plot(rows: list[dict], out, fmt: str | None = None) -> None:
    fig = figure(rows)
    fig.savefig(out, dpi=100, format=fmt)
    plt.close(fig)


def output_path(out: str | None, metrics: Path) -> Path:
    """The image file to write: --out (with .png added when it has no suffix, as savefig would) or
    metrics.jsonl's name with .png. Raises ValueError naming --out for a directory, a missing parent directory
    or a format the Agg backend cannot write on its own (pgf needs LaTeX)."""
    if not out:
        return metrics.with_suffix(".png")
    path = user_path(out)
    if path.is_dir() or out.endswith(os.sep):
        raise ValueError(f"--out {out}: names a directory; give an image file name (e.g. {path / 'curves.png'})")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    fmt = path.suffix[1:].lower()
    formats = sorted(set(FigureCanvasAgg.get_supported_filetypes()) - {"pgf"})
    if fmt not in formats:
        raise ValueError(f"--out {out}: unknown image format {fmt!r} (one of {', '.join(formats)})")
    if not path.parent.is_dir():
        raise ValueError(f"--out {out}: no such directory {path.parent}")
    return path


def main(argv):
    if not FLAGS.metrics:
        print("error: --metrics is required", file=sys.stderr)
        return 2
    path = user_path(FLAGS.metrics)
    if not path.is_file():
        print(f"error: {path}: metrics file not found", file=sys.stderr)
        return 2
    try:
        out = output_path(FLAGS.out, path)
        rows = read_metrics(path)
        check_values(rows, path)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with replaced(out, "wb") as f:
            plot(rows, f, out.suffix[1:].lower())
    except OSError as e:
        print(f"error: --out {out}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
