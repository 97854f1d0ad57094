"""Trainer benchmark: steps/s, tokens/s, CPU MFU, data-wait fraction, checkpoint cost, memory.

    bazel run //tools/bench/train:bench -- --out=/tmp/train_bench.json

For each model (ling2-tiny on the bundled sample data, ling2-small on synthetic data) it
times `--steps` train steps after compilation, the data wait between them, and checkpoint
saves, none in flight before (median of `--ckpt_reps` after `--ckpt_warmup`; each save is in the
JSON): a synchronous save until it is committed on disk (`ckpt_save_s`); an async save from the
call until the loop may go on, the state copy included (`ckpt_blocked_s`, target < 10% of a save),
and until it is committed (`ckpt_async_total_s`). Memory per device comes from XLA's memory
analysis of the compiled step.
"""

import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from ling2.config.paths import user_path
from ling2.layers.spec import ModelSpec
from tools.bench.report import planned_bytes

flags.DEFINE_string("out", "train_bench.json", "JSON output path (relative: the working directory).")
flags.DEFINE_integer("steps", 10, "Timed steps per model.")
flags.DEFINE_list("models", ["ling2-tiny", "ling2-small"], "Models to run.")
flags.DEFINE_integer("seq", 256, "Sequence length.")
flags.DEFINE_integer("batch", 4, "Per-device batch size.")
flags.DEFINE_integer("ckpt_reps", 3, "Timed checkpoint saves of each kind (median), after the warm-up saves.")
flags.DEFINE_integer("ckpt_warmup", 2, "Untimed saves of each kind first (first-save setup, allocator warm-up).")
FLAGS = flags.FLAGS


def bench_model(name: str) -> dict:
    from ling2.checkpoint.manager import Checkpointer
    from ling2.config import load_config
    from ling2.layers.model import count_params, training_flops_per_token
    from ling2.train import runtime
    from ling2.train import step as step_lib
    from ling2.train.state import abstract_state, init_state
    from ling2.train.data import make_iterator_factory
    from ling2.train.train import find_file

    over = dict(model_name=name, max_target_length=FLAGS.seq, per_device_batch_size=FLAGS.batch,
                steps=FLAGS.steps + 3, eval_interval=0, eval_steps=0, data_split="98,2,0", scan_layers=True)
    if name != "ling2-tiny":
        over["dataset_type"] = "synthetic"
    cfg = load_config(over, config_file=find_file("configs/train/tiny_sample.yml"))
    mesh = runtime.make_mesh(cfg)
    setup = abstract_state(cfg, mesh)
    state = init_state(cfg, mesh, setup)
    step_fn = step_lib.jit_train_step(setup.graphdef, setup.tx, cfg, setup.schedule)
    it = make_iterator_factory(find_file)(cfg, "train", mesh.size, runtime.data_share(cfg, mesh))
    with jax.set_mesh(mesh):
        batch = runtime.to_global(next(it), cfg, mesh)
        compiled = step_fn.lower(state, batch).compile()
        mem = compiled.memory_analysis()
        for _ in range(2):  # warm-up: the second call sees committed output shardings
            state, m = step_fn(state, batch)
        jax.block_until_ready(m)
        wait = 0.0
        t0 = time.perf_counter()
        for _ in range(FLAGS.steps):
            t = time.perf_counter()
            batch = runtime.to_global(next(it), cfg, mesh)
            wait += time.perf_counter() - t
            state, m = step_fn(state, batch)
        jax.block_until_ready(m)
        dt = time.perf_counter() - t0
    tokens = FLAGS.steps * batch["inputs"].size
    tps = tokens / dt
    peak = runtime.peak_flops_per_device() * mesh.size
    fields = {f: getattr(state, f) for f in ("step", "params", "rest", "opt_state", "skipped", "skipped_total")}
    with tempfile.TemporaryDirectory() as d:
        sync_s, blocked_s, async_s = [], [], []
        sync = Checkpointer(os.path.join(d, "sync"), cfg.model_copy(update={"async_checkpointing": False}))
        n = FLAGS.ckpt_warmup + FLAGS.ckpt_reps
        for k in range(n):
            t = time.perf_counter()
            sync.save(k + 1, fields, it, {"step": k + 1}, force=True)
            sync_s.append(time.perf_counter() - t)
        sync.close()
        asyn = Checkpointer(os.path.join(d, "async"), cfg.model_copy(update={"async_checkpointing": True}))
        for k in range(n):
            t = time.perf_counter()
            asyn.save(k + 1, fields, it, {"step": k + 1}, force=True)  # returns once the state is copied
            blocked_s.append(time.perf_counter() - t)
            asyn.wait()  # committed on disk
            async_s.append(time.perf_counter() - t)
        asyn.close()
    save_s, blocked, async_total = (float(np.median(x[FLAGS.ckpt_warmup:])) for x in (sync_s, blocked_s, async_s))
    per_device = planned_bytes(mem)
    return {"model": name, "params_M": count_params(ModelSpec.of(cfg))["total"] / 1e6, "steps_per_s": FLAGS.steps / dt,
            "tokens_per_s": tps, "mfu": tps * training_flops_per_token(ModelSpec.of(cfg), cfg.max_target_length) / peak, "data_wait_frac": wait / dt,
            "ckpt_save_s": save_s, "ckpt_blocked_s": blocked, "blocked_frac_of_save": blocked / save_s,
            "ckpt_async_total_s": async_total, "ckpt_each_save_s": sync_s, "ckpt_each_blocked_s": blocked_s,
            "mem_per_device_MiB": per_device / 2**20}


def main(argv):
    rows = [bench_model(n) for n in FLAGS.models]
    cols = ["model", "params_M", "steps_per_s", "tokens_per_s", "mfu", "data_wait_frac", "ckpt_save_s",
            "ckpt_blocked_s", "blocked_frac_of_save", "ckpt_async_total_s", "mem_per_device_MiB"]
    print(" | ".join(f"{c:>14s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]:>14s}" for c in cols))
    targets = {"data_wait_frac < 0.05": all(r["data_wait_frac"] < 0.05 for r in rows),
               "blocked_frac_of_save < 0.10": all(r["blocked_frac_of_save"] < 0.10 for r in rows)}
    print("targets:", targets)
    out = user_path(FLAGS.out)
    with open(out, "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count(),
                   "steps": FLAGS.steps, "seq": FLAGS.seq, "batch": FLAGS.batch, "ckpt_warmup": FLAGS.ckpt_warmup,
                   "ckpt_reps": FLAGS.ckpt_reps, "rows": rows, "targets": targets},
                  f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
