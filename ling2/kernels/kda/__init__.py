"""Kimi Delta Attention (fla `chunk_kda`): the op and its decode step (`op`), the oracle (`reference`), the
per-chunk math every chunked backend shares (`chunk_math`), the pure-JAX chunked form (`chunked`) and the
Pallas kernels (`pallas_tpu`, `pallas_gpu`)."""

from ling2.kernels.kda.cp import kda_cp
from ling2.kernels.kda.op import BACKENDS, kda, kda_step, prepare_beta, prepare_docs, resolve_backend

__all__ = ["BACKENDS", "kda", "kda_cp", "kda_step", "prepare_beta", "prepare_docs", "resolve_backend"]
