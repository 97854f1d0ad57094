"""plot_metrics turns metrics.jsonl into a PNG and rejects a malformed file by name and line, a bad --out by
name before plotting; a NaN loss (a skipped step, written as the string "nan") stays a gap on a numeric axis."""

import json
import math
import re

import matplotlib.category
import numpy as np
import pytest
from absl import flags

from ling2.train.metrics import MetricsWriter, read_metrics
from tools import plot_metrics


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_png_written(tmp_path):
    m = tmp_path / "metrics.jsonl"
    _write(m, [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "tokens_per_s": 100.0 + s, "mtp_loss/depth_1": 6.0 / s}
               for s in range(1, 6)] + [{"step": 3, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0}])
    rows = read_metrics(m)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[2]["loss"] == 1.0  # resumed record wins
    out = tmp_path / "c.png"
    plot_metrics.plot(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_malformed_line_named(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1, "loss": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_metrics(m)


def test_nan_loss_plots_on_a_numeric_axis(tmp_path):
    """Written by the trainer's own writer: NaN and inf become "nan"/"inf" strings in the file, floats again when
    read, and the loss axis stays numeric (not matplotlib's categorical axis of strings), the NaN a gap."""
    w = MetricsWriter(tmp_path, tensorboard=False)
    for s, loss in enumerate([5.0, float("nan"), 4.0, float("inf"), 3.0], 1):
        w.write(s, {"loss": loss, "lr": 1e-3, "tokens_per_s": 100.0})
    w.write(6, {"loss": 2.5})  # a record without lr or throughput
    w.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"loss": "nan"' in text and '"loss": "inf"' in text
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(rows[1]["loss"]) and rows[3]["loss"] == math.inf
    fig = plot_metrics.figure(rows)
    ax = fig.axes[0]
    assert not isinstance(ax.yaxis.get_converter(), matplotlib.category.StrCategoryConverter)
    y = np.asarray(ax.lines[0].get_ydata(), dtype=float)
    np.testing.assert_array_equal(y, [5.0, np.nan, 4.0, np.inf, 3.0, 2.5])
    lo, hi = ax.get_ylim()
    assert lo <= 2.5 and 5.0 <= hi < 100  # scaled to the finite losses
    plot_metrics.plot(rows, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _main(capsys, *argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["plot_metrics", *argv])
    rc = plot_metrics.main(["plot_metrics"])
    return rc, capsys.readouterr()


def _metrics(tmp_path):
    m = tmp_path / "metrics.jsonl"
    _write(m, [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "tokens_per_s": 10.0} for s in (1, 2)])
    return m


def test_wrote_names_the_file_written(tmp_path, capsys):
    """--out without a suffix gets .png (and says so); the default is next to metrics.jsonl."""
    m = _metrics(tmp_path)
    rc, out = _main(capsys, f"--metrics={m}", f"--out={tmp_path / 'curves'}")
    assert rc == 0 and out.out == f"wrote {tmp_path / 'curves.png'}\n", out.err
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out = _main(capsys, f"--metrics={m}", f"--out={tmp_path / 'c.svg'}")
    assert rc == 0 and out.out == f"wrote {tmp_path / 'c.svg'}\n" and b"<svg" in (tmp_path / "c.svg").read_bytes()
    rc, out = _main(capsys, f"--metrics={m}")
    assert rc == 0 and out.out == f"wrote {tmp_path / 'metrics.png'}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.svg", "curves.png", "metrics.jsonl", "metrics.png"]


@pytest.mark.parametrize("case", ["dir", "no_dir", "unwritable", "format", "not_utf8"])
def test_bad_input_is_one_error_line(tmp_path, capsys, case):
    """Exit 2 and one `error:` line naming --out or the metrics file (and line); nothing written."""
    m = _metrics(tmp_path)
    out, want = {
        "dir": (tmp_path, r"--out {d}: names a directory"),
        "no_dir": (tmp_path / "nope" / "c.png", r"--out {d}/nope/c\.png: no such directory"),
        "unwritable": ("/proc/c.png", r"--out /proc/c\.png: cannot write: "),
        "format": (tmp_path / "c.txt", r"--out {d}/c\.txt: unknown image format 'txt' \(one of .*png"),
        "not_utf8": (tmp_path / "c.png", r"{d}/metrics\.jsonl:2: not UTF-8 \(byte b'\\xe9' at offset 59\)"),
    }[case]
    if case == "not_utf8":
        m.write_bytes(b'{"step": 1, "loss": 1.0, "lr": 0.001}\n{"step": 2, "x": "caf\xe9"}\n')
    before = sorted(tmp_path.iterdir())
    rc, res = _main(capsys, f"--metrics={m}", f"--out={out}")
    assert rc == 2 and res.out == "" and res.err.startswith("error: ") and res.err.count("\n") == 1, res
    assert re.fullmatch("error: " + want.format(d=re.escape(str(tmp_path))) + ".*", res.err.rstrip("\n")), res.err
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("value,what", [('"abc"', "a string"), ("[1, 2]", "an array"), ("null", "null"),
                                        ("true", "a boolean"), ("{}", "an object")])
@pytest.mark.parametrize("metric", ["loss", "eval_loss", "lr", "tokens_per_s", "mtp_loss/1"])
def test_a_value_that_is_not_a_number_is_named(tmp_path, capsys, metric, value, what):
    """A plotted metric that is not a number: exit 2 and one `error:` line naming the file, step and metric;
    no image written."""
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1, "loss": 2.0, "lr": 0.1, "tokens_per_s": 5}\n'
                 f'{{"step": 2, "loss": 1.5, "lr": 0.1, "tokens_per_s": 5, "{metric}": {value}}}\n')
    rc, res = _main(capsys, f"--metrics={m}", f"--out={tmp_path / 'c.png'}")
    assert rc == 2 and res.out == "", res
    assert res.err == f"error: {m}: step 2: {metric} is {what}, not a number\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
