"""The evaluator against the trainer's evaluator and against per-sample losses computed here.

- on the trainer's data and config, the loss equals `ling2.train.eval.Evaluator`'s eval loss;
- on a blend, each component's loss equals the token-weighted mean of numpy cross-entropies of
  the samples the blend drew from it (samples read straight from the dataset, not the iterator).
"""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.data import pipeline
from ling2.data.gpt_index import SPLITS
from ling2.infer.evaluation import evaluate
from ling2.infer.load import InferError, find_file
from ling2.infer.testing.models import MICRO
from ling2.layers.model import Ling2Model
from ling2.train.data import make_iterator_factory
from ling2.train.eval import Evaluator
from ling2.train.runtime import make_mesh
from ling2.train.state import trainable_filter
from ling2.layers.spec import ModelSpec

DATA = "data/sample/sample_text_document"


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(MICRO, dataset_type="mmap", data_path=DATA, data_split="90,10,0", max_target_length=32,
                      per_device_batch_size=2, gradient_accumulation_steps=2, steps=20, eval_interval=10, eval_steps=3)
    return cfg, Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(1))


def test_loss_equals_the_trainers_eval_loss(setup):
    cfg, model = setup
    gd, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    trainer = Evaluator(cfg, make_mesh(cfg, jax.devices()[:1]), gd, make_iterator_factory(find_file))
    want = trainer.evaluate(SimpleNamespace(params=params, rest=rest))
    res = evaluate(model, cfg, DATA, find_file, "valid")
    assert res["batches"] == 3 and res["batch_size"] == 4
    assert res["loss"] == pytest.approx(want, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    assert res["components"][0]["loss"] == pytest.approx(want, rel=1e-5)


def numpy_ce(logits, targets, weights):
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    ce = lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]
    return (ce * weights).sum(-1), weights.sum(-1)


def test_blend_components_equal_their_samples_losses(setup):
    cfg, model = setup
    blend = f"0.7 {DATA} 0.3 {DATA}"
    res = evaluate(model, cfg, blend, find_file, "valid", max_batches=2)
    n = 2 * cfg.global_batch_size(1)
    full = cfg.model_copy(update={"data_path": f"0.7 {find_file(DATA)} 0.3 {find_file(DATA)}", "eval_steps": 2})
    ds = pipeline.datasets_from_config(full, 1, ["valid"])[SPLITS.index("valid")]
    text = {"text": ds.samples(np.arange(n), np.int32)}
    for op in pipeline.transforms(cfg.eod_id, cfg.pad_id, cfg.bos_id, cfg.add_bos, cfg.reset_attention_mask,
                                  cfg.reset_position_ids, cfg.eod_mask_loss, cfg.add_extra_token_to_sequence):
        text = op.map(text)
    b = text
    logits = np.asarray(nnx.jit(lambda m, i, p, s: m(i, p, s, s != 0).logits)(
        model, jnp.asarray(b["inputs"]), jnp.asarray(b["positions"]), jnp.asarray(b["segment_ids"])))
    ce, tok = numpy_ce(logits, b["targets"], b["loss_weights"])
    which = np.asarray(ds.dataset_index[:n])
    assert set(which.tolist()) == {0, 1}
    for c in (0, 1):
        want = ce[which == c].sum() / tok[which == c].sum()
        assert res["components"][c]["loss"] == pytest.approx(want, rel=1e-5)
        assert res["components"][c]["tokens"] == tok[which == c].sum()
        assert res["components"][c]["weight"] == pytest.approx([0.7, 0.3][c])
    assert res["loss"] == pytest.approx(ce.sum() / tok.sum(), rel=1e-5)


def test_bad_data_is_named(setup):
    cfg, model = setup
    with pytest.raises(InferError, match="--data_path='/nonexistent/x'"):
        evaluate(model, cfg, "/nonexistent/x", find_file, "valid")
    with pytest.raises(InferError, match="--split='dev'"):
        evaluate(model, cfg, DATA, find_file, "dev")
    with pytest.raises(InferError, match="--max_batches=0"):
        evaluate(model, cfg, DATA, find_file, "valid", max_batches=0)
