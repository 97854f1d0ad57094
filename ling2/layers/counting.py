"""Parameter and training-FLOP counts of a Ling2 config (no model is built).

Parameters are the trainable `nnx.Param`s of the decoder and its MTP layers; the
selection-only expert bias (a buffer updated outside the optimizer) is left out.
Active parameters count `num_experts_per_tok` routed experts per MoE layer instead of all.

Training FLOPs per token = 3 x forward (backward = 2 x forward):
  matmuls: 2 x the active matmul weights (projections, router, experts, lm_head; not the
    embedding lookup or norms);
  MLA: causal softmax attention over `seq_len` tokens, the mean context being seq_len/2:
    2 x H x (qk_head_dim + v_head_dim) x seq_len/2;
  GLA (chunked, chunk C): per head, the state read q.S and update k^T v (4 D^2) plus the
    causal intra-chunk scores and their product with v (2 x D x C).
"""


def _gla(cfg) -> int:
    E, H, D = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim
    norms = 2 * D if cfg.use_qk_norm else 0
    return E * 3 * H * D + E * H * D + H * D * E + norms + H * D


def _mla_matmul(cfg) -> int:
    E, H = cfg.emb_dim, cfg.num_query_heads
    Rq, Rkv, Dqk, Dv, Dr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    q = E * Rq + Rq * H * Dqk if Rq else E * H * Dqk
    return q + E * (Rkv + Dr) + Rkv * H * (cfg.qk_nope_head_dim + Dv) + H * Dv * E


def _mla(cfg) -> int:
    return _mla_matmul(cfg) + cfg.q_lora_rank + cfg.kv_lora_rank


def _moe(cfg, active: bool) -> int:
    E, N, F = cfg.emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    experts = cfg.num_experts_per_tok if active else N
    return E * N + experts * 3 * E * F + 3 * E * cfg.shared_experts * cfg.shared_expert_dim


def _layer(cfg, attn: str, mlp: str, active: bool) -> int:
    a = _mla(cfg) if attn == "mla" else _gla(cfg)
    m = 3 * cfg.emb_dim * cfg.mlp_dim if mlp == "dense" else _moe(cfg, active)
    return 2 * cfg.emb_dim + a + m


def count_params(cfg) -> dict:
    """{'embed', 'lm_head', 'layers', 'final_norm', 'mtp', 'decoder', 'total', 'active'}."""
    E, V = cfg.emb_dim, cfg.vocab_size
    kinds = list(zip(cfg.layer_types, cfg.mlp_types))
    out = {"embed": V * E, "lm_head": 0 if cfg.logits_via_embedding else E * V, "final_norm": E,
           "layers": sum(_layer(cfg, a, m, False) for a, m in kinds)}
    mtp_one = lambda active: 3 * E + 2 * E * E + _layer(cfg, "mla", "moe", active)  # enorm, hnorm, final norm
    out["mtp"] = cfg.mtp_num_layers * mtp_one(False)
    out["decoder"] = out["embed"] + out["lm_head"] + out["final_norm"] + out["layers"]
    out["total"] = out["decoder"] + out["mtp"]
    active_layers = sum(_layer(cfg, a, m, True) for a, m in kinds)
    out["active"] = (out["embed"] + out["lm_head"] + out["final_norm"] + active_layers
                     + cfg.mtp_num_layers * mtp_one(True))
    return out


def training_flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token (forward + backward) at `seq_len` (default max_target_length)."""
    S = seq_len or cfg.max_target_length
    E, H, D = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim

    def matmul(attn, mlp):
        a = _mla_matmul(cfg) if attn == "mla" else 5 * E * H * D
        m = 3 * E * cfg.mlp_dim if mlp == "dense" else _moe(cfg, active=True)
        return a + m

    def mixing(attn):
        if attn == "mla":
            return 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * S / 2
        return H * (4 * D * D + 2 * D * min(cfg.gla_chunk_size, S))

    kinds = list(zip(cfg.layer_types, cfg.mlp_types)) + [("mla", "moe")] * cfg.mtp_num_layers
    weights = sum(matmul(a, m) for a, m in kinds) + cfg.mtp_num_layers * 2 * E * E
    heads = (1 + cfg.mtp_num_layers) * E * cfg.vocab_size
    forward = 2 * (weights + heads) + sum(mixing(a) for a, _ in kinds)
    return 3.0 * forward
