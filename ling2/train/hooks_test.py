"""The loop's pieces without a model: goodput's `timed` on a fake clock, the hooks' schedules and records,
the deferred finite-flag check, the save hook's poll and final save, and `run`'s length.

References: hand-computed schedules and seconds (the fake clock advances by set amounts)."""

import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from ling2.checkpoint.state import CheckpointError
from ling2.config import load_config
from ling2.train import goodput, hooks, loop


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _cfg(**over):
    return load_config(model_name="ling2-micro", **{"steps": 20, "log_period": 5, "eval_interval": 0, **over})


def test_timed_charges_the_body_to_its_kind():
    clock = Clock()
    gp = goodput.Goodput(clock=clock)
    with gp.timed("data_wait"):
        clock.t += 2.0
    with gp.timed("data_wait"):
        clock.t += 0.5
    with gp.timed(None):
        clock.t += 7.0
    with pytest.raises(ValueError), gp.timed("step"):
        clock.t += 3.0
        raise ValueError
    gp.add("eval", 1.0)
    assert gp.window["data_wait"] == 2.5 and gp.window["step"] == 0 and gp.window["eval"] == 1.0
    rec = gp.take()
    assert rec["goodput/data_wait_s"] == 2.5 and rec["goodput/eval_s"] == 1.0
    assert gp.window["data_wait"] == 0 and gp.total["data_wait"] == 2.5


def test_schedules():
    cfg = _cfg(eval_interval=4, merge_window=2, merge_every=6)
    ev, merged = hooks.Eval(cfg, None), hooks.MergedEval(cfg, None, None)
    log = hooks.Log(cfg, None, goodput.Goodput(), print, 1.0, 0, evals=[ev, merged])
    steps = range(1, 21)
    assert [s for s in steps if ev.due(s)] == [4, 8, 12, 16, 20]
    assert [s for s in steps if merged.due(s)] == [6, 12, 18]
    assert [s for s in steps if log.due(s)] == [4, 5, 6, 8, 10, 12, 15, 16, 18, 20]
    # merge_every 0: the merge is evaluated at each eval_interval; no eval_interval: never evaluated
    assert [s for s in steps if hooks.MergedEval(_cfg(eval_interval=4, merge_window=2), None, None).due(s)] == \
        [4, 8, 12, 16, 20]
    off = _cfg(steps=7, log_period=3)
    log = hooks.Log(off, None, goodput.Goodput(), print, 1.0, 0, evals=[hooks.Eval(off, None),
                                                                       hooks.MergedEval(off, None, None)])
    assert [s for s in range(1, 8) if log.due(s)] == [3, 6, 7]  # and the last step
    assert not hooks.Save(None, None, {}, print).due(4)


class Writer:
    def __init__(self):
        self.records = []

    def write(self, step, m):
        self.records.append((step, m))


def test_log_record_rates_and_window():
    clock = Clock()
    gp = goodput.Goodput(clock=clock)
    cfg = _cfg(eval_interval=4, log_router_stats=False)
    evaluator = SimpleNamespace(evaluate=lambda state: 3.25)
    writer, lines = Writer(), []
    log = hooks.Log(cfg, writer, gp, lines.append, peak_flops=1e9, start=2, evals=[hooks.Eval(cfg, evaluator)])
    batch = {"inputs": np.zeros((1, 4, 8), np.int32)}  # 32 tokens a step
    metrics = {"loss": np.float32(2.0), "lr": np.float32(1e-3), "moe": {}}
    gp.add("data_wait", 1.0)
    clock.t += 4.0  # steps 3 and 4 in 4 s
    rec = log.record(4, SimpleNamespace(skipped_total=np.int32(1)), metrics, batch)
    assert rec["tokens_per_s"] == 2 * 32 / 4.0 and rec["step_time_s"] == 2.0 and rec["data_wait_frac"] == 0.25
    assert rec["mfu"] == 16.0 * log.flops_per_token / 1e9 and rec["skipped_total"] == 1 and "moe" not in rec
    assert "router" not in rec
    clock.t += 1.0
    log(4, None, rec)
    (step, written), = writer.records
    assert step == 4 and written["eval_loss"] == 3.25 and written["goodput/eval_s"] == 0.0
    assert written["goodput/data_wait_s"] == 1.0 and log.losses == {4: 2.0}
    assert lines[0].startswith("step 4/20 | loss 2.0000") and "ETA 0:00:32" in lines[0]  # 16 steps at 2 s
    assert log.window_start == 4 and log.t_window == clock.t and gp.window["data_wait"] == 0


class Ckpt:
    def __init__(self, error=None):
        self.error, self.saved = error, []

    def poll(self):
        if self.error:
            raise CheckpointError(self.error)

    def save(self, step, state, data_iter, meta, force=False):
        self.saved.append((step, meta, force))


@dataclasses.dataclass
class State:
    params: int = 1


def test_save_poll_final_save():
    closed, lines = [], []
    saver = hooks.Save(Ckpt("/ckpt/4: saving the checkpoint failed"), None, {"global_batch": 8}, lines.append)
    with pytest.raises(CheckpointError, match=r"^/ckpt/4: saving the checkpoint failed \(found after step 6; "
                                              r"stopping\)$"):
        saver.poll(6, lambda: closed.append(True))
    assert closed == [True]
    ckpt = Ckpt()
    saver = hooks.Save(ckpt, None, {"global_batch": 8}, lines.append)
    saver.poll(7, lambda: closed.append(True))
    saver.last(7, State(), skips=2)
    assert ckpt.saved == [] and lines == ["step 7 followed 2 skipped steps: not checkpointed"]
    saver.last(7, State(), skips=0)
    assert ckpt.saved == [(7, {"step": 7, "global_batch": 8}, True)]
    hooks.Save(None, None, {}, lines.append).last(7, None, skips=1)  # checkpointing off: nothing, no line
    assert len(lines) == 1


class Flag:
    """A finite flag that records when it is read."""

    def __init__(self, value, reads, step):
        self.value, self.reads, self.step = value, reads, step

    def __float__(self):
        self.reads.append(self.step)
        return self.value


def test_finite_flags_are_read_one_step_late_unless_now():
    reads, lines, closed = [], [], []
    nf = loop._NonFinite(2, lines.append, lambda: closed.append(True))
    m = lambda step, ok: {"finite": Flag(float(ok), reads, step)}  # noqa: E731
    nf.check(1, m(1, True), now=False)
    assert reads == []
    nf.check(2, m(2, False), now=False)
    assert reads == [1] and nf.skips == 0
    nf.check(3, m(3, True), now=True)  # a logging step reads step 2's flag and its own
    assert reads == [1, 2, 3] and nf.skips == 0 and lines == ["step 2: non-finite loss or gradient, update "
                                                              "skipped (1 in a row)"]
    nf.check(4, m(4, False), now=False)
    nf.check(5, m(5, False), now=False)
    assert nf.skips == 1 and not closed
    with pytest.raises(loop.TrainingError, match="^2 consecutive non-finite steps at step 5; stopping"):
        nf.flush()
    assert closed == [True]


def test_run_fits_on_a_screen():
    assert len(inspect.getsource(loop.run).splitlines()) <= 80
