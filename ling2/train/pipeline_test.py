"""Pipeline parallelism on 8 fake CPU devices: a training step with the scanned layer groups split over the
`stage` axis (GPipe schedule, `ling2.layers.pipeline`) equals the same step on one device.

Reference: the unpipelined step of the same model, seed and global batch on one device. Compared as in
`context_parallel_test`: the loss, every gradient of a micro-batch, and the parameters and loss-free expert
biases after one optimizer step of two micro-batches, each within 2e-5 relative in float32, or within twice
the float32 reordering error the same sums show without a pipeline (the unpipelined step sharded over the same
devices, stage folded into fsdp), measured per tensor: on 8 devices the unpipelined step itself differs from
one device by 1e-5 to 1e-4 in some gradients. The 2e-5 is that scale: one-row pipeline micro-batches sum a
gradient row by row, an order no unpipelined step shares, and measured 9.1e-6 for a layer's MLA weights while
their unpipelined floor was 8e-7. One of 8 rows dropped or counted twice moves a gradient by about 1/8.
As there, adam_eps = 1 and learning_rate = 1 make Adam's first step
lr * g / (|g| + 1), smooth in the accumulated gradient, so the updated parameters check its values, not only
its signs.

The model is ling2-micro with 10 layers: one unscanned group (its dense layer) and 4 scanned groups of a
GLA and an MLA MoE layer, plus MTP; batches hold packed documents. The MoE load-balancing loss is off here
(Ling's routers balance by the loss-free bias): with it on, a pipelined layer's loss is the mean of the losses
of its pipeline micro-batches' rows on each device, as Megatron-LM computes it per rank, not the loss of their
union.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.config import ConfigError, load_config
from ling2.train import hlo_traffic, runtime
from ling2.train.loop import compile_train_step
from ling2.train.state import abstract_state
from ling2.train.testing.steps import packed_batch, rel, run_step

MODEL = dict(model_name="ling2-micro", base_num_decoder_layers=10, max_target_length=128, gla_chunk_size=8,
             attention_block_size=16, warmup_steps_fraction=0.0, lr_schedule="constant",
             gradient_accumulation_steps=2, calculate_per_token_loss=True, scan_layers=True,
             adam_eps=1.0, learning_rate=1.0)
M, B = 2, 8  # micro-batches per step, rows per micro-batch


@functools.cache
def batch():
    return packed_batch(load_config(MODEL), M, B)


@functools.cache
def one_device():
    return run_step(load_config(MODEL, ici_fsdp_parallelism=1), jax.devices()[:1], batch())


@functools.cache
def unpipelined(n: int, expert: int):
    """The step on n devices, fsdp n / expert and expert `expert`, no pipeline."""
    return run_step(load_config(MODEL, ici_fsdp_parallelism=n // expert, ici_expert_parallelism=expert,
                                per_device_batch_size=B / n), jax.devices()[:n], batch())


def check_pipelined_step(mesh: dict, P: int):
    """The step on `mesh` with P pipeline micro-batches equals the one-device step (module doc)."""
    assert len(jax.devices()) == 8
    loss1, grads1, params1 = one_device()
    n = int(np.prod(list(mesh.values())))
    cfg = load_config(MODEL, {f"ici_{a}_parallelism": mesh.get(a, 1) for a in runtime.MESH_AXES},
                      pipeline_microbatches=P, per_device_batch_size=B / n)
    loss, grads, params = run_step(cfg, jax.devices()[:n], batch())
    assert abs(loss - loss1) <= 1e-5 * abs(loss1)
    assert grads.keys() == grads1.keys() and params.keys() == params1.keys()
    flat = unpipelined(n, mesh.get("expert", 1))
    for name, new, ref, other in (("gradients", grads, grads1, flat[1]),
                                  ("updated parameters", params, params1, flat[2])):
        floor = {p: rel(ref[p], other[p]) for p in ref}
        bad = {p: (r, floor[p]) for p in ref if (r := rel(ref[p], new[p])) > max(2e-5, 2 * floor[p])}
        assert not bad, f"{name} off by more than 2e-5 relative (or twice the float32 reordering error): {bad}"


# Each costly case is its own test, so that Bazel's 10 shards (one test each) run them apart.
def test_four_stages_equal_one_device():
    """4 stages of one group each, 4 pipeline micro-batches of 2 rows."""
    check_pipelined_step(dict(stage=4), 4)


def test_each_stage_holds_its_own_groups():
    """The stacked groups' weights really are split over the stages: on a 4-stage mesh each holds one of the 4
    scanned groups, and the unscanned layers' weights are on every stage."""
    cfg = load_config(MODEL, ici_stage_parallelism=4, ici_fsdp_parallelism=1, pipeline_microbatches=4,
                      per_device_batch_size=2)
    mesh = runtime.make_mesh(cfg, jax.devices()[:4])
    flat = jax.tree_util.tree_flatten_with_path(abstract_state(cfg, mesh).state.params)[0]
    specs = {jax.tree_util.keystr(p): tuple(x.sharding.spec) for p, x in flat}
    groups = {p: s for p, s in specs.items() if "'groups'" in p}
    assert groups and all(s[0] == "stage" for s in groups.values()), groups
    assert all("stage" not in jax.tree.leaves(s) for p, s in specs.items() if "'prefix'" in p)


@pytest.mark.parametrize("overrides,field", [
    (dict(ici_stage_parallelism=3, ici_fsdp_parallelism=1), "ici_stage_parallelism"),  # 4 groups
    (dict(ici_stage_parallelism=2, ici_fsdp_parallelism=1, pipeline_microbatches=3), "pipeline_microbatches"),
    (dict(ici_stage_parallelism=2, ici_fsdp_parallelism=1, scan_layers=False), "scan_layers"),
    (dict(ici_stage_parallelism=2, ici_fsdp_parallelism=1, ici_expert_parallelism=2, sparse_matmul=False),
     "sparse_matmul"),
])
def test_bad_pipeline_settings_name_the_field(overrides, field):
    cfg = load_config(MODEL, overrides)
    n = overrides["ici_stage_parallelism"] * overrides.get("ici_expert_parallelism", 1)
    with pytest.raises(ConfigError, match=field):
        runtime.make_mesh(cfg, jax.devices()[:n])


def test_one_row_micro_batches_equal_one_device():
    """2 stages, 8 pipeline micro-batches of one row each: 9 steps of the schedule, one of them a bubble per stage."""
    check_pipelined_step(dict(stage=2), 8)


def test_stages_with_fsdp_and_expert_parallelism_equal_one_device():
    """2 stages x fsdp 2 x expert 2: each stage's micro-batch rows split over fsdp and expert, its experts over
    expert (the MoE exchange inside the stage), its weights gathered over fsdp on entry."""
    check_pipelined_step(dict(stage=2, fsdp=2, expert=2), 2)


def test_schedule_loop_reduces_no_gradient():
    """The schedule's loops (forward and backward: the while loops that pass activations between stages) hold no
    all-reduce or reduce-scatter: each device sums its stage's weight gradients over the micro-batches, and they
    are reduced across devices once, after the schedule. A reduction in the loop would cross the network once
    per micro-batch, and XLA:GPU hoists one out only by building a zero constant the size of the stage's
    gradients on the compiling host (the 1T plan's compile outgrew a 24 GB host that way). Read from the
    compiled train step of 2 stages x fsdp 2 x expert 2."""
    cfg = load_config(MODEL, ici_stage_parallelism=2, ici_fsdp_parallelism=2, ici_expert_parallelism=2,
                      pipeline_microbatches=2, per_device_batch_size=B / 8)
    mesh = runtime.make_mesh(cfg, jax.devices())
    comps, _ = hlo_traffic.parse_computations(compile_train_step(cfg, mesh, abstract_state(cfg, mesh)).as_text())

    def reachable(name):  # the computations `name` runs, itself included
        seen, todo = set(), [name]
        while todo:
            c = todo.pop()
            if c not in seen:
                seen.add(c)
                todo += [n for i in comps[c] for n in re.findall(r"[\w.\-]+", i.rest) if n in comps]
        return seen

    bodies = [re.search(r"\bbody=%?([\w.\-]+)", i.rest).group(1) for c in comps.values() for i in c if i.op == "while"]
    passing = {b for b in bodies if any(i.op.startswith("collective-permute") for i in comps[b])}
    schedule = [b for b in passing if not passing & (reachable(b) - {b})]  # not the accumulation loop around them
    assert len(schedule) == 2, f"expected a forward and a backward schedule loop, found {len(schedule)}"
    reduced = [f"{i.op} {i.shape}" for b in schedule for c in reachable(b) for i in comps[c]
               if i.op.startswith(("all-reduce", "reduce-scatter")) and max(map(len, hlo_traffic.groups(i.rest, 8))) > 1]
    assert not reduced, f"collectives that reduce inside the pipeline schedule: {reduced}"


def test_bfloat16_stage_weights_round_the_weights_and_gradient_sums():
    """pipeline_weights_dtype=bfloat16 (2 stages x fsdp 2 x expert 2) equals the one-device step whose scanned
    groups' weights were rounded to bfloat16 beforehand, which is what the stages compute with: the loss within
    1e-5, the first micro-batch's gradients within 1% (the stages sum them over their micro-batches in
    bfloat16, 2^-8 per rounding), and some stage gradients not exactly (the sums really are bfloat16).
    Reference: that one-device step; ling2-micro's float32 step is none, as rounding all its weights to
    bfloat16 moves some of its gradients by 85%."""
    def rounded(params):
        def one(path, x):
            if "'groups'" in jax.tree_util.keystr(path) and jnp.issubdtype(x.dtype, jnp.floating):
                return x.astype(jnp.bfloat16).astype(x.dtype)
            return x
        return jax.tree_util.tree_map_with_path(one, params)

    loss1, grads1, _ = run_step(load_config(MODEL, ici_fsdp_parallelism=1), jax.devices()[:1], batch(), rounded)
    cfg = load_config(MODEL, ici_stage_parallelism=2, ici_fsdp_parallelism=2, ici_expert_parallelism=2,
                      pipeline_microbatches=2, per_device_batch_size=B / 8, pipeline_weights_dtype="bfloat16")
    loss, grads, _ = run_step(cfg, jax.devices(), batch())
    assert abs(loss - loss1) <= 1e-5 * abs(loss1)
    off = {p: r for p in grads1 if (r := rel(grads1[p], grads[p])) > 1e-2}
    assert not off, f"gradients off by more than 1% relative: {off}"
    assert max(rel(grads1[p], grads[p]) for p in grads1 if "groups" in p) > 1e-4
