"""Kimi Delta Attention (KDA): gated delta rule with a per-key-dim forget gate, chunked, with packing.

Recurrence (ling3.md fact 4; fla `chunk_kda`), per head, state S [K, V]:
  S <- diag(exp(g_t)) S;   S <- S + k_t^T (beta_t (v_t - k_t S));   o_t = scale * q_t S,
scale = K^-0.5 by default. q and k arrive L2-normalised (the layer does it); g <= 0 (the layer's
gate, e.g. -5 * sigmoid(.) for the safe gate); beta in [0, 1]. With `segment_ids` the state
restarts at every new segment (packed documents); the initial state belongs to the first
segment. `kda` pads T to the chunk size, dispatches to a backend and wraps it in a
`jax.custom_vjp` whose backward is chunked too (it recomputes chunk states; nothing per token is
stored beyond the inputs).

Backends: "chunked" (pure JAX, chunked.py), "pallas_tpu", "pallas_gpu" (Pallas kernels for the
forward and the backward; on CPU they run with interpret=True), the oracle "naive" (per-token
scan, autodiff), and "auto" (TPU -> pallas_tpu, CUDA -> pallas_gpu, else chunked), decided for the
platform the computation is lowered for, as in `gla`. All chunked
backends run the same per-chunk math (kda/chunk_math.py).
Numerics: the state and every accumulation are fp32 (fp64 for fp64 inputs); "chunked" computes
in fp32 throughout; with bf16 inputs the Pallas kernels feed data matmuls as bf16 (as fla does).
Per-key-dim decays are only ever exponentiated as sums of g over a span (never e^{-b}), so strong
gates (-5 per token, -320 over a chunk of 64, or unbounded) stay finite.

Axes in names: B batch, T time, L time padded to a multiple of C, C chunk size, N chunks, H heads,
K key dim, V value dim.
"""

import functools

import jax
import jax.numpy as jnp

from ling2.kernels import dispatch
from ling2.kernels.kda import chunked, pallas_gpu, pallas_tpu, reference
from ling2.kernels.layout import doc_index, prepare
from ling2.kernels.vma import vary_like

BACKENDS = ("auto", "chunked", "pallas_tpu", "pallas_gpu", "naive")


def resolve_backend(backend: str, platform: str) -> str:
    """The backend `backend` runs as when lowered for `platform` ("cpu", "tpu", "cuda", ...)."""
    if backend not in BACKENDS:
        raise ValueError(f"kda backend={backend!r}: expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    return {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}.get(platform, "chunked")


def prepare_beta(beta_BTH, C):
    """Pads T to a multiple of C with zeros and moves heads first: [B, T, H] -> [B, H, L]."""
    return jnp.pad(beta_BTH, ((0, 0), (0, -beta_BTH.shape[1] % C), (0, 0))).swapaxes(1, 2)


def prepare_docs(doc_BT, C):
    """Per-token document facts [B, 1, L] for the chunked kernels: doc (index, padding continues the
    last document), first (token shares the document of the state entering its chunk), last (token
    shares the document of its chunk's last token, so it reaches the state leaving the chunk)."""
    B, T = doc_BT.shape
    doc_BL = jnp.pad(doc_BT, ((0, 0), (0, -T % C)), mode="edge")
    N = doc_BL.shape[1] // C
    doc_BNC = doc_BL.reshape(B, N, C)
    end_BN1 = doc_BNC[..., -1:]
    before_BN1 = jnp.concatenate([doc_BNC[:, :1, :1], end_BN1[:, :-1]], axis=1)
    flat = lambda x_BNC: x_BNC.reshape(B, 1, N * C)
    return {"doc": flat(doc_BNC), "first": flat(doc_BNC == before_BN1), "last": flat(doc_BNC == end_BN1)}


_kernels = dispatch.backend_kernels(chunked, pallas_tpu, pallas_gpu)


def _run_kernel(which, backend, interpret, scale, C, *args):
    return dispatch.run_kernel(_kernels, lambda p: resolve_backend("auto", p), reference.acc_dtype, which,
                               backend, interpret, scale, C, *args)


def _zero_state(q_BTHK, v_BTHV):
    acc = reference.acc_dtype(q_BTHK.dtype)
    B, _, H, K = q_BTHK.shape
    return vary_like(jnp.zeros((B, H, K, v_BTHV.shape[3]), acc), q_BTHK)


def _run_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret):
    T = q_BTHK.shape[1]
    h0_BHKV = _zero_state(q_BTHK, v_BTHV) if h0_BHKV is None else h0_BHKV
    o_BHLV, hT_BHKV = _run_kernel(0, backend, interpret, scale, C, prepare(q_BTHK, C), prepare(k_BTHK, C),
                                  prepare(v_BTHV, C), prepare(g_BTHK, C), prepare_beta(beta_BTH, C),
                                  prepare_docs(doc_BT, C), h0_BHKV)
    return o_BHLV.swapaxes(1, 2)[:, :T].astype(q_BTHK.dtype), hT_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret):
    return _run_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret)


def _kda_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret):
    out = _run_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret)
    return out, (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV)


def _kda_bwd(scale, C, backend, interpret, res, cts):
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV = res
    do_BTHV, dhT_BHKV = cts
    T = q_BTHK.shape[1]
    h0_or_zero = _zero_state(q_BTHK, v_BTHV) if h0_BHKV is None else h0_BHKV
    dq_BHLK, dk_BHLK, dv_BHLV, dg_BHLK, dbeta_BHL, dh0_BHKV = _run_kernel(
        1, backend, interpret, scale, C, prepare(q_BTHK, C), prepare(k_BTHK, C), prepare(v_BTHV, C),
        prepare(g_BTHK, C), prepare_beta(beta_BTH, C), prepare_docs(doc_BT, C), h0_or_zero, prepare(do_BTHV, C),
        dhT_BHKV)
    back = lambda x, like: x.swapaxes(1, 2)[:, :T].astype(like.dtype)  # [B, H, L, ...] -> [B, T, H, ...]
    dh0_BHKV = None if h0_BHKV is None else dh0_BHKV.astype(h0_BHKV.dtype)
    return (back(dq_BHLK, q_BTHK), back(dk_BHLK, k_BTHK), back(dv_BHLV, v_BTHV), back(dg_BHLK, g_BTHK),
            back(dbeta_BHL, beta_BTH), None, dh0_BHKV)


_kda.defvjp(_kda_fwd, _kda_bwd)


def _check_chunk(C):
    if C < 16 or C & (C - 1):
        raise ValueError(f"kda: chunk_size={C} must be a power of two >= 16 (the chunk is halved level by level)")


def kda(q, k, v, g, beta, *, segment_ids=None, initial_state=None, scale=None, chunk_size=64, backend="auto",
        return_final_state=False, interpret=None):
    """Kimi Delta Attention over a sequence.

    Args:
      q, k: [B, T, H, K], L2-normalised over K; v: [B, T, H, V] (bf16 or fp32; accumulation is fp32).
      g: [B, T, H, K] log forget gate <= 0, per key dim (computed in fp32).
      beta: [B, T, H] write strength (sigmoid output).
      segment_ids: optional [B, T] ints; the state resets wherever the id changes.
      initial_state: optional [B, H, K, V] state entering the first segment.
      scale: query scale, default K^-0.5.
      chunk_size: tokens per chunk, a power of two >= 16.
      backend: one of BACKENDS.
      return_final_state: also return the state after the last token (fp32).
      interpret: run Pallas kernels in interpret mode; default (None): interpreted when lowered for CPU,
        compiled otherwise.
    Returns:
      o [B, T, H, V] in q's dtype, and the final state [B, H, K, V] fp32 if asked.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"kda: expected q, k [B,T,H,K] and v [B,T,H,V], got q{q.shape} k{k.shape} v{v.shape}")
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    if g.shape != q.shape:
        raise ValueError(f"kda: g must be [B,T,H,K]={B, T, H, K}, got {g.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"kda: beta must be [B,T,H]={B, T, H}, got {beta.shape}")
    _check_chunk(chunk_size)
    if segment_ids is None:
        doc_BT = jnp.zeros((B, T), jnp.int32)
    elif segment_ids.shape != (B, T):
        raise ValueError(f"kda: segment_ids must be [B,T]={B, T}, got {segment_ids.shape}")
    else:
        doc_BT = doc_index(segment_ids)
    if initial_state is not None and initial_state.shape != (B, H, K, Vd):
        raise ValueError(f"kda: initial_state must be [B,H,K,V]={B, H, K, Vd}, got {initial_state.shape}")
    acc = reference.acc_dtype(q.dtype)
    h0_BHKV = None if initial_state is None else initial_state.astype(acc)
    g_BTHK, beta_BTH = g.astype(acc), beta.astype(acc)
    scale = K**-0.5 if scale is None else float(scale)
    if backend not in BACKENDS:
        raise ValueError(f"kda backend={backend!r}: expected one of {BACKENDS}")
    if backend == "naive":
        h0_BHKV = _zero_state(q, v) if h0_BHKV is None else h0_BHKV
        o_BTHV, hT_BHKV = reference.naive_recurrence(q, k, v, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale)
        o_BTHV = o_BTHV.astype(q.dtype)
    else:
        h0_BHKV = None if h0_BHKV is None else vary_like(h0_BHKV, q)
        o_BTHV, hT_BHKV = _kda(q, k, v, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale, chunk_size, backend,
                               None if interpret is None else bool(interpret))
    return (o_BTHV, hT_BHKV) if return_final_state else o_BTHV


def kda_step(state, q_t, k_t, v_t, g_t, beta_t, *, scale=None, reset=None):
    """One decode step of the same recurrence.

    Args:
      state: [B, H, K, V] fp32 state after the previous token.
      q_t, k_t: [B, H, K] (L2-normalised); v_t: [B, H, V].
      g_t: [B, H, K] log forget gate; beta_t: [B, H].
      scale: default K^-0.5.
      reset: optional [B] bool, start a new document at this token (drop the state).
    Returns:
      (o_t [B, H, V] in q_t's dtype, new state [B, H, K, V] fp32).
    """
    acc = reference.acc_dtype(q_t.dtype)
    scale = q_t.shape[-1]**-0.5 if scale is None else scale
    reset = jnp.zeros(q_t.shape[:1], bool) if reset is None else reset
    o_BHV, S_BHKV = reference.step(state.astype(acc), *(x.astype(acc) for x in (q_t, k_t, v_t, g_t, beta_t)),
                                       reset, scale)
    return o_BHV.astype(q_t.dtype), S_BHKV
