"""Abstract arguments on a described H100 (`topology.devices("h100-1")`, no GPU attached) for the
*_cuda_compile_tests, the custom-call names their compiled executables are searched for, and XLA's dump of a
compile (its optimized HLO and each Triton kernel's PTX)."""

import os
import re
import subprocess
import sys
from pathlib import Path

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


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r" dot\(%([\w.\-]+), %([\w.\-]+)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def dot_operand_types(hlo_text: str) -> list[tuple[str, str, str]]:
    """(lhs element type, rhs element type, op_name) of every dot in an optimized HLO module, fusion bodies
    included: what XLA:GPU hands its GEMM emitters (an FP8 GEMM takes f8e4m3fn / f8e5m2 operands)."""
    types, dots = {}, []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            types[m.group(1)] = m.group(2)
        d = _DOT.search(line)
        if d:
            name = _OP_NAME.search(line)
            dots.append((d.group(1), d.group(2), name.group(1) if name else ""))
    return [(types.get(a, "?"), types.get(b, "?"), n) for a, b, n in dots]


def xla_dump(script: str, out: Path) -> Path:
    """Runs `script`, a program that compiles for a described GPU, in a process of its own (XLA reads XLA_FLAGS
    once per process) with XLA's dump in `out`; returns `out`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={out}",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=900)
    return out


def kernel_ptx(dump: Path) -> dict:
    """{kernel entry name: its PTX} of every Triton kernel in an XLA dump."""
    out = {}
    for path in Path(dump).glob("*.ptx"):
        text = path.read_text()
        for name in re.findall(r"\.entry (\w+)", text):
            out[name] = text
    return out
