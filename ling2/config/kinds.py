"""What the config knows of each attention kind of the hybrid, one entry per kind: its own fields and which of
them a resumed run may change, its checks, its context-parallel granule, its place in the layer cycle and the
HF layout it is written in. `ling2.layers.attention.registry` adds each kind's module, FLOP count, cache and HF
names; code elsewhere asks these two tables instead of naming a kind.

Roles: the "full" kind is the softmax attention of every `inhomogeneous_layer_cycle_interval`-th layer and of
the MTP layers; a "linear" kind is what `linear_attention_type` names for the other layers.
"""

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class KindConfig:
    role: str  # "full" or "linear"
    fields: tuple[str, ...]  # its own config fields
    free_on_resume: tuple[str, ...]  # of those, the ones that change how, not what, it computes
    chunk_field: str | None = None  # tokens per kernel chunk: a context shard must hold whole chunks
    trailing_group_linear: bool = False  # a trailing partial group of the layer cycle stays this kind (Ling 3)
    hf_layout: str = "bailing"  # the HF layout a model of this linear kind is written in by default
    validate: Callable = lambda cfg, need: None  # its own checks: need(condition, field, why)
    rotary_dim: Callable = lambda cfg: cfg.qk_rope_head_dim  # rotated dims per head it shares with the full kind


def _gla_checks(cfg, need):
    rot = cfg.head_dim * cfg.partial_rotary_factor
    need(rot == int(rot) and int(rot) % 2 == 0, "partial_rotary_factor",
         f"head_dim*partial_rotary_factor={rot} must be an even integer")
    need(int(rot) == cfg.qk_rope_head_dim, "qk_rope_head_dim",
         f"must equal head_dim*partial_rotary_factor={rot} (both rotary tables share it)")


def _kda_checks(cfg, need):
    need(cfg.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even, got {cfg.qk_rope_head_dim}")
    C = cfg.kda_chunk_size
    need(C >= 16 and C & (C - 1) == 0, "kda_chunk_size", f"must be a power of two >= 16, got {C}")


KINDS: dict[str, KindConfig] = {
    "mla": KindConfig(
        role="full",
        fields=("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "mla_output_gate", "mla_interleaved_rope", "attention_kernel", "attention_block_size"),
        free_on_resume=("attention_kernel", "attention_block_size")),
    "gla": KindConfig(
        role="linear",
        fields=("use_qk_norm", "use_linear_silu", "group_norm_size", "gla_slope_layer_offset", "gla_chunk_size",
                "gla_backend"),
        free_on_resume=("gla_chunk_size", "gla_backend"), chunk_field="gla_chunk_size", validate=_gla_checks,
        rotary_dim=lambda cfg: int(cfg.head_dim * cfg.partial_rotary_factor)),
    "kda": KindConfig(
        role="linear",
        fields=("kda_conv_kernel_size", "kda_safe_gate", "kda_lower_bound", "kda_chunk_size", "kda_backend"),
        free_on_resume=("kda_chunk_size", "kda_backend"), chunk_field="kda_chunk_size", trailing_group_linear=True,
        hf_layout="bailing_hybrid", validate=_kda_checks),
}

FULL = next(k for k, v in KINDS.items() if v.role == "full")


def free_on_resume() -> dict[str, str]:
    """Every kind's fields that a resumed run may change silently (kernel choices and their chunking)."""
    return {f: "free" for kind in KINDS.values() for f in kind.free_on_resume}
