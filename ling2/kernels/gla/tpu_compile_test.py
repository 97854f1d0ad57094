"""The Pallas TPU GLA kernels through the real XLA:TPU + Mosaic compiler (tpu venv; any host).

`simple_gla(..., backend="pallas_tpu", interpret=False)` is compiled for one chip of a v5p and
of a v6e (libtpu's compile-only devices): forward and forward+backward, K = V of 64 and 128,
fp32 and bf16, with and without segment ids. The executable must hold our Mosaic kernels:
custom calls to "tpu_custom_call" whose serialized Mosaic module (base64 MLIR bytecode in the
backend config) is named ling2_gla_fwd / ling2_gla_dq / ling2_gla_dkdv, and no while loop
(what interpret mode would leave). Reference for FLOPs: XLA's own count of the "chunked"
backend (the same matmuls as plain einsums) compiled for the same chip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2.kernels import gla
from ling2.kernels.testing import mosaic as testing_mosaic
from ling2 import topology

B, T, H = 2, 200, 2  # T not a multiple of the chunk (64): the padded tail is compiled too
CHIPS = {"v5p": "v5p-8", "v6e": "v6e-4"}


def _mesh(chip, n=1, axes=("d",), shape=None):
    devs = topology.devices(CHIPS[chip])[:n]
    return Mesh(np.array(devs).reshape(shape or (n,)), axes)


def _abstract(mesh, spec_x=P(), spec_g=P(), spec_seg=P(), *, D=128, dtype=jnp.bfloat16, b=B, h=H, t=T):
    s = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    x = s((b, t, h, D), dtype, spec_x)
    return x, x, x, s((b, t, h), jnp.float32, spec_g), s((b, t), jnp.int32, spec_seg)


def _fn(backend, segments, grad, interpret=False):
    def fwd(q, k, v, g, seg):
        return gla.simple_gla(q, k, v, g, segment_ids=seg if segments else None, backend=backend,
                              interpret=interpret)

    def loss(q, k, v, g, seg):
        o = fwd(q, k, v, g, seg).astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))  # the cotangent depends on o: the forward kernel stays

    return jax.grad(loss, argnums=(0, 1, 2, 3)) if grad else fwd


def mosaic_kernels(hlo_text):
    return testing_mosaic.mosaic_kernels(hlo_text, "ling2_gla_")


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("segments", [False, True], ids=["one_doc", "segments"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_pallas_tpu_kernels_compile(chip, D, dtype, segments, grad):
    compiled = jax.jit(_fn("pallas_tpu", segments, grad)).lower(*_abstract(_mesh(chip), D=D, dtype=dtype)).compile()
    text = compiled.as_text()
    want = ["ling2_gla_dkdv", "ling2_gla_dq", "ling2_gla_fwd"] if grad else ["ling2_gla_fwd"]
    assert mosaic_kernels(text) == want
    assert " while(" not in text
    assert compiled.memory_analysis().temp_size_in_bytes >= 0


@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_auto_backend_compiles_the_mosaic_kernels_from_a_cpu_host(chip):
    """"auto" is decided for the platform compiled for, not the host's (CPU) default backend."""
    compiled = jax.jit(_fn("auto", True, True, interpret=None)).lower(*_abstract(_mesh(chip))).compile()
    assert mosaic_kernels(compiled.as_text()) == ["ling2_gla_dkdv", "ling2_gla_dq", "ling2_gla_fwd"]


@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_under_shard_map_on_four_chips(chip):
    """As the layer runs it under a mesh: batch and heads split over 2 x 2 chips."""
    mesh = _mesh(chip, 4, ("b", "h"), (2, 2))
    spec_x, spec_g, spec_seg = P("b", None, "h", None), P("b", None, "h"), P("b", None)
    run = _fn("pallas_tpu", True, False)

    def loss(q, k, v, g, seg):
        o = jax.shard_map(run, mesh=mesh, in_specs=(spec_x,) * 3 + (spec_g, spec_seg), out_specs=spec_x,
                          check_vma=False)(q, k, v, g, seg).astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))

    args = _abstract(mesh, spec_x, spec_g, spec_seg, b=4, h=4)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
    assert mosaic_kernels(compiled.as_text()) == ["ling2_gla_dkdv", "ling2_gla_dq", "ling2_gla_fwd"]


@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_xla_counts_the_kernel_flops(chip):
    """The kernels declare their cost; XLA's count of the chunked einsums is the reference.
    Forward: the same matmuls. Forward+backward: the Pallas dq and dk/dv sweeps each recompute
    what XLA shares between the chunked forward and backward, so it is 1 to 1.35x."""
    args = _abstract(_mesh(chip), D=128, dtype=jnp.bfloat16)
    flops = {(b, g): jax.jit(_fn(b, True, g)).lower(*args).compile().cost_analysis()["flops"]
             for b in ("pallas_tpu", "chunked") for g in (False, True)}
    assert 0.95 < flops["pallas_tpu", False] / flops["chunked", False] < 1.05
    assert 1.0 < flops["pallas_tpu", True] / flops["chunked", True] < 1.35


def test_factor_operands_are_lane_dense():
    """Per-token factors as [.., T, 1] columns would be padded to 128 lanes in HBM. Forward at
    B1 T2048 H8 D128 bf16: temporaries stay below the size of q, k and v together (12 MiB;
    4.7 MiB measured), where column factors took 29 MiB."""
    mesh = _mesh("v5p")
    args = _abstract(mesh, D=128, dtype=jnp.bfloat16, b=1, h=8, t=2048)
    compiled = jax.jit(_fn("pallas_tpu", True, False)).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * 1 * 2048 * 8 * 128 * 2
