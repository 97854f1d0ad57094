"""Simple gated linear attention (scalar decay per head or per token), chunked, with packing.

Recurrence (model.md, Lightning Attention-2 / fla `chunk_simple_gla`), per head:
  S_t = exp(g_t) * S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,   scale = K^-0.5 by default.
With `segment_ids` the state restarts at every new segment (packed documents); the
initial state belongs to the first segment. `simple_gla` pads T to the chunk size,
dispatches to a backend and wraps it in a `jax.custom_vjp` whose backward is chunked too
(it recomputes chunk states; nothing per token is stored). The gate gradient comes from
the identity dL/dB_i = q_i.dq_i - k_i.dk_i on the cumulative log-decay B.

Backends: "chunked" (pure JAX), "pallas_tpu", "pallas_gpu" (Pallas kernels; interpreted when
lowered for CPU), the oracles "naive" (per-token scan) and "quadratic" (T x T), and "auto"
(TPU -> pallas_tpu, CUDA -> pallas_gpu, else chunked). "auto" and the interpret default are
decided when the computation is lowered, for the platform it is lowered for
(`jax.lax.platform_dependent`), not from the host's devices: compiling on a CPU host for a
TPU topology builds the Mosaic kernels.
Numerics: the state and every accumulation are fp32. "chunked" computes in fp32 throughout;
with bf16 inputs the Pallas kernels feed the state and decayed scores to the matrix units as
bf16 (as fla does), which costs about 2-3% of the largest gradient entry in rounding.

Axes in names: B batch, T time, L time padded to a multiple of C, C chunk size, N chunks (in
`segment_end_states`: documents), H heads, K key dim, V value dim, D either head dim.
"""

import functools

import jax
import jax.numpy as jnp

from ling2.kernels import dispatch, vma
from ling2.kernels.gla import chunked, pallas_gpu, pallas_tpu, reference
from ling2.kernels.layout import doc_index, prepare

BACKENDS = ("auto", "chunked", "pallas_tpu", "pallas_gpu", "naive", "quadratic")


def resolve_backend(backend: str, platform: str, chunk_size: int = 64) -> str:
    """The backend `backend` runs as when lowered for `platform` ("cpu", "tpu", "cuda", ...)."""
    if backend not in BACKENDS:
        raise ValueError(f"gla backend={backend!r}: expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if platform == "cuda" and not pallas_gpu.supports_chunk(chunk_size):
        return "chunked"
    return {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}.get(platform, "chunked")


def prepare_aux(g_BTH, doc_BT, C):
    """Per-token fp32 decay factors [B, H, L] for the chunked kernels (see chunked.py)."""
    B, T, H = g_BTH.shape
    pad = -T % C
    g_BHL = jnp.pad(g_BTH.astype(jnp.float32), ((0, 0), (0, pad), (0, 0))).swapaxes(1, 2)
    doc_BL = jnp.pad(doc_BT, ((0, 0), (0, pad)), mode="edge")
    N = (T + pad) // C
    b_BHNC = jnp.cumsum(g_BHL.reshape(B, H, N, C), axis=-1)
    doc_B1NC = doc_BL.reshape(B, 1, N, C)
    end_B1N1 = doc_B1NC[..., -1:]
    before_B1N1 = jnp.concatenate([doc_B1NC[..., :1, :1], end_B1N1[..., :-1, :]], axis=2)
    alpha_BHNC = jnp.exp(jnp.where(doc_B1NC == before_B1N1, b_BHNC, -jnp.inf))
    w_BHNC = jnp.exp(jnp.where(doc_B1NC == end_B1N1, b_BHNC[..., -1:] - b_BHNC, -jnp.inf))
    flat = lambda x: jnp.broadcast_to(x, (B, H, N, C)).reshape(B, H, N * C)
    return {"b": flat(b_BHNC), "doc": flat(doc_B1NC), "alpha": flat(alpha_BHNC), "w": flat(w_BHNC)}


_kernels = dispatch.backend_kernels(chunked, pallas_tpu, pallas_gpu)


def _run_kernel(which, backend, interpret, scale, C, *args):
    return dispatch.run_kernel(_kernels, lambda p: resolve_backend("auto", p, C), lambda dt: jnp.float32, which,
                               backend, interpret, scale, C, *args)


def _zero_state(q_BTHK, v_BTHV):
    return jnp.zeros((q_BTHK.shape[0], q_BTHK.shape[2], q_BTHK.shape[3], v_BTHV.shape[3]), jnp.float32)


def _run_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret):
    T = q_BTHK.shape[1]
    h0_BHKV = _zero_state(q_BTHK, v_BTHV) if h0_BHKV is None else h0_BHKV
    o_BHLV, hT_BHKV = _run_kernel(0, backend, interpret, scale, C, prepare(q_BTHK, C), prepare(k_BTHK, C),
                                  prepare(v_BTHV, C), prepare_aux(g_BTH, doc_BT, C), h0_BHKV)
    return o_BHLV.swapaxes(1, 2)[:, :T].astype(q_BTHK.dtype), hT_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _gla(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret):
    return _run_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret)


def _gla_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret):
    o_BTHV, hT_BHKV = _run_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale, C, backend, interpret)
    return (o_BTHV, hT_BHKV), (q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, hT_BHKV)


def _gla_bwd(scale, C, backend, interpret, res, cts):
    q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, hT_BHKV = res
    do_BTHV, dhT_BHKV = cts
    T = q_BTHK.shape[1]
    q_BHLK, k_BHLK = prepare(q_BTHK, C), prepare(k_BTHK, C)
    h0_or_zero = _zero_state(q_BTHK, v_BTHV) if h0_BHKV is None else h0_BHKV
    dq_BHLK, dk_BHLK, dv_BHLV, dh0_BHKV = _run_kernel(
        1, backend, interpret, scale, C, q_BHLK, k_BHLK, prepare(v_BTHV, C), prepare_aux(g_BTH, doc_BT, C),
        h0_or_zero, prepare(do_BTHV, C), dhT_BHKV)
    f32 = jnp.float32
    db_BHL = jnp.sum(q_BHLK.astype(f32) * dq_BHLK - k_BHLK.astype(f32) * dk_BHLK, axis=-1)
    db_BHL = db_BHL.at[..., -1].add(jnp.sum(dhT_BHKV * hT_BHKV, axis=(-2, -1)))
    dg_BTH = jnp.flip(jnp.cumsum(jnp.flip(db_BHL, -1), -1), -1).swapaxes(1, 2)[:, :T]
    back = lambda x_BHLD, like: x_BHLD.swapaxes(1, 2)[:, :T].astype(like.dtype)
    dh0_BHKV = None if h0_BHKV is None else dh0_BHKV.astype(h0_BHKV.dtype)
    return (back(dq_BHLK, q_BTHK), back(dk_BHLK, k_BTHK), back(dv_BHLV, v_BTHV), dg_BTH.astype(g_BTH.dtype), None,
            dh0_BHKV)


_gla.defvjp(_gla_fwd, _gla_bwd)


def simple_gla(q, k, v, g, *, segment_ids=None, initial_state=None, scale=None, chunk_size=64,
               backend="auto", return_final_state=False, interpret=None):
    """Gated linear attention with a scalar log-decay per head or per token.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (bf16 or fp32; accumulation is fp32).
      g: log-decay <= 0, per head [H] or per token [B, T, H].
      segment_ids: optional [B, T] ints; the state resets wherever the id changes.
      initial_state: optional [B, H, K, V] state entering the first segment.
      scale: query scale, default K^-0.5.
      chunk_size: tokens per chunk (a multiple of 8).
      backend: one of BACKENDS ("auto": chosen for the platform the computation is lowered for).
      return_final_state: also return the fp32 state after the last token.
      interpret: run Pallas kernels in interpret mode; default (None): interpreted when lowered for
        CPU, compiled otherwise.
    Returns:
      o [B, T, H, V] in q's dtype, and the final state [B, H, K, V] fp32 if asked.
    """
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"simple_gla: expected q, k [B,T,H,K] and v [B,T,H,V], got q{q.shape} k{k.shape} v{v.shape}")
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    if g.shape == (H,):
        # A per-head decay is a constant of the model: the barrier keeps XLA from constant-folding the
        # [B, H, L] decay factors derived from it (seconds of compile time per layer at 32K tokens).
        g_BTH = jnp.broadcast_to(jax.lax.optimization_barrier(g.astype(jnp.float32)), (B, T, H))
    elif g.shape != (B, T, H):
        raise ValueError(f"simple_gla: g must be [H]={H,} or [B,T,H]={B, T, H}, got {g.shape}")
    else:
        g_BTH = g
    if chunk_size <= 0 or chunk_size % 8:
        raise ValueError(f"simple_gla: chunk_size={chunk_size} must be a positive multiple of 8")
    if segment_ids is None:
        doc_BT = jnp.zeros((B, T), jnp.int32)
    elif segment_ids.shape != (B, T):
        raise ValueError(f"simple_gla: segment_ids must be [B,T]={B, T}, got {segment_ids.shape}")
    else:
        doc_BT = doc_index(segment_ids)
    if initial_state is not None and initial_state.shape != (B, H, K, Vd):
        raise ValueError(f"simple_gla: initial_state must be [B,H,K,V]={B, H, K, Vd}, got {initial_state.shape}")
    h0_BHKV = initial_state
    scale = K**-0.5 if scale is None else float(scale)
    if backend not in BACKENDS:
        raise ValueError(f"gla backend={backend!r}: expected one of {BACKENDS}")
    if backend in ("naive", "quadratic"):
        oracle = reference.naive_recurrence if backend == "naive" else reference.quadratic
        o_BTHV, hT_BHKV = oracle(q, k, v, g_BTH, doc_BT, _zero_state(q, v) if h0_BHKV is None else h0_BHKV, scale)
        o_BTHV = o_BTHV.astype(q.dtype)
    else:
        g_BTH = vma.vary_like(g_BTH, q)
        h0_BHKV = None if h0_BHKV is None else vma.vary_like(h0_BHKV, q)
        o_BTHV, hT_BHKV = _gla(q, k, v, g_BTH, doc_BT, h0_BHKV, scale, chunk_size, backend,
                               None if interpret is None else bool(interpret))
    return (o_BTHV, hT_BHKV) if return_final_state else o_BTHV


def simple_gla_step(state, q_t, k_t, v_t, g, *, scale=None, reset=None):
    """One decode step of the same recurrence.

    Args:
      state: [B, H, K, V] fp32 state after the previous token.
      q_t, k_t: [B, H, K]; v_t: [B, H, V].
      g: log-decay [H] or [B, H].
      scale: default K^-0.5.
      reset: optional [B] bool, start a new document at this token (drop the state).
    Returns:
      (o_t [B, H, V] in q_t's dtype, new state [B, H, K, V] fp32).
    """
    f32 = jnp.float32
    scale = q_t.shape[-1]**-0.5 if scale is None else scale
    decay_BH = jnp.broadcast_to(jnp.exp(g.astype(f32)), q_t.shape[:2])
    if reset is not None:
        decay_BH = jnp.where(reset[:, None], 0.0, decay_BH)
    S_BHKV = (decay_BH[..., None, None] * state.astype(f32)
              + k_t.astype(f32)[..., :, None] * v_t.astype(f32)[..., None, :])
    o_BHV = scale * jnp.einsum("bhk,bhkv->bhv", q_t.astype(f32), S_BHKV, precision=jax.lax.Precision.HIGHEST)
    return o_BHV.astype(q_t.dtype), S_BHKV


def segment_end_states(k, v, g, segment_ids, num_docs: int):
    """The state at the end of each of the first `num_docs` documents of every row, each started
    from zero: S_d = sum over t in d of exp(g)^(end_d - t) k_t^T v_t (the closed form of the
    recurrence for a per-head decay). What a packed prefill hands each document's own decode row.

    Args:
      k: [B, T, H, K]; v: [B, T, H, V]; g: per-head log-decay [H].
      segment_ids: [B, T]; a document is a run of equal ids (`doc_index`).
      num_docs: N, documents returned per row (missing ones are zero).
    Returns:
      [B, N, H, K, V] fp32.
    """
    B, T, H, _ = k.shape
    if g.shape != (H,):
        raise ValueError(f"segment_end_states: g must be per head [H]={H,}, got {g.shape}")
    doc_BT = doc_index(segment_ids)
    t_T = jnp.arange(T, dtype=jnp.int32)
    in_doc_BNT = doc_BT[:, None, :] == jnp.arange(num_docs, dtype=jnp.int32)[None, :, None]
    end_BN = jnp.max(jnp.where(in_doc_BNT, t_T, -1), axis=-1)
    age_BNT = (end_BN[:, :, None] - t_T).astype(jnp.float32)
    w_BNTH = jnp.where(in_doc_BNT[..., None], jnp.exp(age_BNT[..., None] * g.astype(jnp.float32)), 0.0)
    f32 = jnp.float32
    return jnp.einsum("bnth,bthk,bthv->bnhkv", w_BNTH, k.astype(f32), v.astype(f32),
                      precision=jax.lax.Precision.HIGHEST)
