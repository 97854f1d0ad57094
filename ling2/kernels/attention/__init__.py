"""Causal softmax attention with packed documents (the MLA layer's backends as one op, `op.attention`): plain
and blocked einsums (`dense`), cuDNN's fused kernel (`cudnn`), Pallas splash attention (`splash`)."""

from ling2.kernels.attention.context import balanced_context_attention
from ling2.kernels.attention.dense import NEG_INF, attention_mask
from ling2.kernels.attention.op import BACKENDS, attention

__all__ = ["BACKENDS", "NEG_INF", "attention", "attention_mask", "balanced_context_attention"]
