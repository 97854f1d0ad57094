"""plot_metrics turns metrics.jsonl into a PNG and rejects a malformed file by name and line."""

import json

import pytest

from ling2.train.metrics import read_metrics
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
