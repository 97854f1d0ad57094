"""The training loop: start or resume, step, log, evaluate, checkpoint, stop cleanly on signals.

`run(cfg, run_dir, make_iter, ...)` is the library entry point; `train.py` is the absl binary
around it. The loop dispatches step n+1 before it reads anything of step n, so the host
prepares batches while the devices compute. Every place that waits for the devices is marked
`# host sync` (here and in `ling2.train.hooks`, the periodic work): the previous step's finite flag
(ready by then), and log, eval and checkpoint steps.
"""

import dataclasses
import os
import resource
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp

from ling2.checkpoint.manager import Checkpointer
from ling2.checkpoint.manager import verify as checkpoint_verify
from ling2.checkpoint.safetensors_io import INDEX_NAME
from ling2.checkpoint.state import STATE_NAME, CheckpointError, finish_interrupted_save
from ling2.layers.model import count_params
from ling2.layers.spec import ModelSpec
from ling2.train import hooks
from ling2.train import step as step_lib
from ling2.train.errors import TrainingError
from ling2.train.eval import Evaluator
from ling2.train.metrics import MetricsWriter
from ling2.train import goodput as goodput_lib
from ling2.train.profiler import StepProfiler
from ling2.train.runtime import batch_sharding, data_share, make_mesh, peak_flops_per_device, to_global
from ling2.train.state import TrainSetup, TrainState, abstract_state, fields, init_state, load_parameters


@dataclasses.dataclass
class RunResult:
    losses: dict  # step -> loss
    final_step: int
    run_dir: Path
    checkpoint_dir: Path
    metrics_path: Path
    skipped_total: int
    stopped_by_signal: bool


def abstract_batch(cfg, mesh) -> dict:
    """ShapeDtypeStructs of one global step batch [M, b, S], sharded as `to_global` shards it."""
    M, b, S = cfg.gradient_accumulation_steps, cfg.micro_batch_size(mesh.size), cfg.max_target_length
    sh = batch_sharding(cfg, mesh, b, S)
    out = {k: jax.ShapeDtypeStruct((M, b, S), jnp.int32, sharding=sh)
           for k in ("inputs", "targets", "positions", "segment_ids")}
    out["loss_weights"] = jax.ShapeDtypeStruct((M, b, S), jnp.float32, sharding=sh)
    return out


def host_peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compile_train_step(cfg, mesh, setup: TrainSetup, phases: dict | None = None):
    """The trainer's own step, lowered and compiled against `setup`'s abstract state (from
    `abstract_state`) and an abstract batch: nothing is materialised. `phases`, if given, gets the
    lowering's seconds and the host's peak RSS once lowered (before XLA compiles)."""
    step_fn = step_lib.jit_train_step(setup.graphdef, setup.tx, cfg, setup.schedule)
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        lowered = step_fn.lower(setup.state, abstract_batch(cfg, mesh))
        if phases is not None:
            phases.update(lower_s=time.perf_counter() - t0, host_peak_rss_lowered_bytes=host_peak_rss_bytes())
        return lowered.compile()


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                 "generated_code_size_in_bytes")


def dry_run(cfg, mesh, log: Callable[[str], None] = print) -> dict:
    """Compiles the train step for `mesh` from abstract state (no data, nothing materialised) and
    logs XLA's memory analysis per device. Returns {field: bytes, "total": bytes}."""
    compiled = compile_train_step(cfg, mesh, abstract_state(cfg, mesh))
    mem = compiled.memory_analysis()
    log("dry run: train step compiled; memory per device (XLA memory analysis):")
    out, total = {}, 0
    for f in MEMORY_FIELDS:
        v = int(getattr(mem, f, 0) or 0)
        out[f] = v
        total += v if f != "alias_size_in_bytes" else -v
        log(f"  {f:32s} {v / 2**20:10.1f} MiB")
    log(f"  {'total (args+out+temp-alias)':32s} {total / 2**20:10.1f} MiB")
    out["total"] = total
    return out


class _StopRequests:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop between steps; `stop(step)` says when, and the
    call says whether to stop before the next step (a signal, or `stop_after` steps reached).

    One process: Python handlers record the signal. Several processes: every one must stop at the
    same step, so SIGTERM is left to JAX's preemption sync service (its handler, installed by
    jax.distributed.initialize, spreads the notice to all processes; SIGINT is forwarded to it as
    SIGTERM), and `stop(step)` (multihost_utils.reached_preemption_sync_point, called at every step,
    as MaxText does) turns true on every process at the same step: the one after the largest step
    any process had reached when the notice arrived."""

    def __init__(self, log):
        self.received, self.stopped, self.log = None, False, log
        self.sync = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)
        if jax.process_count() > 1 and not self.sync:
            log("warning: jax_enable_preemption_service is off: a signal stops only the process that receives it")

    def __enter__(self):
        handled = (signal.SIGINT,) if self.sync else (signal.SIGTERM, signal.SIGINT)
        self._old = {s: signal.signal(s, self._handle) for s in handled}
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        if self.sync and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier listens for SIGTERM

    def stop(self, step: int) -> bool:
        if self.sync:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None

    def __call__(self, step: int, stop_after: Optional[int]) -> bool:
        """After `step` steps: stop on a signal (logged; `stopped` turns true) or once `stop_after` steps ran."""
        if self.stop(step):
            why = f"received {self.received}" if self.received else "stop requested (SIGTERM to one of the processes)"
            self.log(f"{why}: saving a checkpoint at step {step} and exiting")
            self.stopped = True
            return True
        return stop_after is not None and step >= stop_after

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def check_run_dir(run_dir: Path) -> None:
    """Raises TrainingError naming the path when run_dir cannot hold a run: it (or checkpoints/,
    tensorboard/) is a file, metrics.jsonl is a directory, or it cannot be created or written."""
    for p, want_dir in ((run_dir, True), (run_dir / "checkpoints", True), (run_dir / "tensorboard", True),
                        (run_dir / "metrics.jsonl", False)):
        if p.exists() and p.is_dir() != want_dir:
            raise TrainingError(f"run_dir: {p} exists and is {'not ' if want_dir else ''}a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise TrainingError(f"run_dir: {run_dir} cannot be created or written: {e.strerror or e}") from None


def check_load_parameters_path(path) -> None:
    """Raises CheckpointError unless `path` is a converter state directory or a trainer step directory
    whose files verify (cheap checks, before any model is built)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"load_parameters_path: {path} is not a directory")
    finish_interrupted_save(path)
    if (path / STATE_NAME / INDEX_NAME).is_file():
        return
    if not (path / STATE_NAME).is_dir():
        raise CheckpointError(f"load_parameters_path: {path} holds neither a converter state/ directory "
                              f"({STATE_NAME}/{INDEX_NAME}) nor a trainer step's state item")
    reason = checkpoint_verify(path, items=("state",))
    if reason is not None:
        raise CheckpointError(f"load_parameters_path: {path} is unusable: {reason}")


class _NonFinite:
    """Counts consecutive skipped updates (a non-finite loss or gradient) from each step's finite flag, and
    raises TrainingError (after `close()`) at `limit` in a row. A flag is read once the next step is
    dispatched, when it is ready and reading it leaves the devices busy; a step that logs or saves reads
    its own at once, so its record and checkpoint follow a known-good step."""

    def __init__(self, limit: int, log, close):
        self.limit, self.log, self.close = limit, log, close
        self.skips, self.pending = 0, None  # pending: (step, metrics) whose flag is not read yet

    def check(self, step: int, metrics, now: bool):
        """Reads the pending step's flag, then this step's if `now` (else it is pending)."""
        self.flush()
        self.pending = step, metrics
        if now:
            self.flush()

    def flush(self):
        if self.pending is None:
            return
        (step, metrics), self.pending = self.pending, None
        if float(metrics["finite"]):  # host sync
            self.skips = 0
            return
        self.skips += 1
        self.log(f"step {step}: non-finite loss or gradient, update skipped ({self.skips} in a row)")
        if self.skips >= self.limit:
            self.close()
            raise TrainingError(f"{self.limit} consecutive non-finite steps at step {step}; "
                                f"stopping with the last good checkpoint kept")


def _open(cfg, run_dir: Path, mesh, make_iter, log):
    """What a run starts from, checked before the model is built: run_dir, the train data (and the valid data
    when the run evaluates), the checkpoint to resume and its config, or load_parameters_path. Returns (train
    iterator, Checkpointer or None when checkpointing is off, the step to resume or None)."""
    check_run_dir(run_dir)
    train_iter = make_iter(cfg, "train", mesh.size, data_share(cfg, mesh))  # data errors before the model is built
    evaluates = (cfg.eval_interval and cfg.eval_interval <= cfg.steps) or cfg.merge_window
    if evaluates and cfg.eval_steps:
        make_iter(cfg, "valid", mesh.size, data_share(cfg, mesh))  # opened again at each evaluation
    ckpt = Checkpointer(run_dir / "checkpoints", cfg) if cfg.enable_checkpointing else None
    resume = ckpt.resume_step(log) if ckpt is not None else None
    if resume is not None:
        for line in ckpt.check_resume_config(resume, cfg, cfg.global_batch_size(mesh.size)):
            log(line)
    elif cfg.load_parameters_path:
        check_load_parameters_path(cfg.load_parameters_path)
    return train_iter, ckpt, resume


def _initial_state(cfg, run_dir: Path, mesh, setup: TrainSetup, ckpt, resume, train_iter, gp, log) -> TrainState:
    """The checkpoint's state (and data position) when resuming, charging `gp` the restore and the work the
    cut-short run did past it; else fresh parameters, or load_parameters_path's."""
    if resume is None:
        state = init_state(cfg, mesh, setup)
        if cfg.load_parameters_path:
            state = load_parameters(cfg, setup, state)
            log(f"initial weights from {cfg.load_parameters_path}")
        return state
    lost_s, gp.lost_steps = goodput_lib.lost_work(run_dir / "metrics.jsonl", resume)
    gp.add("lost", lost_s)
    with gp.timed("restore"):
        restored, _ = ckpt.restore(resume, fields(setup.state), train_iter)
    state = TrainState(**restored)
    log(f"resumed from {ckpt.step_dir(resume)} (step {resume})")
    return state


def run(cfg, run_dir, make_iter: Callable[..., Iterator], *, max_consecutive_skips: int = 5,
        dry_run_only: bool = False, tensorboard: bool = True, log: Callable[[str], None] = print,
        stop_after: Optional[int] = None, devices=None) -> RunResult:
    """Trains `cfg.steps` steps (resuming from the newest good checkpoint in run_dir).

    make_iter(cfg, split, num_devices, share) gives this host's batches [M, b, S] (the rows of its
    `runtime.DataShare`, whole: a context group spanning processes loads the same rows in each); `devices`
    (default: all) make the mesh. `dry_run_only` compiles the step and returns (see `dry_run`).
    Everything a user can get wrong (run_dir, mesh, data, the checkpoint to resume and its config,
    load_parameters_path) is checked before the model is built. Each step: the stop checks, the next
    batch, the step, a poll of the background save, finite flags (`_NonFinite`), the hooks due (`hooks`).
    """
    run_dir = Path(run_dir)
    mesh = make_mesh(cfg, devices)
    if dry_run_only:
        dry_run(cfg, mesh, log)
        return RunResult({}, 0, run_dir, run_dir / "checkpoints", run_dir / "metrics.jsonl", 0, False)

    # From here a signal is kept for the loop: one while the run starts (data, restore, compile) stops it before
    # its first step, with a checkpoint of the state it starts from.
    with _StopRequests(log) as stop:
        train_iter, ckpt, resume = _open(cfg, run_dir, mesh, make_iter, log)
        setup = abstract_state(cfg, mesh)
        params = count_params(ModelSpec.of(cfg))["total"]
        log(f"model: {cfg.model_name}, {params / 1e6:.2f}M params, mesh {dict(mesh.shape)}")
        step_fn = step_lib.jit_train_step(setup.graphdef, setup.tx, cfg, setup.schedule)
        start, gp = resume or 0, goodput_lib.Goodput()
        state = _initial_state(cfg, run_dir, mesh, setup, ckpt, resume, train_iter, gp, log)
        saver = hooks.Save(ckpt, train_iter, {"global_batch": cfg.global_batch_size(mesh.size)}, log)
        writer = MetricsWriter(run_dir, tensorboard=tensorboard, start_step=start)
        evaluator = Evaluator(cfg, mesh, setup.graphdef, make_iter) if cfg.eval_interval or cfg.merge_window else None
        logger = hooks.Log(cfg, writer, gp, log, peak_flops_per_device() * mesh.size, start,
                           evals=[hooks.Eval(cfg, evaluator), hooks.MergedEval(cfg, evaluator, ckpt)])
        t_start = time.perf_counter()
        profiler = StepProfiler(cfg, run_dir, log)

        def close():
            writer.close()
            if ckpt is not None:
                ckpt.close()

        nonfinite = _NonFinite(max_consecutive_skips, log, close)
        with jax.set_mesh(mesh):
            step = start
            while step < cfg.steps and not stop(step, stop_after):
                with gp.timed("data_wait"):
                    batch = to_global(next(train_iter), cfg, mesh)
                with gp.timed("compile" if step == start else "step"):
                    with profiler.step(step):
                        state, metrics = step_fn(state, batch)
                    if step == start:  # tracing and compiling happen in the first call
                        jax.block_until_ready(metrics)
                step += 1
                with gp.timed("step"):
                    saver.poll(step, close)
                    profiler.after(step, state)
                    logging, saving = logger.due(step), saver.due(step)
                    nonfinite.check(step, metrics, now=logging or saving)  # host sync when now
                    record = logger.record(step, state, metrics, batch) if logging else None  # host sync
                if logging:
                    logger(step, state, record)
                if saving and nonfinite.skips == 0:  # after logging: saved steps have metrics; never after a skip
                    with gp.timed("checkpoint"):
                        saver(step, state)
            nonfinite.flush()
            profiler.after(step, state, last=True)
        with gp.timed("checkpoint" if ckpt is not None else None):
            saver.last(step, state, nonfinite.skips)
            close()
        log(f"done: {step} steps in {time.perf_counter() - t_start:.1f}s")
        log(goodput_lib.summary_line(gp.summary()))
        return RunResult(logger.losses, step, run_dir, run_dir / "checkpoints", run_dir / "metrics.jsonl",
                         int(state.skipped_total), stop.stopped)
