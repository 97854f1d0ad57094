"""quantization=fp8 through the real XLA:GPU compiler for one H100 (cuda venv, no GPU attached): the trainer's
compiled step hands its projection GEMMs float8 operands, forward (e4m3 x e4m3) and backward (e5m2 gradients x
e4m3), and its routed experts' Triton grouped kernels float8 operands too; the unquantized step has none. The
reference is the optimized HLO itself: each dot's operand element types (`dot_operand_types`) and each Triton
call's operand types."""

import collections
import re

import pytest

from ling2 import topology
from ling2.config.loader import load_config
from ling2.kernels.testing.cuda import TRITON, dot_operand_types
from ling2.train.loop import compile_train_step
from ling2.train.runtime import make_mesh
from ling2.train.state import abstract_state

E4, E5 = "f8e4m3fn", "f8e5m2"


def compiled_dots(**overrides):
    cfg = load_config(model_name="ling2-tiny", dtype="bfloat16", max_target_length=256, per_device_batch_size=2,
                      **overrides)
    mesh = make_mesh(cfg, topology.devices("h100-1"))
    text = compile_train_step(cfg, mesh, abstract_state(cfg, mesh)).as_text()
    return collections.Counter((a, b) for a, b, _ in dot_operand_types(text)), dot_operand_types(text), text


def float8_kernel_calls(text):
    return [line for line in text.splitlines() if TRITON in line and re.search(r"f8e(4m3fn|5m2)\[\d+,", line)]


@pytest.fixture(scope="module")
def bf16_dots():
    return compiled_dots()


def test_fp8_step_runs_its_gemms_on_float8_operands(bf16_dots):
    counts, dots, text = compiled_dots(quantization="fp8")
    forward = counts[(E4, E4)]
    backward = counts[(E5, E4)] + counts[(E4, E5)]
    # ling2-tiny: 10 layers of q_a, q_b, kv_a, kv_b, dense (MLA) or qkv, g_proj, dense (GLA), the dense MLP's
    # or the shared experts' 3, MTP's eh_proj and its layer: dozens of GEMMs, each with one forward and two
    # backward f8 products.
    assert forward >= 40, counts
    assert backward >= 2 * 30, counts
    names = " ".join(n for a, b, n in dots if E4 in (a, b))
    for einsum in ("bte,eshd->btshd", "bthv,hve->bte", "md,df->mf", "btf,fe->bte"):
        assert einsum in names, einsum  # GLA qkv, MLA out, shared experts, MTP
    # the routed experts: the six grouped kernels of each MoE layer on float8 operands (forward and backward)
    assert "nbd,ndf->nbf" not in names and len(float8_kernel_calls(text)) >= 6
    # What stays in higher precision: the loss head, attention scores, router (no f8 among their dots).
    assert "bte,ev->btv" not in names and "bte,ec->btc" not in names


def test_unquantized_step_has_no_float8(bf16_dots):
    counts, _, text = bf16_dots
    assert not any(E4 in k or E5 in k for k in counts), counts
    assert not float8_kernel_calls(text)
