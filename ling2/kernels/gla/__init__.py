"""Simple gated linear attention (Lightning Attention-2 style; fla `chunk_simple_gla`): the op and its decode
step (`op`), the oracles (`reference`), the pure-JAX chunked form (`chunked`) and the Pallas kernels
(`pallas_tpu`, `pallas_gpu`)."""

from ling2.kernels.gla.cp import simple_gla_cp
from ling2.kernels.gla.op import BACKENDS, resolve_backend, segment_end_states, simple_gla, simple_gla_step

__all__ = ["BACKENDS", "resolve_backend", "segment_end_states", "simple_gla", "simple_gla_cp", "simple_gla_step"]
