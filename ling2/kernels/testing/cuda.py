"""Abstract arguments on a described H100 (`topology.devices("h100-1")`, no GPU attached) for the
*_cuda_compile_tests, and the custom-call names their compiled executables are searched for."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology

TRITON = '"__gpu$xla.gpu.triton"'  # a Pallas GPU (Triton) kernel call in compiled XLA:GPU HLO (jax 0.10)
CUDNN_ATTENTION = '"__cudnn$fmha'  # cuDNN fused attention, forward and backward


def h100_arg(shape, dtype):
    """A jax.ShapeDtypeStruct replicated on one described H100."""
    mesh = Mesh(np.array(topology.devices("h100-1")), ("d",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
