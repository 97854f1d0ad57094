"""KDA kernels (naive oracle and chunked form) against flash-linear-attention, packing and decode.

Independent references: fla-core's `naive_recurrent_kda` and `naive_chunk_kda` (fla/ops/kda/naive.py,
torch, loaded by path; run in fp64 by widening the file's fp32 casts, and also as shipped in fp32;
torch autograd gives its gradients), each document run on its own for packing, and the per-token
recurrence (reference.py, autodiff) for the chunked form on inputs fla cannot take (segments).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import kda
from ling2.kernels.testing import fla_reference

NAMES = ("o", "hT") + fla_reference.KDA_GRAD_NAMES


def _l2(x):
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def _inputs(B, T, H, K, V, *, seed=0, gate=(-5.0, 0.0)):
    """Numpy float64 inputs as the layer makes them: L2-normed q, k; g = lo + (hi - lo) sigmoid(.); beta = sigmoid(.);
    an initial state; and cotangents do, dhT for the gradients."""
    r = np.random.default_rng(seed)
    sig = lambda x: 1 / (1 + np.exp(-x))
    lo, hi = gate
    return dict(q=_l2(r.standard_normal((B, T, H, K))), k=_l2(r.standard_normal((B, T, H, K))),
                v=r.standard_normal((B, T, H, V)), g=lo + (hi - lo) * sig(2 * r.standard_normal((B, T, H, K))),
                beta=sig(r.standard_normal((B, T, H))), h0=r.standard_normal((B, H, K, V)),
                do=r.standard_normal((B, T, H, V)), dhT=r.standard_normal((B, H, K, V)))


@functools.partial(jax.jit, static_argnames=("backend", "C"))
def _vjp(q, k, v, g, beta, h0, seg, do, dhT, backend, C):
    """o, final state and the gradients of <o, do> + <hT, dhT> wrt q, k, v, g, beta, h0."""
    f = lambda q, k, v, g, beta, h0: kda.kda(q, k, v, g, beta, segment_ids=seg, initial_state=h0, chunk_size=C,
                                              backend=backend, return_final_state=True)
    (o, hT), pull = jax.vjp(f, q, k, v, g, beta, h0)
    return (o, hT) + pull((do.astype(o.dtype), dhT))


def _ours(x, backend, C, dtype=jnp.float32, seg=None):
    cast = lambda a, dt: jnp.asarray(a, dt)
    args = [cast(x[n], dtype) for n in ("q", "k", "v")] + [cast(x[n], jnp.float32 if dtype == jnp.bfloat16 else dtype)
                                                           for n in ("g", "beta", "h0")]
    ct = [cast(x["do"], dtype), cast(x["dhT"], jnp.float32 if dtype == jnp.bfloat16 else dtype)]
    out = _vjp(*args, None if seg is None else jnp.asarray(seg), *ct, backend=backend, C=C)
    return dict(zip(NAMES, (np.asarray(a, np.float64) for a in out)))


def _rel_err(got, want):
    """Largest error of each output relative to the reference's largest magnitude."""
    return {n: float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want}


def _assert_close(got, want, rtol):
    for n, e in _rel_err(got, want).items():
        assert np.all(np.isfinite(got[n])), f"{n} not finite"
        assert e <= rtol, f"{n}: relative error {e:.2e} > {rtol:.0e}"


FLA_CASES = {
    # name: (B, T, H, K, V, chunk, gate range)
    "T37_not_a_chunk_multiple_K16_V24": (2, 37, 2, 16, 24, 16, (-5.0, 0.0)),
    "strong_gate_at_the_-5_bound": (1, 128, 2, 16, 16, 64, (-5.0, -4.9)),  # chunk sums down to -320
}


@pytest.mark.parametrize("backend", ["naive", "chunked"])
@pytest.mark.parametrize("case", FLA_CASES)
def test_matches_fla_naive_recurrent_in_float64(case, backend):
    B, T, H, K, V, C, gate = FLA_CASES[case]
    x = _inputs(B, T, H, K, V, gate=gate)
    want = fla_reference.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], do=x["do"], dhT=x["dhT"])
    with jax.enable_x64(True):
        got = _ours(x, backend, C, jnp.float64)
    _assert_close(got, want, 1e-11)


def test_chunked_matches_fla_naive_chunk_in_float64():
    """fla's own chunked (WY) reference, chunk 64 (it needs T % 64 == 0)."""
    x = _inputs(1, 128, 2, 16, 16, seed=1, gate=(-1.0, 0.0))
    want = fla_reference.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], do=x["do"], dhT=x["dhT"],
                             chunk_size=64)
    with jax.enable_x64(True):
        got = _ours(x, "chunked", 64, jnp.float64)
    _assert_close(got, want, 1e-11)


def test_chunked_fp32_matches_fla_as_shipped():
    """The unmodified fla file (fp32 inside) against the fp32 chunked kernel at the real head dim."""
    x = _inputs(1, 100, 2, 128, 128, seed=2)
    want = fla_reference.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], do=x["do"], dhT=x["dhT"],
                             float64=False)
    _assert_close(_ours(x, "chunked", 64), want, 2e-5)


SEGMENTS = np.array([[0] * 9 + [1] + [2] * 27, [5] * 16 + [3] * 21])  # a 1-token segment; a chunk-edge boundary


@pytest.mark.parametrize("gate", [(-5.0, 0.0), (-5.0, -4.0)])
def test_chunked_matches_naive_with_segments(gate):
    x = _inputs(2, 37, 2, 16, 24, seed=3, gate=gate)
    _assert_close(_ours(x, "chunked", 16, seg=SEGMENTS), _ours(x, "naive", 16, seg=SEGMENTS), 2e-5)


@pytest.mark.parametrize("backend", ["naive", "chunked"])
def test_packing_equals_separate_documents(backend):
    """One row of three packed 15-token documents gives the outputs, final state and gradients of the three
    documents run alone, one per batch row (the initial state enters the first document only)."""
    L, n = 15, 3
    x = _inputs(n, L, 2, 16, 16, seed=4)
    alone = dict(x, h0=x["h0"] * (np.arange(n) == 0)[:, None, None, None],
                 dhT=x["dhT"] * (np.arange(n) == n - 1)[:, None, None, None])
    want = _ours(alone, backend, 16)
    row = lambda a: a.reshape(1, n * L, *a.shape[2:])  # documents one after another
    packed = dict({m: row(x[m]) for m in ("q", "k", "v", "g", "beta", "do")}, h0=x["h0"][:1], dhT=x["dhT"][-1:])
    got = _ours(packed, backend, 16, seg=np.repeat([7, 3, 9], L)[None])
    got = dict({m: got[m].reshape(want[m].shape) for m in ("o", "dq", "dk", "dv", "dg", "dbeta")},
               hT=got["hT"], dh0=got["dh0"])
    _assert_close(got, dict(want, hT=want["hT"][-1:], dh0=want["dh0"][:1]), 2e-5)
    leaky = _ours(packed, backend, 16, seg=np.zeros((1, n * L), int))  # one segment: no resets
    assert np.abs(leaky["o"].reshape(want["o"].shape) - want["o"])[1:].max() > 1e-3


def test_decode_steps_equal_chunked():
    x = _inputs(2, 37, 2, 16, 24, seed=5)
    want = _ours(x, "chunked", 16, seg=SEGMENTS)
    step = jax.jit(kda.kda_step)
    state, outs = jnp.asarray(x["h0"], jnp.float32), []
    for t in range(37):
        reset = jnp.asarray(SEGMENTS[:, t] != SEGMENTS[:, max(t - 1, 0)])
        o_t, state = step(state, *(jnp.asarray(x[n][:, t], jnp.float32) for n in ("q", "k", "v", "g", "beta")),
                          reset=reset)
        outs.append(o_t)
    _assert_close({"o": np.stack(outs, 1), "hT": np.asarray(state)}, {"o": want["o"], "hT": want["hT"]}, 2e-6)


@pytest.mark.parametrize("gate", [(-5.0, -5.0), (-80.0, -20.0)])
def test_strong_gates_finite_and_exact(gate):
    """-5 on every token (the safe gate's bound; chunk sums -320), and an unbounded gate as the non-safe form can
    give: no overflow or NaN, the numbers of the per-token recurrence. dg is checked against the scale of the
    q.dq and k.dk terms it is the difference of (where every step decays by e^-20, dg itself is ~1e-9)."""
    x = _inputs(1, 128, 2, 16, 16, seed=6, gate=gate)
    got, want = _ours(x, "chunked", 64), _ours(x, "naive", 64)
    dg = got.pop("dg") - want.pop("dg")
    _assert_close(got, want, 2e-5)
    assert np.abs(dg).max() <= 2e-5 * np.abs(want["dk"]).max()


def test_bf16_inputs_close_to_fp32():
    """bf16 q, k, v (fp32 gate, beta, state): within bf16 rounding of the fp32 result."""
    x = _inputs(2, 37, 2, 16, 24, seed=7)
    _assert_close(_ours(x, "chunked", 16, jnp.bfloat16, seg=SEGMENTS), _ours(x, "naive", 16, seg=SEGMENTS), 2e-2)


def test_random_shapes_sweep():
    """Seeded shapes, chunk sizes, segments and gate ranges: chunked equals the recurrence."""
    r = np.random.default_rng(8)
    for trial in range(2):
        B, H = int(r.integers(1, 3)), int(r.integers(1, 3))
        T, K, V, C = int(r.integers(1, 80)), int(r.choice([8, 16, 32])), int(r.choice([8, 24])), int(r.choice([16, 32]))
        lo = float(r.uniform(-8, -0.1))
        x = _inputs(B, T, H, K, V, seed=100 + trial, gate=(lo, 0.0))
        seg = np.sort(r.integers(0, 3, (B, T)), axis=1)
        _assert_close(_ours(x, "chunked", C, seg=seg), _ours(x, "naive", C, seg=seg), 2e-5)


def test_auto_is_decided_per_lowering_platform():
    assert [kda.resolve_backend("auto", p) for p in ("cpu", "tpu", "cuda", "rocm")] == [
        "chunked", "pallas_tpu", "pallas_gpu", "chunked"]
    assert kda.resolve_backend("naive", "tpu") == "naive"
    with pytest.raises(ValueError, match="expected one of"):
        kda.resolve_backend("flash", "cpu")


def test_bad_input_errors():
    x = {n: jnp.asarray(a, jnp.float32) for n, a in _inputs(1, 8, 2, 16, 16).items()}
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    with pytest.raises(ValueError, match="g must be"):
        kda.kda(q, k, v, g[..., :1], beta)
    with pytest.raises(ValueError, match="beta must be"):
        kda.kda(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="segment_ids"):
        kda.kda(q, k, v, g, beta, segment_ids=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="initial_state"):
        kda.kda(q, k, v, g, beta, initial_state=x["h0"][..., :3])
    with pytest.raises(ValueError, match="chunk_size"):
        kda.kda(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="backend"):
        kda.kda(q, k, v, g, beta, backend="cuda")
    with pytest.raises(ValueError, match="expected q, k"):
        kda.kda(q, k[..., :8], v, g, beta)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: run under Bazel (devices = 4)")
def test_inside_shard_map_matches_unsharded():
    """Batch and heads sharded over a 2 x 2 mesh (vma check on, zero initial state as in training): the
    gradients of the unsharded call."""
    from jax.sharding import PartitionSpec as P

    a = {n: jnp.asarray(v, jnp.float32) for n, v in _inputs(2, 21, 2, 16, 16, seed=9).items()}
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    x_spec = P("data", None, "tensor", None)

    def loss(q, k, v, g, beta, sharded):
        f = lambda q, k, v, g, beta: kda.kda(q, k, v, g, beta, chunk_size=16)
        if sharded:
            f = jax.shard_map(f, mesh=mesh, in_specs=(x_spec,) * 4 + (P("data", None, "tensor"),), out_specs=x_spec)
        return jnp.sum(jnp.sin(f(q, k, v, g, beta)))

    args = [a[n] for n in ("q", "k", "v", "g", "beta")]
    grads = [jax.jit(jax.grad(loss, argnums=range(5)), static_argnums=5)(*args, s) for s in (False, True)]
    for x, y in zip(*grads):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
