"""The expert-parallel MoE exchange through the real XLA:TPU + Mosaic compiler for 4 v5p chips (tpu venv; any
host): `moe_ep_all_to_all` auto/ragged compiles to ragged all-to-alls feeding megablox's kernels, forward and
backward; the ragged exchange moves 1/n of the padded one's bytes (read from the compiled HLO by
`ling2.train.hlo_traffic`); a receive bound shrinks the temporaries. CPU equality of the ragged path's values
and gradients: ling2/layers/moe/ep_test.py and ling2/train/context_parallel_test.py (emulated exchange)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology

D, F = 512, 256


def compiled_ep(a2a: str, capacity: float = 0.0):
    """The gradient of the expert-parallel MoE body over 4 v5p chips (expert axis 4), compiled for TPU."""
    from ling2.config import load_config
    from ling2.config.specs import MoESpec
    from ling2.layers.moe import ep as moe_ep
    from ling2.layers.moe import plan as moe_plan

    cfg = load_config(model_name="ling2-tiny", base_emb_dim=512, base_moe_mlp_dim=256, num_experts=16,
                      moe_ep_all_to_all=a2a)
    devs = np.asarray(topology.devices("v5p-8")).reshape(1, 1, 4, 1, 1)
    mesh = Mesh(devs, ("data", "fsdp", "expert", "context", "tensor"))
    B, S, K, E = 8, 512, cfg.num_experts_per_tok, cfg.num_experts
    rows = NamedSharding(mesh, P("expert"))
    s = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    args = (s((B, S, D), jnp.bfloat16, rows), s((B, S, K), jnp.int32, rows), s((B, S, K), jnp.float32, rows),
            s((E, D, F), jnp.bfloat16, rows), s((E, D, F), jnp.bfloat16, rows), s((E, F, D), jnp.bfloat16, rows))

    def loss(x, e, g, wg, wu, wd):
        plans = moe_plan.plans(MoESpec.of(cfg), dict(mesh.shape),
                               tokens=B * S, model_dim=D)
        y = moe_ep.dropless_ep(x, e, g, (wg, wu, wd), mesh=mesh, rules=cfg.logical_axis_rules, plans=plans,
                               capacity_factor=capacity)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5))).lower(*args).compile()


def test_ragged_expert_parallel_step_compiles_to_ragged_all_to_all_and_megablox():
    """auto on TPU is the ragged exchange: two ragged all-to-alls forward (rows out, results back) and two in
    the backward (their transposes), no padded all-to-all of rows; the experts run megablox's kernels."""
    for a2a in ("auto", "ragged"):
        text = compiled_ep(a2a).as_text()
        assert text.count(" ragged-all-to-all(") == 4, a2a
        assert text.count('custom_call_target="tpu_custom_call"') == 6, a2a
        assert " all-to-all(" not in text, a2a
    padded = compiled_ep("padded").as_text()
    assert " ragged-all-to-all(" not in padded and " all-to-all(" in padded


def test_ragged_receive_bound_shrinks_the_buffers():
    """A receive bound of 1.25x the balanced share: the program holds only bounded receive buffers (a routing
    that overflows them runs more rounds of the same exchange, a loop; no padded all-to-all is compiled in),
    so its temporaries and XLA's peak fall well below the padded exchange's (whose buffers hold 4x every
    device's rows) and below the unbounded ragged exchange's."""
    padded, unbounded, bounded = compiled_ep("padded"), compiled_ep("ragged"), compiled_ep("ragged", 1.25)
    text = bounded.as_text()
    assert " ragged-all-to-all(" in text and " all-to-all(" not in text
    assert 'custom_call_target="tpu_custom_call"' in text
    mem = {k: c.memory_analysis() for k, c in (("padded", padded), ("unbounded", unbounded), ("bounded", bounded))}
    for field in ("temp_size_in_bytes", "peak_memory_in_bytes"):
        got = {k: getattr(m, field) for k, m in mem.items()}
        assert got["bounded"] < 0.75 * got["padded"], (field, got)
        assert got["bounded"] < got["unbounded"], (field, got)


def test_ragged_exchange_moves_a_fraction_of_the_padded_bytes():
    """Bytes the all-to-alls move per chip (ling2.train.hlo_traffic on the compiled program): the padded
    exchange sends its whole [n, M, D] buffers; the ragged one each routed row once (M rows out, M back on
    average): 1/n of the padded bytes at n = 4, and no more than half at any n >= 2."""
    from ling2.train import hlo_traffic

    mesh = {"data": 1, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1}
    a2a = lambda c: sum(v["wire_bytes"] for (kind, _), v in hlo_traffic.traffic(c.as_text(), mesh)["collectives"].items()
                        if kind in ("all-to-all", "ragged-all-to-all"))
    padded, ragged = a2a(compiled_ep("padded")), a2a(compiled_ep("ragged"))
    assert ragged <= 0.5 * padded
    assert ragged == pytest.approx(padded / 4, rel=0.01)
