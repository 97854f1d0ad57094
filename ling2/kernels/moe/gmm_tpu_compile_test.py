"""The dropless MoE's grouped matmul through the real XLA:TPU + Mosaic compiler (tpu venv; any
host). megablox, what moe_gmm_backend=auto runs on TPU (`ling2.layers.moe.plan`), compiled for a v5p is
Pallas kernels (our Mosaic calls, no ragged dot), whose cost XLA counts as the grouped matmul's; XLA counts its own ragged_dot
kernels dense over the local experts (growing with their number at a fixed row count), which is
why the plan's FLOPs use megablox. Reference: the grouped count 3 x 2·M·D·3F (fwd + bwd)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology
from ling2.kernels.moe import gmm as moe_gmm

M, D, F = 8192, 512, 256


def compiled(gmm: str, E: int):
    mesh = Mesh(np.array(topology.devices("v5p-8")[:1]), ("d",))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    args = (s((M, D), jnp.bfloat16), s((E,), jnp.int32), s((E, D, F), jnp.bfloat16), s((E, D, F), jnp.bfloat16),
            s((E, F, D), jnp.bfloat16))

    def loss(x, gs, wg, wu, wd):
        return jnp.sum(moe_gmm.grouped_ffn(x, gs, (wg, wu, wd), gmm).astype(jnp.float32) ** 2)

    c = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(*args).compile()
    cost = c.cost_analysis()
    return c.as_text(), (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_megablox_on_tpu_costs_the_grouped_flops():
    text, flops_auto = compiled("megablox", 32)
    # forward: gate-up and down; backward: a gmm and a tgmm for each
    assert text.count('custom_call_target="tpu_custom_call"') == 6
    assert " ragged-dot(" not in text
    grouped = 3 * 2 * M * D * 3 * F  # fwd + bwd of the grouped SwiGLU's three matmuls
    _, flops_ragged_8 = compiled("ragged_dot", 8)
    _, flops_ragged_32 = compiled("ragged_dot", 32)
    assert flops_auto == pytest.approx(grouped, rel=0.02)
    assert flops_ragged_32 > 3 * flops_ragged_8 and flops_ragged_32 > 5 * grouped

