"""Sharded safetensors, read and written one tensor at a time with numpy.

File format (safetensors spec): an 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}} padded with
spaces to 8 bytes, then the raw little-endian bytes (offsets are relative to the data
start). A sharded checkpoint adds `model.safetensors.index.json`:
{"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}. Reading a tensor
(or one leading-index block of it) seeks to its bytes only, so memory stays at one tensor;
`PlannedWriter` lays out every header first and writes each tensor (or block) straight to
its offset, so writing buffers nothing either; bf16 uses ml_dtypes.
"""

import json
import mmap
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
CHUNK = 4 << 20  # bytes PlannedWriter copies at a time through its buffer


class SafetensorsError(ValueError):
    """A malformed safetensors file or index; the message names the file."""


def read_header(path: Path) -> tuple[dict, int]:
    """({name: {dtype, shape, data_offsets}}, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: malformed safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class ShardedReader:
    """Every tensor of a HF checkpoint directory: `names()`, `shape(name)`, `read(name)`."""

    def __init__(self, directory):
        self.dir = Path(directory)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SafetensorsError(f"{index}: malformed index ({e!r})") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_NAME).is_file():
            files, weight_map = [SINGLE_NAME], None
        else:
            raise SafetensorsError(f"{self.dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        self.entries, self.files = {}, {}  # name -> (file, dtype, shape, begin, end); path -> open file
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise SafetensorsError(f"{index}: names shard {file}, which does not exist")
            header, start = read_header(path)
            for name, h in header.items():
                if h["dtype"] not in DTYPES:
                    raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {h['dtype']}")
                b, e = h["data_offsets"]
                self.entries[name] = (path, DTYPES[h["dtype"]], tuple(h["shape"]), start + b, start + e)
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.entries or self.entries[name][0].name != file:
                    raise SafetensorsError(f"{index}: {name} is mapped to {file} but is not in that file")

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def read(self, name: str, index: tuple = (), copy: bool = True) -> np.ndarray:
        """The tensor, or its block `tensor[index]` for leading indices `index` (read alone).

        copy=False returns a read-only view of the file (mmap): no bytes copied, pages are
        read as they are touched and leave memory with the view.
        """
        path, dtype, shape, b, e = self.entries[name]
        if (e - b) != int(np.prod(shape)) * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name} bytes [{b}, {e}) do not hold {shape} {dtype}")
        block = shape[len(index):]
        n = int(np.prod(block)) * dtype.itemsize
        if index:
            b += int(np.ravel_multi_index(index, shape[:len(index)])) * n
        if path not in self.files:  # one open file per shard (an open per tensor costs ~0.1 ms)
            self.files[path] = open(path, "rb")
        f = self.files[path]
        size = os.fstat(f.fileno()).st_size
        if b + n > size:
            raise SafetensorsError(f"{path}: tensor {name} is cut short at byte {size}")
        if n == 0:
            return np.empty(block, dtype)
        start = b - b % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(f.fileno(), b + n - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ, offset=start)  # populate: one fault per tensor, not per page
        view = np.frombuffer(mm, dtype=dtype, count=n // dtype.itemsize, offset=b - start).reshape(block)
        return np.array(view) if copy else view


def write_file(path: Path, tensors: dict) -> int:
    """Writes {name: array} as one safetensors file; returns the tensor bytes written."""
    header, offset = {}, 0
    for name, a in tensors.items():
        a = np.asarray(a)
        if a.dtype not in CODES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {a.dtype}")
        header[name] = {"dtype": CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
    return offset


class ShardedWriter:
    """Adds tensors one by one; starts a new shard past `shard_bytes`; `close()` writes the index."""

    def __init__(self, directory, shard_bytes: int = 2 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.pending, self.pending_bytes, self.shards, self.total = {}, 0, [], 0

    def add(self, name: str, a: np.ndarray) -> None:
        if self.pending and self.pending_bytes + a.nbytes > self.shard_bytes:
            self._flush()
        self.pending[name] = a
        self.pending_bytes += a.nbytes

    def _flush(self) -> None:
        tmp = self.dir / f"shard-{len(self.shards):05d}.tmp"
        self.total += write_file(tmp, self.pending)
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict:
        """Renames shards to model-0000i-of-0000n.safetensors and writes the index; returns it."""
        if self.pending or not self.shards:
            self._flush()
        n, weight_map = len(self.shards), {}
        for i, (tmp, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return index


class PlannedWriter:
    """Sharded safetensors whose tensors (name, shape, dtype) are all known before any is written.

    The constructor splits `specs` into shards of at most `shard_bytes` (a larger tensor gets
    its own), writes every header and sizes every file; `add(name, a, index)` then writes `a`
    as `tensor[index]` (leading indices, so a contiguous block) at its offset, in any order.
    A block that is not C-contiguous in the planned dtype (a transposed view, a cast) is
    copied through one reusable buffer of about CHUNK bytes, a few rows at a time, so
    memory stays at that buffer. `close()` checks every byte was written and
    writes the index json.
    """

    def __init__(self, directory, specs, shard_bytes: int = 2 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        groups, size = [[]], 0
        for name, shape, dtype in specs:
            dtype = np.dtype(dtype)
            if dtype not in CODES:
                raise SafetensorsError(f"{self.dir}: tensor {name} has unsupported dtype {dtype}")
            nbytes = int(np.prod(shape)) * dtype.itemsize
            if groups[-1] and size + nbytes > shard_bytes:
                groups, size = groups + [[]], 0
            groups[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self.where, self.files, self.weight_map = {}, [], {}
        self.total, self.written, self.buf = 0, 0, np.empty(CHUNK, np.uint8)
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            header, offset = {}, 0
            for name, shape, dtype, nbytes in group:
                header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            f = open(self.dir / file, "wb")
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
            self.files.append(f)
            for name, shape, dtype, _ in group:
                self.where[name] = (f, shape, dtype, 8 + len(raw) + header[name]["data_offsets"][0])
                self.weight_map[name] = file
            self.total += offset

    def add(self, name: str, a: np.ndarray, index: tuple = ()) -> None:
        """Writes `a` (any strides; cast to the planned dtype) as tensor[index]."""
        if name not in self.where:
            raise SafetensorsError(f"{self.dir}: tensor {name} was not planned")
        f, shape, dtype, offset = self.where[name]
        a = np.asarray(a)
        block = shape[len(index):]
        if a.shape != block or not np.can_cast(a.dtype, dtype, "same_kind"):
            raise SafetensorsError(f"{self.dir}: tensor {name}{list(index)} is {a.shape} {a.dtype}, "
                                   f"planned {block} {dtype}")
        nbytes = int(np.prod(block)) * dtype.itemsize
        if index:
            offset += int(np.ravel_multi_index(index, shape[:len(index)])) * nbytes
        f.seek(offset)
        if a.dtype == dtype and a.flags.c_contiguous:
            f.write(a.reshape(-1).view(np.uint8))
        else:
            rows = max(1, CHUNK // max(1, a[0].nbytes))
            for i in range(0, len(a), rows):
                part = a[i:i + rows]
                size = part.size * dtype.itemsize
                if self.buf.nbytes < size:
                    self.buf = np.empty(size, np.uint8)
                np.copyto(self.buf[:size].view(dtype).reshape(part.shape), part, casting="same_kind")
                f.write(self.buf[:size])
        self.written += nbytes

    def close(self) -> dict:
        """Closes the shards and writes the index; returns it."""
        if self.written != self.total:  # the files stay open: the missing blocks may still be added
            raise SafetensorsError(f"{self.dir}: {self.written} of {self.total} planned bytes written")
        for f in self.files:
            f.close()
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return index
