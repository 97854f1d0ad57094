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
    t = lambda x: None if x is None else torch.from_numpy(np.asarray(x, np.float32))
    o, hT = load_naive().naive_recurrent_simple_gla(t(q), t(k), t(v), t(g_BTH), scale=scale, initial_state=t(h0),
                                                    output_final_state=True)
    return o.double().numpy(), hT.double().numpy()
