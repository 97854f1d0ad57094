"""The routed experts' grouped SwiGLU of ling2-1gpu's train step, compiled by the real XLA:GPU compiler for an H100
with no GPU attached (cuda venv): `moe_gmm_backend=auto` reads each expert's weights once per product.

Shapes: one MoE layer of ling2-1gpu at its timed batch (4 rows x 4096 tokens, top-8: M = 131,072 sorted rows),
D 2048, F 512, 64 local experts, bf16. Bytes are ling2.train.hlo_traffic's reading of the compiled HLO (every
top-level op reads its operands once). The bound is issue 36's: the rows (M x D x 2 bytes) plus the experts'
weights (64 x 3 x D x F x 2 bytes), times 1.5. The forward reads the rows once for gate and up together, the
hidden rows h (F/D of the rows) and each weight once: 1.14x. `blocked`, the former CUDA default, gathers every
128-row block's weights and is the control.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from ling2.kernels.testing.cuda import TRITON, h100_arg
from ling2.config import load_config
from ling2.config.specs import MoESpec
from ling2.kernels.moe import gmm as moe_gmm
from ling2.layers.moe.plan import moe_plan
from ling2.train import hlo_traffic

M, D, F, E = 4 * 4096 * 8, 2048, 512, 64
ROWS, WEIGHTS = M * D * 2, E * 3 * D * F * 2


def _auto_on_cuda() -> str:
    """What moe_gmm_backend=auto runs for ling2-1gpu's layer lowered for CUDA on one device."""
    spec = MoESpec.of(load_config(model_name="ling2-1gpu"))
    return moe_plan(spec, {}, "cuda", tokens=M // 8, model_dim=D).gemm


def _compiled(backend, grad):
    args = (h100_arg((M, D), jnp.bfloat16), h100_arg((E,), jnp.int32),
            *(h100_arg(s, jnp.bfloat16) for s in ((E, D, F), (E, D, F), (E, F, D))))
    f = lambda x, gs, *w: moe_gmm.grouped_ffn(x, gs, w, backend)
    if grad:
        f = jax.grad(lambda x, gs, *w: jnp.sum(moe_gmm.grouped_ffn(x, gs, w, backend).astype(jnp.float32)),
                     argnums=(0, 2, 3, 4))
    return jax.jit(f).lower(*args).compile().as_text()


def _weight_gathers(text):
    """Gathers whose result holds [..., D, F]-, [..., D, 2F]- or [..., F, D]-shaped weight blocks."""
    shapes = (f"{D},{F}]", f"{D},{2 * F}]", f"{F},{D}]")
    return [line for line in text.splitlines() if " gather(" in line and any(s in line.split("=")[1].split(" gather(")[0]
                                                                             for s in shapes)]


def test_forward_reads_rows_and_weights_once():
    assert _auto_on_cuda() == "pallas_gpu"
    text = _compiled(_auto_on_cuda(), grad=False)
    assert text.count(TRITON) == 2 and not _weight_gathers(text)  # the fused gate/up kernel, the down gmm
    read = hlo_traffic.traffic(text, {"d": 1})["hbm_read_bytes"]
    assert read <= 1.5 * (ROWS + WEIGHTS), (read / (ROWS + WEIGHTS))


def test_backward_products_read_weights_in_place():
    """Forward and backward: the 5 kernels that run (the forward's down projection is dead code under grad of a
    sum): the fused gate/up, dh and dx (transposed gmms; dx sums both products in one kernel) and the weight
    gradients (one tgmm for down, one for gate and up together). Nothing gathers weights, and the three passes
    (forward, dx products, dw products) read within 1.5x of rows + weights each."""
    text = _compiled(_auto_on_cuda(), grad=True)
    assert text.count(TRITON) == 5 and not _weight_gathers(text)
    read = hlo_traffic.traffic(text, {"d": 1})["hbm_read_bytes"]
    assert read <= 3 * 1.5 * (ROWS + WEIGHTS), (read / (ROWS + WEIGHTS))


def test_blocked_control_gathers_weights():
    text = _compiled("blocked", grad=False)
    assert _weight_gathers(text)
    read = hlo_traffic.traffic(text, {"d": 1})["hbm_read_bytes"]
    assert read > 2 * (ROWS + WEIGHTS)
