"""Small random Ling2 models and an independent greedy oracle, for the generation tests."""

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from ling2.config import load_config
from ling2.infer.load import INFER_OVERRIDES
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec

# init_std 0.1: peaked next-token distributions, so greedy argmaxes are far from ties.
MICRO = {"model_name": "ling2-micro", "init_std": 0.1}
# A small Ling 3 (KDA, KDA, gated MLA) with one MTP layer.
LING3_MICRO = {"model_name": "ling3-tiny", "vocab_size": 256, "base_num_decoder_layers": 3,
               "inhomogeneous_layer_cycle_interval": 3, "mtp_num_layers": 1}


def micro(**overrides):
    """(cfg, model) of ling2-micro (one GLA + dense layer, one MLA + MoE layer, MTP) as inference builds it
    (INFER_OVERRIDES), then `overrides`."""
    cfg = load_config(MICRO, INFER_OVERRIDES, overrides)
    return cfg, Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))


def prompts(vocab: int, lengths, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]


def greedy_by_full_forward(model, prompt_list, n: int) -> list[list[int]]:
    """Greedy continuation by argmax over a full no-cache forward of the growing sequence each step.

    The rows are right-padded into one fixed buffer: causal attention and the GLA recurrence
    make a position's logits independent of what follows it, so one compile serves every step."""
    T = max(len(p) for p in prompt_list) + n
    fwd = nnx.jit(lambda m, ids: m(ids).logits)
    seqs = [list(map(int, p)) for p in prompt_list]
    for _ in range(n):
        buf = np.zeros((len(seqs), T), np.int32)
        for b, s in enumerate(seqs):
            buf[b, :len(s)] = s
        logits = np.asarray(fwd(model, jnp.asarray(buf)))
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(logits[b, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompt_list)]


def oracle_drafts(plain_ids, n, wrong):
    """A `generation._draft` replacement proposing the plain greedy tokens (`n` per row), wrong where
    wrong(row, count, depth)."""
    table = np.zeros((len(plain_ids), n + 8), np.int32)
    for b, r in enumerate(plain_ids):
        table[b, :len(r)] = r

    def draft(model, c, W, s, key, opts):
        K = len(c.mtp)
        B = c.last.shape[0]
        j = jnp.arange(1, K + 1)
        idx = c.count[:, None] - 1 + j[None]  # generated index of x_{m+j}
        d = jnp.take_along_axis(jnp.asarray(table), jnp.minimum(idx, table.shape[1] - 1), axis=1)
        bad = wrong(jnp.arange(B)[:, None], c.count[:, None], j[None])
        d = jnp.where(bad, (d + 1) % model.decoder.embed.embedding.shape[0], d)
        return d.astype(jnp.int32), jax.nn.one_hot(d, model.decoder.embed.embedding.shape[0]), c.mtp

    return draft
