"""Resuming a run: a damaged latest checkpoint is skipped for the one before (and the resumed losses are the
uninterrupted run's), records past the restored step leave metrics.jsonl and TensorBoard, a changed config
is refused or warned about by its class, and a run that ends on a skipped step does not save it.

References: the uninterrupted run's own losses (bit-identical resume), TensorBoard files read back with an
independent reader (`testing/tb_events.py`), hand-written config diffs.
"""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from ling2.checkpoint.manager import ResumeConfigError
from ling2.config import load_config
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.testing import e2e, tb_events
from ling2.train.train import find_file

MAKE = make_iterator_factory(find_file)


def cfg(**over):
    return load_config(*e2e.MICRO, "async_checkpointing=false", config_file=find_file("configs/train/tiny_sample.yml"),
                       **{"steps": 4, "checkpoint_period": 2, **over})


def run(c, run_dir, logs=None, make=MAKE, **kw):
    return loop.run(c, run_dir, make, log=(logs.append if logs is not None else lambda s: None),
                    devices=jax.devices()[:1], **{"tensorboard": False, **kw})


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A finished 4-step run (checkpoints 2 and 4, TensorBoard on) and its per-step losses."""
    d = tmp_path_factory.mktemp("template")
    run(cfg(), d, tensorboard=True)
    return d, e2e.losses(d)


def copy(template, dst):
    shutil.copytree(template[0], dst)
    return dst


def raw_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_damaged_latest_checkpoint_falls_back_and_history_is_rewound(template, tmp_path):
    d = copy(template, tmp_path / "run")
    victim = max((p for p in (d / "checkpoints" / "4" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    assert raw_steps(d) == [1, 2, 3, 4]
    logs = []
    result = run(cfg(), d, logs, tensorboard=True)
    assert any("checkpoints/4 is unusable" in line and "checksum mismatch" in line for line in logs), logs
    assert any("resumed from" in line and "(step 2)" in line for line in logs)
    assert result.final_step == 4 and (d / "checkpoints" / "4.rejected").is_dir()
    assert e2e.saved_steps(d) == [2, 4]
    assert e2e.losses(d) == template[1]  # steps 3 and 4 again, from step 2's state: the same losses
    assert raw_steps(d) == [1, 2, 3, 4]  # the first run's records of 3 and 4 were dropped, not duplicated
    tb = tb_events.scalars(d)
    want = {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}
    assert sorted(tb["loss"]) == [1, 2, 3, 4]
    np.testing.assert_allclose([tb["loss"][s] for s in range(1, 5)], [want[s] for s in range(1, 5)], rtol=1e-6)
    assert {"lr", "grad_norm", "tokens_per_s", "mtp_loss/depth_1"} <= set(tb)


def test_tensorboard_events_hold_every_logged_scalar(template):
    """Every scalar of every metrics.jsonl record is in the event files at its step (float32 precision)."""
    d, _ = template
    tb = tb_events.scalars(d)
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        for k, v in r.items():
            if k in ("step", "time"):
                continue
            assert k in tb and r["step"] in tb[k], (k, r["step"])
            np.testing.assert_allclose(tb[k][r["step"]], float(v), rtol=1e-6, atol=1e-30)


def test_changed_config_refused_or_warned(template, tmp_path):
    """Model, data and batch changes are refused with a diff before the model is built; schedule changes
    train on with a warning."""
    d = copy(template, tmp_path / "run")
    for over, line in [({"base_emb_dim": 96}, "base_emb_dim: 64 -> 96"), ({"data_seed": 7}, "data_seed: 1234 -> 7"),
                       ({"per_device_batch_size": 4}, "per_device_batch_size: 2.0 -> 4.0")]:
        logs = []
        with pytest.raises(ResumeConfigError, match=line):
            run(cfg(steps=6, **over), d, logs)
        assert not any(s.startswith("model:") for s in logs)  # refused before the model was built
    logs = []
    result = run(cfg(steps=6, learning_rate=1e-4, lr_schedule="constant"), d, logs)
    assert result.final_step == 6
    assert "warning: resuming with learning_rate changed: 0.002 -> 0.0001" in logs
    assert "warning: resuming with lr_schedule changed: 'cosine' -> 'constant'" in logs
    assert "warning: resuming with steps changed: 4 -> 6" in logs


def test_a_signal_while_the_run_starts_stops_it_before_its_first_step(template, tmp_path):
    """A signal while the run opens its data, restores or compiles (a preemption of a slow start) is kept for the
    loop, which stops before its first step with a checkpoint of the state it started from, as a signal later does
    (it used to end the process: no checkpoint, and a signal status a launcher does not requeue)."""
    def make(c, split, n, share):
        os.kill(os.getpid(), signal.SIGINT)
        return MAKE(c, split, n, share)

    logs = []
    result = run(cfg(), tmp_path / "fresh", logs, make=make)
    assert result.stopped_by_signal and result.final_step == 0
    assert "received SIGINT: saving a checkpoint at step 0 and exiting" in logs
    assert e2e.saved_steps(tmp_path / "fresh") == [0]
    d = copy(template, tmp_path / "resumed")  # resumed at its last step 4 of 6: nothing new to save
    result = run(cfg(steps=6), d, logs, make=make)
    assert result.stopped_by_signal and result.final_step == 4 and e2e.saved_steps(d) == [2, 4]
    result = run(cfg(), tmp_path / "fresh", logs)  # and step 0's checkpoint resumes to the uninterrupted losses
    assert e2e.losses(tmp_path / "fresh") == template[1]
