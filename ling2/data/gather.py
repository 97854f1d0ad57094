"""The native sample gather (gather.c), loaded with ctypes.

Reading a GPT sample copies ~5 pieces of ~3 KB from random places in the `.bin`; done from
Python, the per-piece arithmetic and call overhead cost as much as the copy itself. The C
kernel walks the indices, checks every piece and copies a whole batch in one call, without the
GIL. Bazel builds `libling2_gather.so` (see ling2/native.py for where it is looked up); without
it `native()` is None and callers use numpy.
"""

import ctypes
import functools
from typing import Optional

import numpy as np

from ling2 import native as _native

LIB = "libling2_gather.so"


def _declare(lib: ctypes.CDLL) -> None:
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.ling2_gather_samples.argtypes = [p, i64, i64, p, p, i64, p, i32, i64, p, i32, i64, i64,
                                         p, i64, i64, i64, p, p, i32, i64]
    lib.ling2_gather_samples.restype = i64


@functools.cache
def native() -> Optional[ctypes.CDLL]:
    """The loaded library, or None (warns once) when it was not built."""
    return _native.load(__file__, LIB, _declare)


def _int_array(a: np.ndarray) -> Optional[np.ndarray]:
    """`a` if the kernel can read it in place (C-contiguous little-endian int32/int64)."""
    ok = (a.dtype in (np.dtype("<i4"), np.dtype("<i8")) and a.flags.c_contiguous)
    return a if ok else None


def gather_samples(bin_u8: np.ndarray, dtype_code: int, item: int, seq_ptr: np.ndarray,
                   seq_len: np.ndarray, doc: np.ndarray, smp: np.ndarray, n_full: int,
                   js: np.ndarray, add: int, want: int, out: Optional[np.ndarray],
                   totals: np.ndarray, vocab_size: Optional[int] = None) -> Optional[int]:
    """Fills out[r, :totals[r]] with sample js[r]'s tokens (out: [len(js), want], the `.bin`'s
    dtype, Megatron's `dtype_code`; None: only check). Samples before `n_full` must be full.
    Returns 0; r + 1 when the sample of row r does not fit the data; -(r + 1) when row r holds
    an id outside [0, vocab_size) (checked only with a vocab_size); or None when the kernel
    cannot run here (no library, or index arrays in another layout). See gather.c."""
    lib = native()
    doc, smp = _int_array(doc), _int_array(smp)
    if lib is None or doc is None or smp is None or smp.ndim != 2 or smp.shape[1] != 2:
        return None
    js = np.ascontiguousarray(js, dtype=np.int64)
    return int(lib.ling2_gather_samples(
        bin_u8.ctypes.data, bin_u8.nbytes, item, seq_ptr.ctypes.data, seq_len.ctypes.data,
        seq_len.shape[0], doc.ctypes.data, doc.itemsize == 8, doc.shape[0], smp.ctypes.data,
        smp.itemsize == 8, smp.shape[0] - 1, n_full, js.ctypes.data, js.shape[0], add, want,
        None if out is None else out.ctypes.data, totals.ctypes.data, dtype_code,
        vocab_size or 0))
