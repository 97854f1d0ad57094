"""The Pallas GPU kernels' loops keep their loads in flight, read off the PTX XLA:GPU compiles for an H100 (cuda
venv, no GPU: `--xla_dump_to` writes each kernel's PTX). A Triton loop whose loads are software-pipelined copies
them with `cp.async` and, at the top of each step, waits only for the oldest (`cp.async.wait_group N`, N > 0);
`wait_group 0` inside the loop, or no `cp.async`, means every step waits for its own loads:
  - the GLA and KDA sweeps (sequential over chunks, so a stall per chunk is the kernel's time): 3 stages;
  - the MoE dx kernel (two products, dgate wg^T + dup wu^T): one loop over both, so the pipeline drains once.
"""

import re
import textwrap

import pytest

from ling2.kernels.testing.cuda import kernel_ptx, xla_dump

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from ling2.kernels import gla, kda
    from ling2.kernels.moe import pallas_gpu as moe
    from ling2.kernels.testing.cuda import h100_arg as s

    B, T, H, D = 1, 1024, 2, 128
    bf, f32 = jnp.bfloat16, jnp.float32
    x, g_gla, g_kda, beta = s((B, T, H, D), bf), s((H,), f32), s((B, T, H, D), f32), s((B, T, H), f32)

    def run(f, argnums, *args):  # forward and gradient in one program, so neither is dropped
        loss = lambda *a: jnp.sum(f(*a).astype(f32))
        jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums)(*a))).lower(*args).compile()

    run(lambda q, k, v, g: gla.simple_gla(q, k, v, g, backend="pallas_gpu"), (0, 1, 2), x, x, x, g_gla)
    run(lambda q, k, v, g, b: kda.kda(q, k, v, g, b, backend="pallas_gpu"), (0, 1, 2), x, x, x, g_kda, beta)
    M, E, F = 1024, 4, 512
    run(lambda x, wg, wu, wd: moe.grouped_swiglu(x, jnp.full((E,), M // E, jnp.int32), wg, wu, wd), (0,),
        s((M, D), bf), s((E, D, F), bf), s((E, D, F), bf), s((E, F, D), bf))
""")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """{kernel entry name: its PTX} of every Triton kernel the script compiles."""
    return kernel_ptx(xla_dump(SCRIPT, tmp_path_factory.mktemp("xla_dump")))


def _loop(text):
    """The body of the kernel's main loop: the longest span from a label back to a branch that jumps to it."""
    labels = {m.group(1): m.start() for m in re.finditer(r"^(\$L__BB\d+_\d+):", text, re.M)}
    spans = [(labels[m.group(1)], m.end()) for m in re.finditer(r"bra\s+(\$L__BB\d+_\d+);", text)
             if labels.get(m.group(1), len(text)) < m.start()]
    start, end = max(spans, key=lambda s: s[1] - s[0])
    return text[start:end]


def _waits(text):
    return [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", text)]


@pytest.mark.parametrize("kernel", ["ling2_gla_states", "ling2_gla_dstates", "_fwd_kernel", "_states_kernel",
                                    "_reverse_kernel"])
def test_sweeps_keep_the_next_chunks_loads_in_flight(ptx, kernel):
    body = _loop(ptx[kernel])
    assert "cp.async.cg.shared.global" in body or "cp.async.ca.shared.global" in body
    waits = _waits(body)
    assert waits and min(waits) > 0, f"{kernel}: waits {waits} in its loop"


def test_moe_dx_sums_both_products_in_one_pipelined_loop(ptx):
    """The backward's transposed gmms: dh = dy wd^T (one product per step) and dx (both products per step, twice
    the matmuls in the same loop), each pipelined, each draining once."""
    kernels = {n: t for n, t in ptx.items() if n.startswith("ling2_gmm_t")}
    mmas = sorted((len(re.findall(r"wgmma\.mma_async", _loop(t))), n) for n, t in kernels.items())
    assert [m for m, _ in mmas] == [mmas[0][0], 2 * mmas[0][0]] and mmas[0][0] > 0, mmas
    for _, name in mmas:
        waits = _waits(kernels[name])
        assert waits.count(0) == 1 and min(_waits(_loop(kernels[name]))) > 0, (name, waits)
