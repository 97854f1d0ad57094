"""flash-linear-attention's naive torch ops for simple GLA, loaded without importing `fla`.

`import fla` pulls in triton; the naive file needs only torch and einops, so it is loaded
straight from the installed package directory (fla-core on PyPI). Test-only.
"""

import importlib.util
import os

import numpy as np
import torch


def load_naive():
    """The module fla/ops/simple_gla/naive.py (naive_recurrent_simple_gla, naive_chunk_simple_gla, ...)."""
    spec = importlib.util.find_spec("fla")  # finds the package without executing fla/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core (flash-linear-attention) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "simple_gla", "naive.py")
    mod_spec = importlib.util.spec_from_file_location("fla_simple_gla_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def recurrent(q, k, v, g_BTH, h0=None, scale=None):
    """fla naive_recurrent_simple_gla on numpy arrays [B,T,H,D] -> (o [B,T,H,V], hT) as float64 numpy."""
    t = lambda x: None if x is None else torch.from_numpy(np.array(x, np.float32))
    o, hT = load_naive().naive_recurrent_simple_gla(t(q), t(k), t(v), t(g_BTH), scale=scale, initial_state=t(h0),
                                                    output_final_state=True)
    return o.double().numpy(), hT.double().numpy()


def chunk_simple_gla_cuda_seconds(q, k, v, g_BTH, repeats=3):
    """Median seconds of fla's Triton chunk_simple_gla forward+backward on CUDA (bf16), for benchmarks.

    Raises ImportError when fla's Triton ops or a CUDA torch are unavailable.
    """
    import time

    from fla.ops.simple_gla import chunk_simple_gla  # imports triton

    if not torch.cuda.is_available():
        raise ImportError("torch has no CUDA device")
    t = lambda x, grad: torch.tensor(np.array(x, np.float32), device="cuda",
                                     dtype=torch.bfloat16 if grad else torch.float32, requires_grad=grad)
    tq, tk, tv, tg = t(q, True), t(k, True), t(v, True), t(g_BTH, False)

    def step():
        o, _ = chunk_simple_gla(tq, tk, tv, g=tg)
        o.float().sum().backward()

    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
