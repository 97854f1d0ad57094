"""A trainer checkpoint (ling2.checkpoint.manager, TrainState fields) exports to HF with the config saved with
it (no --config) and converts back unchanged."""

import jax
import numpy as np
from flax import nnx

from ling2.config import load_config
from ling2.convert import convert
from ling2.checkpoint.manager import Checkpointer
from ling2.checkpoint.state import load_state
from ling2.layers.model import Ling2Model
from ling2.train.state import trainable_filter
from ling2.train.optim import make_optimizer
from ling2.layers.spec import ModelSpec


def test_trainer_step_dir_to_hf_and_back(tmp_path):
    cfg = load_config(model_name="ling2-tiny", base_num_decoder_layers=5, async_checkpointing=False)
    model = nnx.eval_shape(lambda: Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0)))
    _, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    rng = np.random.default_rng(0)
    params, rest = (jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), t) for t in (params, rest))
    assert len(jax.tree.leaves(rest)) == 5  # the expert biases (4 MoE layers + MTP) live outside params
    tx, _ = make_optimizer(cfg, params)
    zero = np.zeros((), np.int32)
    fields = dict(step=zero, params=params, rest=rest, opt_state=tx.init(params), skipped=zero, skipped_total=zero)
    ckpt = Checkpointer(tmp_path / "checkpoints", cfg)
    ckpt.save(3, fields, None, {"step": 3}, force=True)
    ckpt.close()

    convert.convert_ling2_to_hf(tmp_path / "checkpoints" / "3", tmp_path / "hf", progress=False)
    back_cfg = convert.convert_hf_to_ling2(tmp_path / "hf", tmp_path / "l2", progress=False)
    back = load_state(tmp_path / "l2", back_cfg)
    want = nnx.to_pure_dict(nnx.merge_state(params, rest))
    got_flat, want_flat = jax.tree_util.tree_leaves_with_path(back), jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
    for (p, g), (_, w) in zip(got_flat, want_flat):
        assert np.array_equal(g, w), jax.tree_util.keystr(p)
