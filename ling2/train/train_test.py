"""End-to-end trainer runs on a micro Ling2 over the bundled sample data.

Resume and signal tests drive the real binary in a subprocess; the sharding test runs the
loop in-process on 8 fake CPU devices against a 1-device run of the same global batch.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from ling2.config import load_config
from ling2.train import loop
from ling2.train.checkpoint import CheckpointError
from ling2.train.data import make_iterator_factory
from ling2.train.train import find_file

MICRO = ["model_name=ling2-tiny", "base_num_decoder_layers=2", "inhomogeneous_layer_cycle_interval=2",
         "base_emb_dim=64", "base_mlp_dim=128", "num_experts=8", "num_experts_per_tok=2", "n_routing_groups=1",
         "topk_routing_group=1", "max_target_length=32", "per_device_batch_size=2", "eval_interval=0",
         "eval_steps=0", "data_split=98,2,0", "log_period=1", "warmup_steps_fraction=0"]


def _binary():
    return [str(Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "ling2/train/train")]


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env.pop("XLA_FLAGS", None)
    return env


def _losses(run_dir) -> dict:
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        out[d["step"]] = d["loss"]  # a resumed run's record replaces the earlier one
    return out


def _start(run_dir, *args, **env):
    return subprocess.Popen(_binary() + [f"--run_dir={run_dir}", "--notensorboard", "--", *MICRO, *args],
                            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(pred, proc, timeout=300):
    t = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early:\n{proc.stdout.read()}")
        if time.time() - t > timeout:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


def _saved_steps(run_dir):
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def test_kill9_then_resume_reproduces_uninterrupted_losses(tmp_path):
    common = ["steps=40", "checkpoint_period=4", "async_checkpointing=false"]
    ref = _start(tmp_path / "ref", *common)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out
    assert "checkpoints:" in out and "metrics:" in out
    want = _losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, 41))

    run = tmp_path / "killed"
    p = _start(run, *common)
    _wait_for(lambda: any(s >= 8 for s in _saved_steps(run)), p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(_losses(run))
    assert killed_at < 40, "the run finished before it was killed"
    p = _start(run, *common)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "resumed from" in out
    got = _losses(run)
    assert sorted(got) == list(range(1, 41))
    assert got == want  # bit-identical per-step losses


def test_sigterm_saves_and_exits_zero(tmp_path):
    p = _start(tmp_path, "steps=100000", "checkpoint_period=1000")
    _wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and len(_losses(tmp_path)) >= 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "received SIGTERM" in out
    saved = _saved_steps(tmp_path)
    assert saved and saved[-1] >= 2 and saved[-1] < 1000


def test_bad_config_and_bad_data_are_one_line_errors(tmp_path):
    r = subprocess.run(_binary() + [f"--run_dir={tmp_path}", "num_expertz=3"], env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "error: bad config" in r.stderr and "num_experts" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run(_binary() + [f"--run_dir={tmp_path}", "--", *MICRO, "data_path=/nonexistent/prefix"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "DataError" in r.stderr and "/nonexistent/prefix" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_checkpoint_into_other_shape_names_parameter(tmp_path):
    cfg = load_config(*MICRO, "steps=2", "checkpoint_period=1", "async_checkpointing=false",
                      config_file=find_file("configs/train/tiny_sample.yml"))
    make = make_iterator_factory(find_file)
    loop.run(cfg, tmp_path, make, tensorboard=False, log=lambda s: None, devices=jax.devices()[:1])
    bigger = cfg.model_copy(update={"base_emb_dim": 96, "steps": 4})
    with pytest.raises(CheckpointError, match=r"embedding.*\(8192, 64\).*\(8192, 96\)"):
        loop.run(bigger, tmp_path, make, tensorboard=False, log=lambda s: None, devices=jax.devices()[:1])


def test_dry_run_prints_memory(tmp_path):
    r = subprocess.run(_binary() + [f"--run_dir={tmp_path}", "--dry_run", "--", *MICRO], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "temp_size_in_bytes" in r.stdout and "MiB" in r.stdout
    assert not (tmp_path / "checkpoints").exists()
