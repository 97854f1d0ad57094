"""Sample-index sets on disk, in the layout of Megatron's index cache: `{base}-{name}.npy` per array
and `{base}-description.txt`, the JSON request they were built for.

The sets we write also record the size and CRC-32 of each `.npy` in the description (`files`),
which is written last: a set is complete only once its description exists. Loading checks them
(reading every byte once), since a truncated or changed index would otherwise fail deep in numpy,
naming no file, or feed wrong samples. Indices are derived data, so a damaged set in our cache
(`blend_cache_dir`) is removed and rebuilt after one warning line; a prebuilt set (`blend_index_dir`,
Megatron's or ours) is not ours to rebuild and is a DataError naming the file. Megatron's
descriptions record no checksums: its files are only checked to load whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Optional, Sequence

import numpy as np

from ling2.config.files import crc32
from ling2.config.paths import write_failure
from ling2.data.errors import DataError

FILES = "files"  # the description's {name: {"bytes": size, "crc32": crc}} of the set's .npy files

log = logging.getLogger(__name__)


def description_path(base: str) -> str:
    return f"{base}-description.txt"


def npy_path(base: str, name: str) -> str:
    return f"{base}-{name}.npy"


def save(base: str, arrays: dict, description: str) -> None:
    """Writes `{base}-{name}.npy` for each of `arrays`, then the description with their sizes and CRC-32s. A write
    that fails (a full disk) is a DataError naming the file; its temporary file is removed."""
    files = {}
    for name, arr in arrays.items():
        path = npy_path(base, name)
        tmp = f"{path}.tmp{os.getpid()}.npy"
        with _written(tmp, path):
            np.save(tmp, arr, allow_pickle=False)
            files[name] = {"bytes": os.path.getsize(tmp), "crc32": crc32(tmp)}
            os.replace(tmp, path)
    tmp = f"{description_path(base)}.tmp{os.getpid()}"
    with _written(tmp, description_path(base)):
        with open(tmp, "w") as f:
            f.write(json.dumps({**json.loads(description), FILES: files}, indent=4))
        os.replace(tmp, description_path(base))


@contextlib.contextmanager
def _written(tmp: str, path: str):
    try:
        yield
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise DataError(f"{path}: writing the index cache (blend_cache_dir) failed: {write_failure(e)}") from None


def _records(desc, names: Sequence[str]) -> Optional[dict]:
    """{name: (bytes, crc32)} from a description, or None when it records none (Megatron's) or not all."""
    try:
        files = desc[FILES]
        return {k: (int(files[k]["bytes"]), int(files[k]["crc32"])) for k in names}
    except (KeyError, TypeError, ValueError):
        return None


def _verified(base: str, names: Sequence[str], need_records: bool):
    """(arrays, None) for a whole set, or (None, why not, naming the file)."""
    dpath = description_path(base)
    try:
        with open(dpath) as f:
            desc = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"{dpath}: unreadable ({e})"
    records = _records(desc, names)
    if records is None and need_records:
        return None, f"{dpath}: no size and checksum recorded for {', '.join(n + '.npy' for n in names)}"
    for name in names:
        path = npy_path(base, name)
        if not os.path.isfile(path):
            return None, f"{path}: missing"
        if records is not None and os.path.getsize(path) != records[name][0]:
            return None, f"{path}: {os.path.getsize(path)} bytes, {records[name][0]} when written (truncated?)"
    if records is not None:
        for name in names:
            if crc32(npy_path(base, name)) != records[name][1]:
                return None, f"{npy_path(base, name)}: checksum mismatch (its bytes changed after it was written)"
    arrays = []
    for name in names:
        path = npy_path(base, name)
        try:
            arrays.append(np.load(path, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as e:
            return None, f"{path}: not a whole .npy file of {os.path.getsize(path)} bytes ({e})"
    return arrays, None


def ours(base: str) -> bool:
    """Whether a set's description carries our size and checksum records (we wrote it)."""
    try:
        with open(description_path(base)) as f:
            return isinstance(json.load(f).get(FILES), dict)
    except (OSError, ValueError, AttributeError):
        return False


def load(base: str, names: Sequence[str], rebuild: bool) -> Optional[list]:
    """The arrays of set `base` (memory-mapped), verified; None when it has to be built.

    rebuild: the set is in our cache. Then a set without a description (never finished) is None
    quietly, and a damaged one (no records, a file missing, short, changed or unreadable) is None
    after one warning line naming it, its files removed. Otherwise (prebuilt) damage is a DataError.
    """
    if rebuild and not os.path.isfile(description_path(base)):
        return None
    arrays, why = _verified(base, names, need_records=rebuild)
    if why is None:
        return arrays
    if not rebuild:
        raise DataError(f"{why}: the prebuilt indices {base}-* in blend_index_dir are damaged; rebuild them "
                        "there, or set blend_index_dir to '' to build them")
    log.warning("%s: rebuilding the damaged cached indices %s-*", why, base)
    for path in [description_path(base)] + [npy_path(base, n) for n in names]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    return None
