"""XLA's FLOP count of a compiled function, for comparing the cost of two ways to compute the same thing."""

from unittest import mock

import jax

_scan = jax.lax.scan


def _unrolled_scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    return _scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)


def compiled_flops(f, *args) -> float:
    """`cost_analysis()['flops']` of `jax.jit(f)` compiled for `args` (arrays or ShapeDtypeStructs), traced with
    every `jax.lax.scan` unrolled: the analysis counts a while loop's body once whatever its trip count, so a
    scan over N chunks would count as one chunk. Under `shard_map` on a mesh the count is one device's."""
    with mock.patch.object(jax.lax, "scan", _unrolled_scan):
        return float(jax.jit(f).lower(*args).compile().cost_analysis()["flops"])
