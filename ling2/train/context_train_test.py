"""The trainer with context parallelism on 4 fake CPU devices: ici_context_parallelism=4 trains like a
context-1 run of the same global batch, and a kill -9 then resume reproduces its losses bit for bit.

Reference: the same trainer with the 4 devices on the fsdp axis (each row whole on one device)."""

import signal

import jax
import numpy as np

from ling2.config import load_config
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.testing import e2e
from ling2.train.train import find_file

STEPS = 20
COMMON = ["per_device_batch_size=1", "max_target_length=64", "gla_chunk_size=8", f"steps={STEPS}",
          "checkpoint_period=4", "async_checkpointing=true", "scan_layers=true"]
FOUR = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def test_context_4_trains_like_context_1_and_resumes_bit_exact(tmp_path):
    assert len(jax.devices()) == 4
    kv = dict(o.split("=", 1) for o in e2e.MICRO + COMMON)
    cfg = load_config(kv, ici_fsdp_parallelism=4, enable_checkpointing=False,
                      config_file=find_file("configs/train/tiny_sample.yml"))
    one = loop.run(cfg, tmp_path / "context1", make_iterator_factory(find_file), tensorboard=False,
                   log=lambda s: None).losses

    cp = ["ici_fsdp_parallelism=1", "ici_context_parallelism=4"]
    ref = e2e.start(tmp_path / "ref", *COMMON, *cp, **FOUR)
    out, _ = ref.communicate(timeout=900)
    assert ref.returncode == 0, out
    want = e2e.losses(tmp_path / "ref")
    assert sorted(want) == sorted(one) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([want[s] for s in sorted(want)], [one[s] for s in sorted(one)], rtol=2e-5)

    run = tmp_path / "killed"
    p = e2e.start(run, *COMMON, *cp, **FOUR)
    e2e.wait_for(lambda: any(s >= 8 for s in e2e.saved_steps(run)), p, timeout=900)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert max(e2e.losses(run)) < STEPS, "the run finished before it was killed"
    p = e2e.start(run, *COMMON, *cp, **FOUR)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    assert "resumed from" in out
    assert e2e.losses(run) == want  # bit-identical per-step losses
