"""8 fake CPU devices with fsdp/expert/tensor sharding train like 1 device (same global batch)."""

import jax
import numpy as np

from ling2.config import load_config
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.train import find_file

MICRO = dict(model_name="ling2-micro", max_target_length=32, eval_interval=0, eval_steps=0, data_split="98,2,0", log_period=1, steps=4,
             enable_checkpointing=False, warmup_steps_fraction=0.0)


def _run(tmp, devices, **kw):
    cfg = load_config(MICRO, kw, config_file=find_file("configs/train/tiny_sample.yml"))
    res = loop.run(cfg, tmp, make_iterator_factory(find_file), tensorboard=False, log=lambda s: None,
                   devices=devices)
    return res.losses


def test_eight_devices_match_one(tmp_path):
    assert len(jax.devices()) == 8
    one = _run(tmp_path / "one", jax.devices()[:1], per_device_batch_size=8, ici_fsdp_parallelism=1)
    eight = _run(tmp_path / "eight", jax.devices(), per_device_batch_size=1, ici_data_parallelism=1,
                 ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_tensor_parallelism=2)
    assert sorted(one) == sorted(eight) == [1, 2, 3, 4]
    np.testing.assert_allclose([eight[s] for s in sorted(eight)], [one[s] for s in sorted(one)], rtol=2e-4)
