"""Loads one of Ling2's small native kernels (a C file built as a shared library) with ctypes.

Bazel builds `lib<name>.so` into the runfiles next to the Python module that uses it; outside
Bazel it is taken from `bazel-bin/` when built. Without it, callers take their numpy path,
after one warning naming the target to build.
"""

import ctypes
import os
import warnings
from typing import Callable, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(module_file: str, lib: str, declare: Callable[[ctypes.CDLL], None]) -> Optional[ctypes.CDLL]:
    """The library `lib` of the package holding `module_file`, with `declare(lib)` setting
    its functions' argtypes, or None (with a warning) when it was not built."""
    here = os.path.dirname(os.path.abspath(module_file))
    pkg = os.path.relpath(here, _ROOT)
    for path in (os.path.join(here, lib), os.path.join(_ROOT, "bazel-bin", pkg, lib)):
        if os.path.isfile(path):
            cdll = ctypes.CDLL(path)
            declare(cdll)
            return cdll
    warnings.warn(f"{pkg}: {lib} not found (build it with `bazel build //{pkg}:{lib}`); "
                  f"using the slower numpy path")
    return None
