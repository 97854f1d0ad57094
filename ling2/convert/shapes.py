"""Shape and dtype of every leaf of DecoderWithMTP(cfg)'s pure-dict state, from the config alone.

The converter needs only the leaves' shapes to plan its files; tracing the model
(jax.eval_shape) for them costs ~0.5 s, more than streaming a 500 MB checkpoint. This
mirrors the parameter shapes of ling2.layers (embed, decoder, attention_gla,
attention_mla, moe, mtp); shapes_test checks it equals the traced model's state. Keys
are sorted as nnx sorts them, so files planned from it are laid out as before.
"""

import numpy as np


def _norm(dim, wdt) -> dict:
    return {("weight",): ((dim,), wdt)}


def _under(prefix: tuple, leaves: dict) -> dict:
    return {prefix + p: v for p, v in leaves.items()}


def _gla(cfg, wdt) -> dict:
    E, H, D = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim
    out = {("qkv",): ((E, 3, H, D), wdt), ("g_proj",): ((E, H, D), wdt), ("dense",): ((H, D, E), wdt)}
    if cfg.use_qk_norm:
        out |= _under(("q_norm",), _norm(D, wdt)) | _under(("k_norm",), _norm(D, wdt))
    return out | _under(("g_norm",), _norm(H * D, wdt))


def _mla(cfg, wdt) -> dict:
    E, H, Dn, Dr, Dv = cfg.emb_dim, cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    if Rq:
        out = {("q_a",): ((E, Rq), wdt), ("q_b",): ((Rq, H, Dn + Dr), wdt)} | _under(("q_a_norm",), _norm(Rq, wdt))
    else:
        out = {("q",): ((E, H, Dn + Dr), wdt)}
    out |= {("kv_a",): ((E, Rkv + Dr), wdt), ("kv_b",): ((Rkv, H, Dn + Dv), wdt), ("dense",): ((H, Dv, E), wdt)}
    return out | _under(("kv_a_norm",), _norm(Rkv, wdt))


def _swiglu(E, F, wdt, lead=()) -> dict:
    return {("gate_proj",): (lead + (E, F), wdt), ("up_proj",): (lead + (E, F), wdt),
            ("down_proj",): (lead + (F, E), wdt)}


def _moe(cfg, wdt) -> dict:
    E, X = cfg.emb_dim, cfg.num_experts
    out = {("gate", "kernel"): ((E, X), wdt),
           ("gate", "expert_bias"): ((X,), np.dtype(_jnp_dtype(cfg.routed_bias_dtype_resolved)))}
    out |= _under(("experts",), _swiglu(E, cfg.base_moe_mlp_dim, wdt, (X,)))
    width = cfg.shared_experts * cfg.shared_expert_dim
    return out | (_under(("shared_experts",), _swiglu(E, width, wdt)) if width else {})


def _layer(cfg, attn_type: str, mlp_type: str, wdt) -> dict:
    """One DecoderLayer: input_norm, attention (gla|mla), post_attention_norm, mlp (dense|moe)."""
    if attn_type not in ("gla", "mla") or mlp_type not in ("dense", "moe"):
        raise ValueError(f"convert shapes: unknown layer kind {attn_type!r}/{mlp_type!r}")
    attn = _gla(cfg, wdt) if attn_type == "gla" else _mla(cfg, wdt)
    mlp = _swiglu(cfg.emb_dim, cfg.mlp_dim, wdt) if mlp_type == "dense" else _moe(cfg, wdt)
    return (_under(("input_norm",), _norm(cfg.emb_dim, wdt)) | _under(("post_attention_norm",), _norm(cfg.emb_dim, wdt))
            | _under(("attention",), attn) | _under(("mlp",), mlp))


def _jnp_dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # bfloat16 and friends resolve through jax, as the model's do

    return np.dtype(jnp.dtype(name))


def leaf_specs(cfg) -> dict:
    """{key path: (shape, numpy dtype)} of every Variable of DecoderWithMTP(cfg), in nnx's key order."""
    from ling2.layers.decoder import scan_plan

    wdt, E, L = _jnp_dtype(cfg.weight_dtype), cfg.emb_dim, cfg.num_decoder_layers
    if getattr(cfg.decoder_block, "value", cfg.decoder_block) != "ling2":
        raise ValueError(f"convert shapes: decoder_block {cfg.decoder_block!r} is not the Ling2 decoder")
    out = {("decoder", "embed", "embedding"): ((cfg.vocab_size, E), wdt)}
    out |= _under(("decoder", "final_norm"), _norm(E, wdt))
    if not cfg.logits_via_embedding:
        out[("decoder", "lm_head", "kernel")] = ((E, cfg.vocab_size), wdt)
    layer = lambda i: _layer(cfg, cfg.layer_types[i], cfg.mlp_types[i], wdt)  # noqa: E731
    if not cfg.scan_layers:
        for i in range(L):
            out |= _under(("decoder", "layers", i), layer(i))
    else:
        p, n, k = scan_plan(cfg)
        for i in range(p):
            out |= _under(("decoder", "prefix", i), layer(i))
        for j in range(k if n else 0):  # group g's layer j is layer p + g*k + j; stacked on a leading [n] axis
            out |= {("decoder", "groups", "layers", j) + q: ((n,) + s, d) for q, (s, d) in layer(p + j).items()}
        for j, i in enumerate(range(p + n * k, L)):
            out |= _under(("decoder", "suffix", j), layer(i))
    for d in range(cfg.mtp_num_layers):
        depth = {("eh_proj",): ((2 * E, E), wdt)} | _under(("layer",), _layer(cfg, "mla", "moe", wdt))
        for name in ("enorm", "hnorm", "final_norm"):
            depth |= _under((name,), _norm(E, wdt))
        out |= _under(("mtp", "depths", d), depth)
    return dict(sorted(out.items(), key=lambda kv: tuple((isinstance(x, str), x) for x in kv[0])))
