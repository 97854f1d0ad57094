"""The training loop's periodic work, one small object per kind: the metrics record (`Log`), evaluation
(`Eval`) and evaluation of the WSM merge (`MergedEval`), both inside a logged step, and checkpoint saves
(`Save`). The profiler is `ling2.train.profiler.StepProfiler`.

Each hook says with `due(step)` whether it runs after `step` steps and does its work when called. The
loop (`ling2.train.loop.run`) decides the order: the record of a logged step (its evaluations included)
is written before that step is saved, so every saved step has metrics.
"""

import jax

from ling2.checkpoint.state import CheckpointError
from ling2.layers.model import training_flops_per_token
from ling2.layers.spec import ModelSpec
from ling2.layers.moe.router import router_metrics
from ling2.train.eval import merged_state
from ling2.train.metrics import progress_line
from ling2.train.state import fields


def moe_metrics(moe: dict, k: int) -> dict:
    """Per-layer router metrics from summed counts/stats, and the worst case over layers."""
    out = {}
    for i, counts_E in moe["counts"].items():
        out[f"layer_{i}"] = router_metrics(counts_E, moe["stats"][i], k)
    if out:
        out["max_violation_max"] = max(float(v["max_violation"]) for v in out.values() if "max_violation" in v)
    return out


class Eval:
    """Held-out loss every `eval_interval` steps (0: never), into the step's record as `eval_loss`, so a
    run's quality is tracked on data it does not train on."""

    def __init__(self, cfg, evaluator):
        self.every, self.evaluator = cfg.eval_interval, evaluator

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, step: int, state, record: dict):
        record["eval_loss"] = self.evaluator.evaluate(state)  # host sync


class MergedEval:
    """Held-out loss of the average of the newest `merge_window` checkpoints up to the step (WSM: merging
    stands in for a learning-rate decay), every `merge_every` steps (0: every `eval_interval`), into the
    record as `eval/merged_loss` and `eval/merged_from_step` (the window's first step). Nothing until
    that many checkpoints exist; the save in flight is waited for first, so it counts."""

    def __init__(self, cfg, evaluator, ckpt):
        self.cfg, self.evaluator, self.ckpt = cfg, evaluator, ckpt
        self.window, self.every = cfg.merge_window, cfg.merge_every or cfg.eval_interval

    def due(self, step: int) -> bool:
        return bool(self.window) and step % self.every == 0

    def __call__(self, step: int, state, record: dict):
        self.ckpt.wait()
        window = sorted(s for s in self.ckpt.steps() if s <= step)[-self.window:]
        if len(window) == self.window:
            merged = merged_state(state, [self.ckpt.step_dir(s) for s in window], self.cfg)
            record["eval/merged_loss"] = self.evaluator.evaluate(merged)  # host sync
            record["eval/merged_from_step"] = window[0]


class Log:
    """The metrics record of every `log_period`-th step, the last step and every step an evaluation is due:
    the step's metrics, throughput, MFU, data-wait fraction and step time over the window since the
    previous record (timed by `gp.clock`), router stats if `log_router_stats`, the evaluations, and the
    window's goodput (`gp.take()`). Written to `writer`, summed up in a progress line, its loss kept in `losses`.

    Two parts, so the loop can charge them apart: `record` (train-step time: it waits for the step) and
    the call (evaluations, charged as eval, then the writes)."""

    def __init__(self, cfg, writer, gp, log, peak_flops: float, start: int, evals: list):
        self.cfg, self.writer, self.gp, self.log, self.evals = cfg, writer, gp, log, evals
        self.flops_per_token = training_flops_per_token(ModelSpec.of(cfg), cfg.max_target_length)
        self.peak_flops = peak_flops
        self.losses = {}  # step -> loss
        self.window_start, self.t_window = start, gp.clock()
        self.eta = None

    def due(self, step: int) -> bool:
        return step % self.cfg.log_period == 0 or step == self.cfg.steps or any(e.due(step) for e in self.evals)

    def record(self, step: int, state, metrics: dict, batch: dict) -> dict:
        """The step's metrics on the host (host sync) with the window's rates; `batch` is the step's (every
        batch has one shape), for tokens per step."""
        m = jax.device_get(metrics)
        dt, n = self.gp.clock() - self.t_window, step - self.window_start
        tps = n * batch["inputs"].size / dt
        moe = m.pop("moe")
        m.update(tokens_per_s=tps, mfu=tps * self.flops_per_token / self.peak_flops,
                 data_wait_frac=self.gp.window["data_wait"] / dt, step_time_s=dt / n,
                 skipped_total=int(state.skipped_total))  # host sync
        if self.cfg.log_router_stats:
            m["router"] = moe_metrics(moe, self.cfg.num_experts_per_tok)
        self.eta = (self.cfg.steps - step) * dt / n
        return m

    def __call__(self, step: int, state, record: dict):
        for e in self.evals:
            if e.due(step):
                with self.gp.timed("eval"):
                    e(step, state, record)
        self.losses[step] = float(record["loss"])
        self.writer.write(step, {**record, **self.gp.take()})
        self.log(progress_line(step, self.cfg.steps, record, self.eta))
        self.window_start, self.t_window = step, self.gp.clock()


class Save:
    """Checkpoint saves of the state, the data position and `meta` plus the step: every
    `checkpoint_period`-th step not saved yet (`Checkpointer.due`) and, forced, the run's last step.
    `ckpt` None (checkpointing off): never due, nothing saved."""

    def __init__(self, ckpt, data_iter, meta: dict, log):
        self.ckpt, self.data_iter, self.meta, self.log = ckpt, data_iter, meta, log

    def due(self, step: int) -> bool:
        return self.ckpt is not None and self.ckpt.due(step)

    def __call__(self, step: int, state, force: bool = False):
        self.ckpt.save(step, fields(state), self.data_iter, {"step": step, **self.meta}, force=force)

    def poll(self, step: int, close):
        """Raises the error of a background save that failed, after `close()`, naming the step that found
        it: the run stops at once rather than at the next checkpoint step."""
        if self.ckpt is None:
            return
        try:
            self.ckpt.poll()
        except CheckpointError as e:
            close()
            raise CheckpointError(f"{e} (found after step {step}; stopping)") from None

    def last(self, step: int, state, skips: int):
        """The run's final save (forced), unless `step` followed `skips` > 0 skipped (non-finite) steps, which
        no save follows: the newest checkpoint stays the last step taken after a good one."""
        if self.ckpt is None:
            return
        if skips == 0:
            self(step, state, force=True)
        else:
            self.log(f"step {step} followed {skips} skipped steps: not checkpointed")
