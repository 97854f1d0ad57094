"""The training loop: build, restore, step, log, checkpoint, stop cleanly on signals.

`run(cfg, run_dir, ...)` is the library entry point; `train.py` is the absl binary around it.
"""

import dataclasses
import functools
import signal
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.layers import sharding
from ling2.layers.counting import training_flops_per_token
from ling2.layers.losses import cross_entropy_sums
from ling2.layers.moe_router import router_metrics
from ling2.train import step as step_lib
from ling2.train.checkpoint import Checkpointer
from ling2.train.metrics import MetricsWriter, progress_line
from ling2.train.model import Model, count_params
from ling2.train.optim import make_optimizer


class TrainingError(RuntimeError):
    pass


@dataclasses.dataclass
class RunResult:
    losses: dict  # step -> loss
    final_step: int
    run_dir: Path
    checkpoint_dir: Path
    metrics_path: Path
    skipped_total: int
    stopped_by_signal: bool


def init_state(cfg, mesh, seed: Optional[int] = None):
    """Builds the model and optimizer state, sharded on `mesh` by the logical axis rules."""
    seed = cfg.seed if seed is None else seed

    def build():
        model = Model(cfg, rngs=nnx.Rngs(seed))
        gd, params, rest = nnx.split(model, step_lib.trainable_filter(cfg), ...)
        return gd, params, rest

    gd, params_abs, rest_abs = jax.eval_shape(build)
    tx, sched = make_optimizer(cfg, params_abs)
    shard_params = sharding.state_shardings(params_abs, mesh, cfg.logical_axis_rules)
    shard_rest = sharding.state_shardings(rest_abs, mesh, cfg.logical_axis_rules)

    @functools.partial(jax.jit, out_shardings=(shard_params, shard_rest))
    def make():
        _, p, r = build()
        return p, r

    with sharding.use_mesh(mesh, cfg.logical_axis_rules):
        params, rest = make()
    opt_state = jax.jit(tx.init)(params)
    zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the step donates its state
    state = step_lib.TrainState(step=zero(), params=params, rest=rest, opt_state=opt_state, skipped=zero(),
                                skipped_total=zero())
    # Counters (and optax's count) come out on one device: replicate them over the mesh, or a state
    # restored across processes lands on devices the step's other inputs do not share.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.tree.map(lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
                         else jax.device_put(x, replicated, may_alias=False), state)
    return gd, tx, sched, state


def to_global(batch: dict, cfg, mesh) -> dict:
    """Host-local numpy [M, b_local, S] -> global arrays [M, b, S], rows sharded like activations."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        b = v.shape[1] * jax.process_count()
        spec = sharding.logical_to_spec(("activation_batch",), (b,), sharding.rules_dict(cfg.logical_axis_rules), mesh)
        shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec))
        if jax.process_count() == 1:
            out[k] = jax.device_put(v, shard)
        else:
            out[k] = jax.make_array_from_process_local_data(shard, v)
    return out


def moe_metrics(moe: dict, k: int) -> dict:
    """Per-layer router metrics from summed counts/stats, and the worst case over layers."""
    out = {}
    for i, counts in moe["counts"].items():
        out[f"layer_{i}"] = router_metrics(counts, moe["stats"][i], k)
    if out:
        out["max_violation_max"] = max(float(v["max_violation"]) for v in out.values() if "max_violation" in v)
    return out


def load_parameters(cfg, gd, state, tx):
    """Replaces the initial weights with a converted checkpoint's (same shardings); fresh optimizer state."""
    from ling2.convert.convert import load_into

    model = nnx.merge(gd, state.params, state.rest)
    shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.rest))
    load_into(model, cfg.load_parameters_path, cfg)
    _, params, rest = nnx.split(model, step_lib.trainable_filter(cfg), ...)
    params, rest = jax.device_put((params, rest), shardings)
    return state.replace(params=params, rest=rest, opt_state=jax.jit(tx.init)(params))


def _fields(state) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


class _Signals:
    """Records SIGTERM/SIGINT so the loop can checkpoint and exit between steps."""

    def __init__(self):
        self.received = None

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def peak_flops_per_device() -> float:
    """Peak dense FLOP/s of one device: a table for accelerators, a quick fp32 matmul measure on CPU."""
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "").lower()
    table = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12, "v5e": 197e12, "v5p": 459e12,
             "v6e": 918e12, "v4": 275e12}
    for k, v in table.items():
        if k in kind:
            return v
    n = 1024
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(3):  # best of three: the machine may be busy
        t = time.perf_counter()
        for _ in range(5):
            y = f(x)
        y.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 5 * 2 * n**3 / best / max(len(jax.local_devices()), 1)


def run(cfg, run_dir, make_iter: Callable[[object, str, int], Iterator], *, max_consecutive_skips: int = 5,
        dry_run: bool = False, tensorboard: bool = True, log: Callable[[str], None] = print,
        stop_after: Optional[int] = None, devices=None) -> RunResult:
    """Trains `cfg.steps` steps (resuming from the latest checkpoint in run_dir).

    make_iter(cfg, split, num_devices) gives this host's batches [M, b, S]; `devices`
    (default: all) make the mesh.
    """
    run_dir = Path(run_dir)
    mesh = sharding.make_mesh(cfg, devices)
    train_iter = make_iter(cfg, "train", mesh.size)  # data errors before the model is built
    gd, tx, sched, state = init_state(cfg, mesh)
    step_fn = jax.jit(functools.partial(step_lib.train_step, gd, tx, cfg, lr_fn=sched), donate_argnums=(0,))
    log(f"model: {cfg.model_name}, {count_params(nnx.merge(gd, state.params, state.rest)) / 1e6:.2f}M params, "
        f"mesh {dict(mesh.shape)}")

    if dry_run:
        batch = to_global(next(train_iter), cfg, mesh)
        with sharding.use_mesh(mesh, cfg.logical_axis_rules):
            compiled = step_fn.lower(state, batch).compile()
        mem = compiled.memory_analysis()
        fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                  "generated_code_size_in_bytes")
        log("dry run: train step compiled; memory per device (XLA memory analysis):")
        total = 0
        for f in fields:
            v = int(getattr(mem, f, 0) or 0)
            total += v if f != "alias_size_in_bytes" else -v
            log(f"  {f:32s} {v / 2**20:10.1f} MiB")
        log(f"  {'total (args+out+temp-alias)':32s} {total / 2**20:10.1f} MiB")
        return RunResult({}, 0, run_dir, run_dir / "checkpoints", run_dir / "metrics.jsonl", 0, False)

    ckpt = Checkpointer(run_dir / "checkpoints", cfg) if cfg.enable_checkpointing else None
    start = 0
    if ckpt is not None and ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        restored, meta = ckpt.restore(start, _fields(state), train_iter)
        state = step_lib.TrainState(**restored)
        log(f"resumed from {ckpt.directory / str(start)} (step {start})")
    elif cfg.load_parameters_path:
        state = load_parameters(cfg, gd, state, tx)
        log(f"initial weights from {cfg.load_parameters_path}")

    writer = MetricsWriter(run_dir, tensorboard=tensorboard)
    flops_tok = training_flops_per_token(cfg)
    peak = peak_flops_per_device() * mesh.size
    tokens_per_step = None
    losses, stopped = {}, False
    t_window, wait_window, steps_window = time.perf_counter(), 0.0, 0
    t_start = time.perf_counter()
    with _Signals() as sig, sharding.use_mesh(mesh, cfg.logical_axis_rules):
        step = start
        while step < cfg.steps:
            if sig.received:
                log(f"received {sig.received}: saving a checkpoint at step {step} and exiting")
                stopped = True
                break
            if stop_after is not None and step >= stop_after:
                break
            t0 = time.perf_counter()
            host_batch = next(train_iter)
            batch = to_global(host_batch, cfg, mesh)
            wait_window += time.perf_counter() - t0
            if tokens_per_step is None:
                tokens_per_step = int(np.prod(batch["inputs"].shape))
            state, metrics = step_fn(state, batch)
            step += 1
            steps_window += 1
            if int(state.skipped) > 0:
                log(f"step {step}: non-finite loss or gradient, update skipped ({int(state.skipped)} in a row)")
                if int(state.skipped) >= max_consecutive_skips:
                    writer.close()
                    if ckpt is not None:
                        ckpt.close()
                    raise TrainingError(f"{max_consecutive_skips} consecutive non-finite steps at step {step}; "
                                        f"stopping with the last good checkpoint kept")
            if step % cfg.log_period == 0 or step == cfg.steps:
                m = jax.device_get(metrics)
                dt = time.perf_counter() - t_window
                tps = steps_window * tokens_per_step / dt
                moe = m.pop("moe")
                m.update(tokens_per_s=tps, mfu=tps * flops_tok / peak, data_wait_frac=wait_window / dt,
                         step_time_s=dt / steps_window, skipped_total=int(state.skipped_total))
                if cfg.log_router_stats:
                    m["router"] = moe_metrics(moe, cfg.num_experts_per_tok)
                if cfg.eval_interval and step % cfg.eval_interval == 0:
                    m["eval_loss"] = evaluate(cfg, mesh, gd, state, make_iter)
                losses[step] = float(m["loss"])
                writer.write(step, m)
                eta = (cfg.steps - step) * dt / steps_window
                log(progress_line(step, cfg.steps, m, eta))
                t_window, wait_window, steps_window = time.perf_counter(), 0.0, 0
            if ckpt is not None and int(state.skipped) == 0:  # after logging: saved steps have metrics
                ckpt.save(step, _fields(state), train_iter, {"step": step})
    if ckpt is not None:
        ckpt.save(step, _fields(state), train_iter, {"step": step}, force=True)
        ckpt.close()
    writer.close()
    log(f"done: {step} steps in {time.perf_counter() - t_start:.1f}s")
    return RunResult(losses, step, run_dir, run_dir / "checkpoints", run_dir / "metrics.jsonl",
                     int(state.skipped_total), stopped)


def evaluate(cfg, mesh, gd, state, make_iter) -> float:
    """Token-averaged CE over cfg.eval_steps batches of the validation split."""
    it = make_iter(cfg, "valid", mesh.size)

    @jax.jit
    def ce(params, rest, mb):
        model = nnx.merge(gd, params, rest)
        out = model.decoder(mb["inputs"], mb["positions"], mb["segment_ids"], mb["segment_ids"] != 0)
        s, n, _ = cross_entropy_sums(out.logits, mb["targets"], mb["loss_weights"])
        return s, n

    tot, cnt = 0.0, 0.0
    for _ in range(max(cfg.eval_steps, 1)):
        batch = to_global(next(it), cfg, mesh)
        for m in range(batch["inputs"].shape[0]):
            s, n = ce(state.params, state.rest, jax.tree.map(lambda x: x[m], batch))
            tot, cnt = tot + float(s), cnt + float(n)
    return tot / max(cnt, 1.0)
