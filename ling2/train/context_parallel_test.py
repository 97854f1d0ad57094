"""Context parallelism end to end on 8 fake CPU devices: one training step with the sequence split over
the `context` axis equals the same step on one device.

Reference: the unsharded step of the same model, seed and global batch on one device (its kernels are
checked against fla's naive formulas and the HF modeling code elsewhere). Compared: the loss, every
gradient of a micro-batch, and the parameters after one optimizer step of two micro-batches (gradient
accumulation), each within 1e-5 relative (norm of the difference over the norm) in float32. The step runs
with adam_eps = 1 and learning_rate = 1: Adam's first step is then lr * g / (|g| + 1), smooth in the
accumulated gradient, so the updated parameters check its values. With the usual eps = 1e-8 it is about
lr * sign(g), which checks only signs and turns a float32 reordering of a near-zero gradient entry into a
parameter difference of up to lr.

One exception is measured, not assumed: a gradient whose float32 value is a sum with heavy cancellation
(KDA's A_log) differs by more than 1e-5 between the one-device step and the same step with only the batch
split over fsdp 2 (no context), i.e. by the reordering of a float32 sum. For such a tensor the context run
must stay within twice that measured reordering error instead.

Batches hold packed documents whose boundaries fall inside shards, exactly on shard edges, and documents
spanning three or more shards (positions restart at each document, as the data pipeline writes them).
"""

import functools

import jax
import numpy as np
import pytest

from ling2.config import load_config
from ling2.train import runtime
from ling2.train.testing.steps import packed_batch, rel, run_step

T = 128
COMMON = dict(max_target_length=T, gla_chunk_size=8, kda_chunk_size=16, attention_block_size=16,
              warmup_steps_fraction=0.0, lr_schedule="constant", learning_rate=1.0, adam_eps=1.0,
              gradient_accumulation_steps=2, calculate_per_token_loss=True, load_balance_loss_weight=0.01)
MODELS = {
    "ling2-micro": dict(model_name="ling2-micro"),
    # Ling 3 micro: KDA, MLA with the output gate, group routing, one MTP depth
    "ling3-micro": dict(model_name="ling3-tiny", base_num_decoder_layers=4, base_emb_dim=64),
}


@functools.cache
def reference(model):
    cfg = load_config(MODELS[model], COMMON, ici_fsdp_parallelism=1)
    batch = packed_batch(cfg, 2, 4)
    one = run_step(cfg, jax.devices()[:1], batch)
    split = run_step(load_config(MODELS[model], COMMON, ici_fsdp_parallelism=2), jax.devices()[:2], batch)
    # float32 reordering error of each gradient and each updated parameter
    floor = {p: rel(one[1][p], g) for p, g in split[1].items()}, {p: rel(one[2][p], x) for p, x in split[2].items()}
    return batch, one, floor


@pytest.mark.parametrize("mesh", [dict(context=2), dict(context=4), dict(context=8),
                                  dict(context=2, fsdp=2, expert=2)], ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.parametrize("model", list(MODELS))  # model-major: each of Bazel's 3 shards builds one reference
def test_context_parallel_step_equals_one_device(model, mesh):
    assert len(jax.devices()) == 8
    batch, (loss1, grads1, params1), floor = reference(model)
    sizes = {f"ici_{a}_parallelism": mesh.get(a, 1) for a in ("data", "fsdp", "expert", "context", "tensor")}
    cfg = load_config(MODELS[model], COMMON, sizes)
    n = int(np.prod(list(mesh.values())))
    loss, grads, params = run_step(cfg, jax.devices()[:n], batch)
    assert abs(loss - loss1) <= 1e-5 * abs(loss1)
    assert grads.keys() == grads1.keys() and params.keys() == params1.keys()
    for name, new, ref, fl in (("gradients", grads, grads1, floor[0]), ("updated parameters", params, params1, floor[1])):
        bad = {p: (r, fl[p]) for p in ref if (r := rel(ref[p], new[p])) > max(1e-5, 2 * fl[p])}
        assert not bad, f"{name} off by more than 1e-5 relative (or twice the float32 reordering error): {bad}"


@functools.cache
def reference_ep():
    """One-device step of ling2-micro on 8 rows (expert parallelism 8 needs a row per device)."""
    cfg = load_config(MODELS["ling2-micro"], COMMON, ici_fsdp_parallelism=1)
    batch = packed_batch(cfg, 2, 8)
    one = run_step(cfg, jax.devices()[:1], batch)
    split = run_step(load_config(MODELS["ling2-micro"], COMMON, ici_fsdp_parallelism=2), jax.devices()[:2], batch)
    floor = {p: rel(one[1][p], g) for p, g in split[1].items()}, {p: rel(one[2][p], x) for p, x in split[2].items()}
    return batch, one, floor


@pytest.mark.parametrize("expert", [2, 4, 8])
def test_ragged_expert_parallel_step_equals_one_device(expert):
    """A whole train step with the ragged expert-parallel exchange (moe_ep_all_to_all), expert axis 2, 4, 8:
    the same loss, gradients and updated parameters as one device, with the default receive bound (2x the
    balanced share: the bounded exchange's custom VJP). XLA:CPU cannot run ragged all-to-all, so the exchange
    runs `emulated` (the ragged plans carried out by padded collectives); the real op is compiled, forward
    and backward, by the TPU compiler in tests/moe_ep_tpu_compile_test.py."""
    batch, (loss1, grads1, params1), floor = reference_ep()
    cfg = load_config(MODELS["ling2-micro"], COMMON, ici_fsdp_parallelism=1, ici_data_parallelism=1,
                      ici_expert_parallelism=expert, moe_ep_all_to_all="emulated")
    loss, grads, params = run_step(cfg, jax.devices()[:expert], batch)
    assert abs(loss - loss1) <= 1e-5 * abs(loss1)
    for name, new, ref, fl in (("gradients", grads, grads1, floor[0]), ("updated parameters", params, params1, floor[1])):
        bad = {p: (r, fl[p]) for p in ref if (r := rel(ref[p], new[p])) > max(1e-5, 2 * fl[p])}
        assert not bad, f"{name} off by more than 1e-5 relative (or twice the float32 reordering error): {bad}"


def test_context_shards_split_the_sequence():
    """The batch really is split along the sequence: each device holds T / context positions of every row."""
    cfg = load_config(MODELS["ling2-micro"], COMMON, ici_fsdp_parallelism=1, ici_context_parallelism=8)
    mesh = runtime.make_mesh(cfg, jax.devices())
    x = jax.device_put(np.zeros((2, 4, T), np.int32), runtime.batch_sharding(cfg, mesh, 4, T))
    assert {s.data.shape for s in x.addressable_shards} == {(2, 4, T // 8)}
