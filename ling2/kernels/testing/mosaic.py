"""Which Pallas TPU (Mosaic) kernels a compiled TPU executable calls, by the names Ling2 gives them."""

import base64
import re


def mosaic_kernels(hlo_text: str, prefix: str = "ling2_", only_ours: bool = True) -> list[str]:
    """Sorted names (starting with `prefix`) of the Mosaic kernels called by a compiled TPU executable's
    HLO text, one entry per call: each `tpu_custom_call` carries its kernel as MLIR bytecode, named.
    only_ours: every call is one of Ling2's kernels (bytecode); else other kernels (JAX's splash
    attention, megablox) may be serialized otherwise and are passed over."""
    names = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            body = base64.b64decode(re.search(r'"body":"([A-Za-z0-9+/=]+)"', line).group(1))
            if not body.startswith(b"ML\xefR"):
                assert not only_ours, "not MLIR bytecode"
                continue
            names += sorted({m.decode() for m in re.findall(re.escape(prefix).encode() + rb"[a-z]+", body)})
    return sorted(names)
