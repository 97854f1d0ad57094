"""Helpers for end-to-end trainer tests: a micro Ling2 on the bundled sample data, the
trainer binary in a subprocess, and readers for what a run leaves behind."""

import os
import subprocess
import time
from pathlib import Path

from ling2.checkpoint.state import published_steps
from ling2.train.metrics import read_metrics

MICRO = ["model_name=ling2-micro", "max_target_length=32", "per_device_batch_size=2", "eval_interval=0",
         "eval_steps=0", "data_split=98,2,0", "log_period=1", "warmup_steps_fraction=0"]
# One sequence over a context axis of 8 spanning processes: ling2-micro at 128 tokens (GLA chunks of 16, one per
# shard), 2 rows per step, 8 steps (the step count sizes the data index and the schedule: the same in every run)
CONTEXT_8 = ["max_target_length=128", "gla_chunk_size=16", "ici_context_parallelism=8", "ici_fsdp_parallelism=1",
             "per_device_batch_size=0.25", "checkpoint_period=1", "max_checkpoints_to_keep=10", "steps=8"]


def binary():
    return [str(Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "ling2/train/train")]


def env(**extra):
    """The test's environment for a trainer subprocess: CPU, one device unless XLA_FLAGS is given."""
    out = dict(os.environ, JAX_PLATFORMS="cpu")
    out.pop("XLA_FLAGS", None)
    out.update(extra)
    return out


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl")}


def logged(run_dir) -> int:
    """How many whole records metrics.jsonl holds so far (0 before the file or its first line exists)."""
    p = Path(run_dir) / "metrics.jsonl"
    return p.read_text().count("\n") if p.exists() else 0


def start(run_dir, *overrides, **extra_env):
    """Starts the trainer on the micro model with extra key=value overrides."""
    return subprocess.Popen(binary() + [f"--run_dir={run_dir}", "--notensorboard", "--", *MICRO, *overrides],
                            env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(pred, proc, timeout=300):
    t = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early:\n{proc.stdout.read()}")
        if time.time() - t > timeout:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


def saved_steps(run_dir):
    return published_steps(Path(run_dir) / "checkpoints")


