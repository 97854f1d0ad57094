"""The float8 grouped SwiGLU (`pallas_gpu.grouped_swiglu_fp8`, `quantization: fp8` with per-tensor scaling) through
the real XLA:GPU compiler for an H100, no GPU attached (cuda venv; `--xla_dump_to` writes the optimized HLO and
each Triton kernel's PTX): forward and backward are the six grouped kernels of the bf16 path, each handed float8
operands (one byte per element read), and each kernel's products run on Hopper's wgmma, not Ampere's mma.sync
(which Triton picks for a float8 dot that Pallas lowers: `ling2.kernels.triton_blocks.dot`)."""

import re
import textwrap

import pytest

from ling2.kernels.testing.cuda import kernel_ptx, xla_dump

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from ling2.kernels.moe import pallas_gpu as moe
    from ling2.kernels.testing.cuda import h100_arg as s

    M, E, D, F = 1024, 4, 256, 512
    bf, f32 = jnp.bfloat16, jnp.float32
    f = lambda x, wg, wu, wd: moe.grouped_swiglu_fp8(x, jnp.full((E,), M // E, jnp.int32), wg, wu, wd)
    loss = lambda *a: jnp.sum(f(*a).astype(f32))
    jax.jit(lambda *a: (f(*a), jax.grad(loss, (0, 1, 2, 3))(*a))).lower(
        s((M, D), bf), s((E, D, F), f32), s((E, D, F), f32), s((E, F, D), f32)).compile()
""")
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    return xla_dump(SCRIPT, tmp_path_factory.mktemp("xla_dump"))


def test_six_kernels_take_float8_operands(dump):
    (hlo,) = [p.read_text() for p in dump.glob("*after_optimizations.txt")]
    calls = [line for line in hlo.splitlines() if TRITON in line and "custom-call(" in line]
    assert len(calls) == 6  # gate/up, down; dh, dx, the gate/up and the down weight gradients
    for call in calls:
        operands = re.search(r"operand_layout_constraints=\{(.*?\})\}", call).group(1)
        big = [t for t, dims in re.findall(r"(\w+)\[([\d,]+)\]", operands) if len(dims.split(",")) >= 2]
        assert big and set(big) <= {"f8e4m3fn", "f8e5m2"}, call[:300]


def test_every_product_runs_on_wgmma(dump):
    kernels = {n: t for n, t in kernel_ptx(dump).items() if n.startswith("ling2_")}
    assert len(kernels) == 6, sorted(kernels)
    for name, text in kernels.items():
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16", text), name
        assert "mma.sync" not in text, name
