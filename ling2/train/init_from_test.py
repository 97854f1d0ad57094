"""`load_parameters_path` starts a new run from another run's (or a converted) checkpoint.

Reference: the source step's parameters as orbax restores them directly.
"""

import jax
import numpy as np

from ling2.config import load_config
from ling2.checkpoint.manager import Checkpointer
from ling2.train import loop, runtime
from ling2.train.state import abstract_state, fields, init_state, load_parameters
from ling2.train.data import make_iterator_factory
from ling2.train.testing import e2e
from ling2.train.train import find_file


def test_new_run_starts_from_given_weights(tmp_path):
    cfg = load_config(*e2e.MICRO, "steps=2", "checkpoint_period=1", "async_checkpointing=false",
                      config_file=find_file("configs/train/tiny_sample.yml"))
    make = make_iterator_factory(find_file)
    devices = jax.devices()[:1]
    loop.run(cfg, tmp_path / "a", make, tensorboard=False, log=lambda s: None, devices=devices)

    b = cfg.model_copy(update={"load_parameters_path": str(tmp_path / "a" / "checkpoints" / "2")})
    mesh = runtime.make_mesh(b, devices)
    setup = abstract_state(b, mesh)
    fresh = init_state(b, mesh, setup)
    fresh_leaves = [np.array(x) for x in jax.tree.leaves(fresh.params)]
    started = load_parameters(b, setup, fresh)

    ck = Checkpointer(tmp_path / "a" / "checkpoints", cfg)
    saved, _ = ck.restore(2, fields(fresh), None)
    ck.close()
    want = jax.tree.leaves(saved["params"])
    got = jax.tree.leaves(started.params)
    assert len(want) == len(got) > 10
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert any(not np.array_equal(f, np.asarray(g)) for f, g in zip(fresh_leaves, got))
    assert int(started.step) == 0  # a new run: counters and optimizer start fresh
