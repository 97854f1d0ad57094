"""The ragged expert exchange through the real XLA:GPU compiler for 4 H100s (cuda venv, no GPU attached):
`exchange` and its custom VJP (the exchange the other way) compile to ragged all-to-alls, which is why
moe_ep_all_to_all=auto takes the ragged exchange on GPUs (the TPU side: tests/moe_ep_tpu_compile_test.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology
from ling2.kernels.moe import a2a as moe_a2a


def test_exchange_and_its_vjp_compile_to_ragged_all_to_all_for_h100():
    mesh = Mesh(np.array(topology.devices("h100-8")[:4]), ("expert",))

    def body(count_n, x):
        dispatch, combine = moe_a2a.plans(moe_a2a.count_matrix(count_n[0], "expert"), jax.lax.axis_index("expert"))
        y, vjp = jax.vjp(lambda x: moe_a2a.exchange(x[0], 64, dispatch, combine, "expert", False), x)
        return y[None], vjp(y)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=(P("expert"), P("expert")))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P("expert")))
    text = jax.jit(f).lower(s((4, 4), jnp.int32), s((4, 16, 8), jnp.float32)).compile().as_text()
    # forward and the VJP's reverse exchange (XLA:GPU runs them async: -start / -done pairs)
    assert text.count(" ragged-all-to-all(") + text.count(" ragged-all-to-all-start(") == 2
    assert " all-to-all(" not in text
