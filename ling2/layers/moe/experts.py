"""SwiGLU experts: the dense MLP, stacked routed experts and their two compute paths.

Shapes: T tokens (B*S), D model dim, E experts, F expert width, K experts per token,
M = T*K assignments, C capacity per expert per sequence.

Dropless path: sort the M assignments by expert, run a grouped matmul (ling2.kernels.moe.gmm:
`jax.lax.ragged_dot`, or tiles on CPU), unsort.
Dense path: GShard-style one-hot dispatch per sequence with `capacity_factor`; assignments
past capacity are dropped, first choices first (slot-major priority).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ling2.config.specs import MoESpec, WeightsSpec
from ling2.kernels import fp8
from ling2.kernels.moe.gmm import gather_rows

F32 = jnp.float32


def _param(rngs, spec: WeightsSpec, shape, names):
    init = nnx.initializers.normal(spec.init_std)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(spec.weight_dtype)), out_sharding=names, eager_sharding=False)


def swiglu(x, wg, wu, wd, q: fp8.Fp8 | None = None):
    """SwiGLU over the last axis of x; FP8 GEMMs with `q`."""
    if q is None:
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
    x_MD = x.reshape(-1, x.shape[-1])
    mm = lambda a, w: fp8.einsum("md,df->mf", a, w, q)
    return mm(jax.nn.silu(mm(x_MD, wg)) * mm(x_MD, wu), wd).reshape(*x.shape[:-1], -1)


class Mlp(nnx.Module):
    """Dense SwiGLU MLP, D -> width -> D (HF gate_proj/up_proj/down_proj, kernels stored [in, out])."""

    def __init__(self, spec: WeightsSpec, width: int, *, rngs: nnx.Rngs):
        self.dtype, self.fp8 = jnp.dtype(spec.dtype), fp8.of(spec.run)
        self.gate_proj = _param(rngs, spec, (spec.emb_dim, width), ("embed", "mlp"))
        self.up_proj = _param(rngs, spec, (spec.emb_dim, width), ("embed", "mlp"))
        self.down_proj = _param(rngs, spec, (width, spec.emb_dim), ("mlp", "embed"))

    def __call__(self, x_xD):
        dt = self.dtype
        return swiglu(x_xD.astype(dt), self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt),
                      self.down_proj[...].astype(dt), self.fp8)


class RoutedExperts(nnx.Module):
    """E SwiGLU experts stacked: gate_proj/up_proj [E, D, F], down_proj [E, F, D]."""

    def __init__(self, spec: MoESpec, *, rngs: nnx.Rngs):
        E, D, F = spec.num_experts, spec.emb_dim, spec.base_moe_mlp_dim
        self.gate_proj = _param(rngs, spec, (E, D, F), ("exp", "embed", "mlp"))
        self.up_proj = _param(rngs, spec, (E, D, F), ("exp", "embed", "mlp"))
        self.down_proj = _param(rngs, spec, (E, F, D), ("exp", "mlp", "embed"))

    def weights(self, dtype):
        return tuple(p[...].astype(dtype) for p in (self.gate_proj, self.up_proj, self.down_proj))


def sort_by_expert(experts_TK, num_experts: int):
    """The M flattened assignments in expert order, stable (by assignment index within an expert): order_M
    (sorted position -> assignment t*K+k), its inverse inv_M (assignment -> sorted position) and the group
    sizes gs_E [E]. One sort: the inverse is a scatter (`invert`)."""
    flat_M = experts_TK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    return order_M, invert(order_M), jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)


def invert(order_M):
    """The inverse of the permutation order_M, [M]: equal to argsort(order_M), by a scatter of iota instead
    of a second sort."""
    iota_M = jnp.arange(order_M.shape[0], dtype=order_M.dtype)
    return jnp.zeros_like(order_M).at[order_M].set(iota_M, unique_indices=True)


def combine(y_TKD, weights_TK, dtype):
    """sum_k w_k * y_k [T, D] in `dtype`. y [T, K, D] stays in the activation dtype and the router weights
    in theirs (fp32); products and sum are fp32 (preferred_element_type), the values of the fp32 formula,
    with no fp32 copy of y: the backward keeps y as it is, and the weights' gradient comes back fp32."""
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK, preferred_element_type=F32).astype(dtype)


def dropless(x_TD, experts_TK, weights_TK, w, ffn):
    """Routed output [T, D]: every assignment is computed (sort, grouped matmul, unsort). ffn(x_MD, gs_E, w)
    is the grouped SwiGLU (the plan's: `ling2.layers.moe.plan.grouped_ffn`)."""
    T, K = experts_TK.shape
    order_M, inv_M, gs_E = sort_by_expert(experts_TK, w[0].shape[0])
    x_MD = gather_rows(x_TD, order_M // K, inv_M, K)
    y_MD = ffn(x_MD, gs_E, w)
    y_TKD = gather_rows(y_MD, inv_M, order_M, 1).reshape(T, K, -1)
    return combine(y_TKD, weights_TK, x_TD.dtype)


def gathered(x_TD, experts_TK, weights_TK, w):
    """Routed output [T, D] from each token's K experts' weights gathered ([T, K, D, F]): the same
    sum as `dropless`, reading T*K experts' weights instead of every expert's (decode-sized T)."""
    wg, wu, wd = (a[experts_TK] for a in w)
    h = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x_TD, wg)) * jnp.einsum("td,tkdf->tkf", x_TD, wu)
    return combine(jnp.einsum("tkf,tkfd->tkd", h, wd), weights_TK, x_TD.dtype)


def capacity(seq_len: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: ceil(S*K/E * factor), or S (nothing dropped) when factor <= 0."""
    if capacity_factor <= 0:
        return seq_len
    return max(1, min(seq_len, math.ceil(seq_len * k / num_experts * capacity_factor)))


def dispatch_mask(experts_BSK, num_experts: int, cap: int):
    """One-hot dispatch [B, S, E, C] and the kept-assignment mask [B, S, K].

    Slot order in an expert's queue: all first choices by position, then all second choices, ...
    """
    B, S, K = experts_BSK.shape
    onehot_BKSE = jax.nn.one_hot(experts_BSK.transpose(0, 2, 1), num_experts, dtype=jnp.int32)
    pos_BKSE = jnp.cumsum(onehot_BKSE.reshape(B, K * S, num_experts), axis=1).reshape(B, K, S, -1) - 1
    keep_BKSE = (onehot_BKSE > 0) & (pos_BKSE < cap)
    pos_BSE = jnp.where(keep_BKSE, pos_BKSE, 0).sum(1)
    keep_BSE = keep_BKSE.any(1)
    dispatch_BSEC = jax.nn.one_hot(pos_BSE, cap, dtype=jnp.int32) * keep_BSE[..., None]
    kept_BSK = keep_BKSE.any(-1).transpose(0, 2, 1)
    return dispatch_BSEC, kept_BSK


def dense_capacity(x_BSD, experts_BSK, weights_BSK, w, capacity_factor: float, q: fp8.Fp8 | None = None):
    """Routed output [B, S, D] by one-hot einsums with C slots per expert; returns (y, kept_BSK). `q`: the
    experts' GEMMs in FP8 (the one-hot dispatch and combine stay exact)."""
    B, S, K = experts_BSK.shape
    E = w[0].shape[0]
    dispatch_BSEC, kept_BSK = dispatch_mask(experts_BSK, E, capacity(S, K, E, capacity_factor))
    w_BSE = jnp.einsum("bske,bsk->bse", jax.nn.one_hot(experts_BSK, E, dtype=F32), weights_BSK.astype(F32))
    x_BECD = jnp.einsum("bsec,bsd->becd", dispatch_BSEC.astype(x_BSD.dtype), x_BSD)
    wg, wu, wd = w
    h = jax.nn.silu(fp8.einsum("becd,edf->becf", x_BECD, wg, q)) * fp8.einsum("becd,edf->becf", x_BECD, wu, q)
    y_BECD = fp8.einsum("becf,efd->becd", h, wd, q)
    combine_BSEC = dispatch_BSEC.astype(F32) * w_BSE[..., None]
    y_BSD = jnp.einsum("bsec,becd->bsd", combine_BSEC, y_BECD.astype(F32))
    return y_BSD.astype(x_BSD.dtype), kept_BSK
