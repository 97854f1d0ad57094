"""Plots loss, learning rate and throughput from a run's metrics.jsonl into one PNG.

    bazel run //tools:plot_metrics -- --metrics=runs/ling2-tiny/metrics.jsonl --out=curves.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from ling2.config.paths import user_path  # noqa: E402
from ling2.train.metrics import read_metrics  # noqa: E402

flags.DEFINE_string("metrics", None, "Path to metrics.jsonl.")
flags.DEFINE_string("out", None, "Output PNG (default: next to metrics.jsonl).")
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


def plot(rows: list[dict], out: Path) -> None:
    fig = figure(rows)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv):
    if not FLAGS.metrics:
        print("error: --metrics is required", file=sys.stderr)
        return 2
    path = user_path(FLAGS.metrics)
    if not path.is_file():
        print(f"error: {path}: metrics file not found", file=sys.stderr)
        return 2
    try:
        rows = read_metrics(path)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = user_path(FLAGS.out) if FLAGS.out else path.with_suffix(".png")
    plot(rows, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
