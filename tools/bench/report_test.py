"""The benchmarks' shared reporting: a results file is replaced whole or left as it was, and the timer's median
and slow-case rules (checked against a fake clock's hand-computed samples)."""

import json

import pytest

from tools.bench import report


def test_write_results_replaces_whole_or_keeps_the_previous(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert report.write_results({"rows": [1, 2]}, str(out), "x", "unused.json") == str(out)
    assert json.loads(out.read_text()) == {"rows": [1, 2]} and f"wrote {out}" in capsys.readouterr().out
    with pytest.raises(TypeError):  # fails halfway through serialising: the previous file stays
        report.write_results({"rows": [3], "bad": object()}, str(out), "x", "unused.json")
    assert json.loads(out.read_text()) == {"rows": [1, 2]}


def test_median_seconds(monkeypatch):
    ticks = iter([0.0, 1.0,  # warm-up: 1 s
                  10.0, 10.5, 20.0, 23.0, 30.0, 31.0])  # runs of 0.5, 3 and 1 s
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(ticks))
    assert report.median_seconds(lambda: 0, (), repeats=3) == 1.0
    ticks = iter([0.0, 5.0])
    assert report.median_seconds(lambda: 0, (), repeats=3, slow_seconds=2.0) == 5.0  # one slow sample is the answer


def test_timed_rates_from_queued_seconds(monkeypatch):
    """Batches of 4 queued calls taking 2, 4 and 8 s: 1 s per call (the median), so 3e12 FLOPs run at 3 TFLOP/s,
    0.5 of a 6e12 FLOP/s matmul."""
    ticks = iter([0.0, 2.0, 10.0, 14.0, 20.0, 28.0])
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(ticks))
    assert report.timed_rates(lambda: 0, (), flops=3e12, rate=6e12, calls=4) == {
        "seconds": 1.0, "tflops": 3.0, "of_matmul_rate": 0.5}
