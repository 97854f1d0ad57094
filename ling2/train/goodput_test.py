"""Goodput records: every logged record says where its window's time went; a resumed run charges the
dropped records of the run it continues as lost work; totals read back across the restart.

References: the metrics.jsonl lines themselves (the lost work is the sum of the dropped records' seconds,
added up here from the file before the resume), and the wall time measured around the run."""

import json
import shutil
import time

import jax
import pytest

from ling2.config import load_config
from ling2.train import goodput, loop
from ling2.train.data import make_iterator_factory
from ling2.train.metrics import read_metrics
from ling2.train.testing import e2e
from ling2.train.train import find_file

KEYS = [f"goodput/{k}_s" for k in goodput.KINDS]


def _run(run_dir, **over):
    cfg = load_config(*e2e.MICRO, "async_checkpointing=false", config_file=find_file("configs/train/tiny_sample.yml"),
                      **{"steps": 6, "checkpoint_period": 2, "eval_interval": 3, "eval_steps": 1, **over})
    logs = []
    t0 = time.perf_counter()
    loop.run(cfg, run_dir, make_iterator_factory(find_file), log=logs.append, devices=jax.devices()[:1],
             tensorboard=False)
    return logs, time.perf_counter() - t0


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    logs, wall = _run(d)
    return d, logs, wall


def test_each_record_accounts_its_window(finished):
    d, logs, wall = finished
    recs = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert all(r[k] >= 0 for k in KEYS), r
    assert recs[0]["goodput/compile_s"] > 0 and all(r["goodput/compile_s"] == 0 for r in recs[1:])
    assert [r["step"] for r in recs if r["goodput/eval_s"] > 0] == [3, 6]
    assert [r["step"] for r in recs if r["goodput/checkpoint_s"] > 0] == [3, 5]  # saves after steps 2 and 4
    assert all(r["goodput/step_s"] > 0 for r in recs[1:])
    s = goodput.summary(recs)
    assert 0 < s["total"] <= wall and 0 < s["goodput"] < 1 and s["lost"] == 0
    assert any(line.startswith("goodput: ") for line in logs)


def test_resume_charges_the_dropped_records_as_lost(finished, tmp_path):
    """A run cut short after its checkpoint at step 4 had logged steps 5 and 6: the resumed run replays them."""
    d = tmp_path / "cut"
    shutil.copytree(finished[0], d)
    shutil.rmtree(d / "checkpoints" / "6")
    before = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    want_lost = sum(r[k] for r in before if r["step"] > 4 for k in KEYS)
    logs, _ = _run(d)
    assert any("resumed from" in line and "(step 4)" in line for line in logs)
    recs = read_metrics(d / "metrics.jsonl")
    first = next(r for r in recs if r["step"] == 5)
    assert first["goodput/lost_steps"] == 2 and first["goodput/lost_s"] == pytest.approx(want_lost, rel=1e-9)
    assert first["goodput/restore_s"] > 0 and first["goodput/compile_s"] > 0
    s = goodput.summary(recs)
    assert s["lost_steps"] == 2 and s["lost"] == pytest.approx(want_lost, rel=1e-9)


def test_bytes_that_are_not_utf8_are_not_records(tmp_path):
    """A metrics.jsonl with a garbage line (bytes that are not UTF-8, as a damaged disk leaves) still resumes:
    lost_work counts the records around it (2.5 + 3 s after step 1, by hand), truncate_metrics drops it with the
    later steps, and read_metrics names the file and the byte's offset instead of decoding it silently."""
    from ling2.train.metrics import truncate_metrics

    recs = [{"step": s, "goodput/step_s": float(s) + 0.5 * (s == 2)} for s in (1, 2, 3)]
    lines = [json.dumps(r).encode() for r in recs]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(lines[0] + b"\n" + lines[1] + b"\n\xff\xfe garbage\n" + lines[2] + b"\n")
    assert goodput.lost_work(path, 1) == (2.5 + 3.0, 2)
    with pytest.raises(ValueError, match=rf"{path}:3: not UTF-8 \(byte b'\\xff' at offset {len(lines[0]) + len(lines[1]) + 2}\)"):
        read_metrics(path)
    assert truncate_metrics(path, 2) == 2
    assert path.read_bytes() == lines[0] + b"\n" + lines[1] + b"\n"


def test_a_record_cut_before_its_newline_gets_one(tmp_path):
    """A kill or a full disk can end the file at a whole record without its newline: the resumed run's first
    record must start a line of its own, not run on after it."""
    from ling2.train.metrics import MetricsWriter, truncate_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)]
    path.write_text(lines[0] + "\n" + lines[1])
    assert truncate_metrics(path, 2) == 0
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    w = MetricsWriter(tmp_path, tensorboard=False, start_step=2)
    w.write(3, {"loss": 0.5})
    w.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_records_out_of_order_or_without_an_integer_step_are_dropped(tmp_path):
    """Damage a trainer never writes (a step again or an earlier one, a step that is not an integer, a record
    that is not an object, a goodput value that is not a number) is dropped on resume, and lost_work (the
    seconds by hand: 2 + 3) reads past it without a traceback."""
    from ling2.train.metrics import truncate_metrics

    good = [{"step": 1, "goodput/step_s": 1.0}, {"step": 2, "goodput/step_s": 2.0}, {"step": 3, "goodput/step_s": 3.0}]
    bad = ['{"step": 1e400}', '{"step": "2"}', '{"step": true}', "[1, 2]", '{"step": 1, "goodput/step_s": 9.0}',
           '{"step": 2, "goodput/step_s": [1]}']
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([json.dumps(good[0]), json.dumps(good[1]), *bad, json.dumps(good[2])]) + "\n")
    assert goodput.lost_work(path, 1) == (2.0 + 3.0, 2)
    assert truncate_metrics(path, 5) == len(bad)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in good)


def test_a_metrics_file_that_cannot_be_written_is_one_named_error(tmp_path):
    """A full disk under metrics.jsonl (/dev/full answers every write with ENOSPC) stops the run with a
    TrainingError naming the file and the step, not an OSError traceback (the binary: bad_inputs_test)."""
    from ling2.train.errors import TrainingError
    from ling2.train.metrics import MetricsWriter

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    w = MetricsWriter(tmp_path, tensorboard=False)
    with pytest.raises(TrainingError, match=rf"{tmp_path}/metrics\.jsonl: writing the record of step 3 failed: disk "
                                            r"full \(no space left on device\)"):
        w.write(3, {"loss": 1.0})
    w.close()


def test_tensorboard_events_on_a_full_disk_are_one_named_error(tmp_path, monkeypatch):
    """The event file is written on the loop's thread: a full disk is a TrainingError naming the directory, not a
    traceback from tensorboardX's writer thread or its atexit flush after the run stopped."""
    from tensorboardX import record_writer

    from ling2.train.errors import TrainingError
    from ling2.train.metrics import MetricsWriter

    monkeypatch.setattr(record_writer, "open_file", lambda path: open("/dev/full", "wb"))
    with pytest.raises(TrainingError, match=rf"{tmp_path}/tensorboard: opening the TensorBoard event file failed: disk "
                                            r"full \(no space left on device\)"):
        MetricsWriter(tmp_path, tensorboard=True)
