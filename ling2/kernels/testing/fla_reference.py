"""flash-linear-attention's naive torch ops (simple GLA, KDA), loaded without importing `fla`.

`import fla` pulls in triton; the naive files need only torch and einops, so they are loaded
straight from the installed package directory (fla-core on PyPI). Test-only.
"""

import functools
import importlib.util
import os
import re
import types

import numpy as np
import torch


@functools.cache
def load_naive(op="simple_gla", float64=False):
    """The module fla/ops/<op>/naive.py (e.g. naive_recurrent_simple_gla, naive_recurrent_kda).

    float64=True runs the same source with its fp32 casts (`torch.float`) made `torch.float64`, so
    the oracle computes in double precision; no other character of the file changes.
    """
    spec = importlib.util.find_spec("fla")  # finds the package without executing fla/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core (flash-linear-attention) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", op, "naive.py")
    name = f"fla_{op}_naive" + ("_f64" if float64 else "")
    if not float64:
        mod_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod
    with open(path) as f:
        src, n = re.subn(r"torch\.float\b", "torch.float64", f.read())
    if n == 0:
        raise ImportError(f"{path}: no torch.float cast to widen; the fp64 oracle would silently be fp32")
    mod = types.ModuleType(name)
    mod.__file__ = path
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def recurrent(q, k, v, g_BTH, h0=None, scale=None):
    """fla naive_recurrent_simple_gla on numpy arrays [B,T,H,D] -> (o [B,T,H,V], hT) as float64 numpy."""
    t = lambda x: None if x is None else torch.from_numpy(np.array(x, np.float32))
    o, hT = load_naive().naive_recurrent_simple_gla(t(q), t(k), t(v), t(g_BTH), scale=scale, initial_state=t(h0),
                                                    output_final_state=True)
    return o.double().numpy(), hT.double().numpy()


def chunk_op_runner(op, mode, x, **options):
    """A callable run(n=1) that runs fla's Triton `chunk_simple_gla` (op "gla") or `chunk_kda` ("kda") n times
    back to back on CUDA and synchronises once, for benchmarks. x: numpy arrays q, k, v [B,T,H,D], g ([B,T,H] for GLA, [B,T,H,K]
    for KDA) and KDA's beta [B,T,H]; they go to the GPU as fla's layers pass them: gates fp32, the rest bf16.
    mode "fwd" runs under no_grad; "fwd+bwd" also back-propagates sum(o) to every input fla differentiates
    (GLA: q, k, v; KDA: q, k, v, g, beta). options: extra keyword arguments of the op.

    Raises ImportError when fla's Triton ops or a CUDA torch are unavailable.
    """
    if op == "gla":
        from fla.ops.simple_gla import chunk_simple_gla as fla_op  # imports triton
        grads = ("q", "k", "v")
    else:
        from fla.ops.kda import chunk_kda as fla_op
        grads = ("q", "k", "v", "g", "beta")
    if not torch.cuda.is_available():
        raise ImportError("torch has no CUDA device")
    t = {n: torch.tensor(np.asarray(a), device="cuda", dtype=torch.float32 if n == "g" else torch.bfloat16,
                         requires_grad=mode != "fwd" and n in grads) for n, a in x.items()}

    def run(n=1):
        for _ in range(n):
            if mode == "fwd":
                with torch.no_grad():
                    fla_op(**t, **options)
            else:
                o, _ = fla_op(**t, **options)
                o.float().sum().backward()
                for name in grads:
                    t[name].grad = None
        torch.cuda.synchronize()

    return run


KDA_GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def kda(q, k, v, g, beta, h0=None, scale=None, *, do=None, dhT=None, chunk_size=None, float64=True):
    """fla's naive KDA on numpy arrays (q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H], h0 [B,H,K,V]).

    `naive_recurrent_kda`, or `naive_chunk_kda` when chunk_size is given (T must be a multiple).
    With cotangents do [B,T,H,V] and dhT [B,H,K,V], also the gradients of <o, do> + <hT, dhT>
    (torch autograd) wrt q, k, v, g, beta, h0. Returns a dict of float64 numpy arrays: o, hT, and
    dq ... dh0 when asked.
    """
    mod = load_naive("kda", float64)
    dt = torch.float64 if float64 else torch.float32
    want_grad = do is not None
    h0 = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3])) if h0 is None else h0
    ins = [torch.tensor(np.asarray(x, np.float64), dtype=dt, requires_grad=want_grad) for x in (q, k, v, g, beta, h0)]
    if chunk_size is None:
        o, hT = mod.naive_recurrent_kda(*ins[:5], scale=scale, initial_state=ins[5], output_final_state=True)
    else:
        o, hT = mod.naive_chunk_kda(*ins[:5], scale=scale, initial_state=ins[5], output_final_state=True,
                                    chunk_size=chunk_size)
    out = {"o": o.detach().double().numpy(), "hT": hT.detach().double().numpy()}
    if want_grad:
        ct = lambda x: torch.tensor(np.asarray(x, np.float64), dtype=dt)
        ((o * ct(do)).sum() + (hT * ct(dhT)).sum()).backward()
        out.update({name: x.grad.double().numpy() for name, x in zip(KDA_GRAD_NAMES, ins)})
    return out
