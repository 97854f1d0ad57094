"""Sharded safetensors, read and written one tensor at a time with numpy.

File format (safetensors spec): an 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}} padded with
spaces to 8 bytes, then the raw little-endian bytes (offsets are relative to the data
start). A sharded checkpoint adds `model.safetensors.index.json`:
{"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}. Reading a tensor
(or one leading-index block of it) returns a view of its bytes in a mapping of the whole
shard; pages read are dropped from the process every RELEASE bytes, so memory stays at about
one tensor. `PlannedWriter` lays out every header first and writes each tensor (or block)
straight to its offset on worker threads, so writing buffers little either: with the native
kernel (safetensors.c, one ctypes call per run of blocks: SIMD transposes into an L2-sized buffer,
pread of mapped sources, pwrite, all without the GIL) when it is built, else with numpy
(transposing through a small buffer) and os.pwrite; both write the same bytes. bf16 uses
ml_dtypes.
"""

import collections
import ctypes
import functools
import json
import math
import mmap
import os
import struct
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from ling2 import native as _native

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),  # FP8 releases
}
CODES = {v: k for k, v in DTYPES.items()}
CHUNK = 4 << 20  # bytes PlannedWriter copies at a time through its buffer
WINDOW = 4 << 20  # ShardedReader maps the pages of a shard's WINDOW-aligned windows as tensors in them are read
RELEASE = 16 << 20  # bytes of windows mapped before ShardedReader unmaps them all (they stay in the page cache)
NATIVE_CHUNK = 1 << 20  # bytes the native kernel stages before each pwrite (in L2)
SOURCE_CHUNK = 4 << 20  # a mapped block up to this size is read by the native kernel with pread, not through its pages
THREADS = 2  # PlannedWriter's writer threads
SPLIT = 8 << 20  # a transposed block this large is split between the native writer's threads
RUN = 1 << 20  # PlannedWriter gathers smaller blocks bound for consecutive offsets into one write of up to this
MADV_POPULATE_READ = 22  # Linux >= 5.14; not in python's mmap module
SCAN_CHUNK = 1 << 20  # bytes ShardedReader.nonfinite reads at a time (in L2)
TILE = 16  # the native kernel's staging buffer holds at least TILE output rows of a transposed block
LIB = "libling2_safetensors.so"
_MAPPINGS = weakref.WeakKeyDictionary()  # ShardedReader's shard mappings (shared, read-only) -> (address, fd)


def _source(a: np.ndarray):
    """(fd, file offset) of `a`'s first byte when `a` is a view of a ShardedReader's mapping, else None."""
    b = a.base
    while isinstance(b, (np.ndarray, memoryview)):
        b = b.base if isinstance(b, np.ndarray) else b.obj
    if not isinstance(b, mmap.mmap) or b not in _MAPPINGS:
        return None
    address, fd = _MAPPINGS[b]
    return fd, a.ctypes.data - address


def _declare(lib: ctypes.CDLL) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.ling2_write_blocks.argtypes = [ctypes.c_int, i64, p, i64, p, i64, p, i64]
    lib.ling2_write_blocks.restype = i64
    lib.ling2_drop_pages.argtypes = [p, i64]
    lib.ling2_drop_pages.restype = None
    lib.ling2_count_beyond.argtypes = [ctypes.c_int, i64, i64, i64, ctypes.c_uint64, p, i64, p]
    lib.ling2_count_beyond.restype = i64


@functools.cache
def native():
    """The native block writer (safetensors.c), or None (warns once) when it was not built: then
    PlannedWriter transposes and writes with numpy (the same bytes, slower)."""
    return _native.load(__file__, LIB, _declare)


class SafetensorsError(ValueError):
    """A malformed safetensors file or index; the message names the file."""


def read_header(path: Path) -> tuple[dict, int]:
    """({name: {dtype, shape, data_offsets}}, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > os.fstat(f.fileno()).st_size - 8:
            raise SafetensorsError(f"{path}: malformed safetensors header: {n} header bytes in a shorter file")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: malformed safetensors header: {e}") from None
        except _DuplicateKey as e:
            raise SafetensorsError(f"{path}: malformed safetensors header: {e} appears twice") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: malformed safetensors header: not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SafetensorsError(f"{path}: malformed safetensors header: __metadata__ must map strings to strings, "
                               f"got {json.dumps(meta)[:80]}")
    return header, 8 + n


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs):
    """json object hook: the object, refusing a key given twice (json keeps the last silently: a header naming a
    tensor twice has two places for its bytes)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"key {k!r}")
        out[k] = v
    return out


class ShardedReader:
    """Every tensor of a HF checkpoint directory: `names()`, `shape(name)`, `read(name)`.

    `map_pages = False` leaves the mapping and dropping of a view's pages to its consumer
    (PlannedWriter's native kernel does it per block, on its threads).
    """

    def __init__(self, directory):
        self.dir, self.map_pages = Path(directory), True
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(map(str, weight_map.values())))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise SafetensorsError(f"{index}: malformed index ({e!r})") from None
        elif (self.dir / SINGLE_NAME).is_file():
            files, weight_map = [SINGLE_NAME], None
        else:
            raise SafetensorsError(f"{self.dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        self.entries, self.maps, self.mapped = {}, {}, set()  # name -> (file, dtype, shape, begin, end); path -> mmap
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise SafetensorsError(f"{index}: names shard {file}, which does not exist")
            header, start = read_header(path)
            size = path.stat().st_size
            for name, h in header.items():
                try:
                    dtype, shape, (b, e) = h["dtype"], tuple(int(d) for d in h["shape"]), h["data_offsets"]
                    b, e = int(b), int(e)
                except (KeyError, TypeError, ValueError) as err:
                    raise SafetensorsError(f"{path}: tensor {name} has a malformed header entry ({err!r})") from None
                if dtype not in DTYPES:
                    raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {dtype}")
                if e - b != math.prod(shape) * DTYPES[dtype].itemsize or b < 0:
                    raise SafetensorsError(f"{path}: tensor {name} bytes [{b}, {e}) do not hold {shape} {dtype}")
                if start + e > size:
                    raise SafetensorsError(f"{path}: tensor {name} is cut short: it ends at byte {start + e}, the "
                                           f"file has {size} (truncated?)")
                self.entries[name] = (path, DTYPES[dtype], shape, start + b, start + e)
            spans = sorted((b, e, n) for n, (p, _, _, b, e) in self.entries.items() if p == path and e > b)
            for (_, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
                if b1 < e0:  # two tensors reading the same bytes: one of them holds the other's values
                    raise SafetensorsError(f"{path}: tensors {n0} and {n1} overlap: bytes [{b1 - start}, "
                                           f"{min(e0, e1) - start}) of the data belong to both")
            at = start  # the format's data section is the tensors' bytes end to end, with no hole and no tail
            for b, e, n in spans:
                if b > at:
                    raise SafetensorsError(f"{path}: bytes [{at - start}, {b - start}) of the data belong to no "
                                           f"tensor (the next is {n}); a safetensors file has no gaps")
                at = e
            if at != size:
                raise SafetensorsError(f"{path}: {size - at} bytes after the last tensor's end (data byte "
                                       f"{at - start}) belong to no tensor; a safetensors file ends with its data")
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.entries or self.entries[name][0].name != file:
                    raise SafetensorsError(f"{index}: {name} is mapped to {file} but is not in that file")

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][1]

    def path(self, name: str) -> Path:
        """The shard file holding tensor `name`."""
        return self.entries[name][0]

    def read(self, name: str, index: tuple = (), copy: bool = True) -> np.ndarray:
        """The tensor, or its block `tensor[index]` for leading indices `index` (read alone).

        copy=False returns a read-only view of the file (mmap): no bytes copied; the pages of its
        WINDOWs are mapped now, and unmapped again once RELEASE bytes of windows are mapped
        (with `map_pages` False: neither, the consumer maps and drops them).
        """
        path, dtype, shape, b, e = self.entries[name]
        if (e - b) != math.prod(shape) * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name} bytes [{b}, {e}) do not hold {shape} {dtype}")
        block = shape[len(index):]
        n = math.prod(block) * dtype.itemsize
        if index:
            b += int(np.ravel_multi_index(index, shape[:len(index)])) * n
        mm, size = self._map(path)
        if b + n > size:
            raise SafetensorsError(f"{path}: tensor {name} is cut short at byte {size}")
        if n == 0:
            return np.empty(block, dtype)
        if not self.map_pages and not copy:
            return np.frombuffer(mm, dtype=dtype, count=n // dtype.itemsize, offset=b).reshape(block)
        mine = {(path, w) for w in range(b // WINDOW, (b + n - 1) // WINDOW + 1)}
        windows = mine - self.mapped
        if windows and self.mapped and len(self.mapped | windows) * WINDOW > RELEASE:
            for m, _ in self.maps.values():  # unmap the pages read so far; views still in use fault them back in
                if m is not None:
                    m.madvise(mmap.MADV_DONTNEED)
            windows, self.mapped = mine, set()
        if windows:  # one call maps the missing windows' pages: ~3x faster than faulting them in
            self.mapped |= windows
            lo, hi = min(w for _, w in windows) * WINDOW, min(size, (max(w for _, w in windows) + 1) * WINDOW)
            try:
                mm.madvise(MADV_POPULATE_READ, lo, hi - lo)
            except OSError:  # an older kernel: the pages fault in as they are read
                pass
        view = np.frombuffer(mm, dtype=dtype, count=n // dtype.itemsize, offset=b).reshape(block)
        return np.array(view) if copy else view

    def nonfinite(self, name: str, cast=None) -> tuple[int, tuple, float] | None:
        """None when every value of the tensor is finite, also once cast to dtype `cast` (default: its own),
        else (how many are not, the first one's index, its value).

        Exact, on the bits (see `overflow_limit`), SCAN_CHUNK bytes at a time read with pread (the native
        kernel, else numpy): no page of the mapping is touched.
        """
        path, dtype, shape, b, e = self.entries[name]
        if not is_float(dtype) or e == b:
            return None
        limit = overflow_limit(dtype, dtype if cast is None else cast)
        fd, es, n = self._fd(path), dtype.itemsize, (e - b) // dtype.itemsize
        lib, step = native(), max(1, SCAN_CHUNK // es)
        if lib is not None:
            buf, first = np.empty(step * es, np.uint8), ctypes.c_int64(-1)
            count = lib.ling2_count_beyond(fd, b, n, es, limit, buf.ctypes.data, buf.nbytes, ctypes.byref(first))
            if count < 0:
                raise OSError(-count, f"{path}: reading tensor {name}: {os.strerror(-count)}")
            first = first.value
        else:
            count, first = 0, -1
            for i in range(0, n, step):
                m = min(step, n - i)
                raw = os.pread(fd, m * es, b + i * es)
                if len(raw) != m * es:
                    raise SafetensorsError(f"{path}: tensor {name} is cut short at byte {b + i * es + len(raw)}")
                c, j = count_beyond(np.frombuffer(raw, dtype), limit)
                count, first = count + c, first if first >= 0 or j < 0 else i + j
        if count == 0:
            return None
        value = np.frombuffer(os.pread(fd, es, b + first * es), dtype)[0]
        return count, tuple(int(j) for j in np.unravel_index(first, shape)), float(value)

    def _map(self, path: Path) -> tuple:
        """(the shared read-only mapping of shard `path` or None for an empty file, its size), made once: a
        mapping per tensor costs ~30 us. Its descriptor stays open while it lives: the native writer reads
        blocks of views of it with pread."""
        if path not in self.maps:
            fd = os.open(path, os.O_RDONLY)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
            if mm is None:
                os.close(fd)
            else:
                _MAPPINGS[mm] = (np.frombuffer(mm, np.uint8, count=1).ctypes.data, fd)
                weakref.finalize(mm, os.close, fd)
            self.maps[path] = (mm, size)
        return self.maps[path]

    def _fd(self, path: Path) -> int:
        """The open descriptor of a non-empty shard `path`."""
        return _MAPPINGS[self._map(path)[0]][1]


def is_float(dtype) -> bool:
    """Whether `dtype` is one of the float formats safetensors holds (F64, F32, F16, BF16)."""
    return np.dtype(dtype) in (DTYPES["F64"], DTYPES["F32"], DTYPES["F16"], DTYPES["BF16"])


@functools.cache
def overflow_limit(src, dst) -> int:
    """The smallest magnitude bit pattern (all bits but the sign) of a `src` value that is not finite once cast
    to `dst`. Magnitudes order as their patterns, NaN and Inf above every finite value, so `|bits| >= limit`
    is exactly "NaN, Inf, or made Inf by the cast": the pattern of Inf where `dst` holds every `src` value,
    lower where the cast narrows (float32 -> float16: 65520.0, the first value rounded to Inf). Found by
    bisection over the patterns with numpy's own cast, the one the writers use."""
    src, dst = np.dtype(src), np.dtype(dst)
    u = np.dtype(f"<u{src.itemsize}")
    lo, hi = 0, int(np.array(np.inf, src).view(u))
    with np.errstate(over="ignore"):
        while lo < hi:
            mid = (lo + hi) // 2
            if np.isfinite(np.array(mid, u).view(src).astype(dst).astype(np.float64)):
                lo = mid + 1
            else:
                hi = mid
    return lo


def count_beyond(x: np.ndarray, limit: int) -> tuple[int, int]:
    """(how many elements of float array `x` have magnitude bits >= `limit`, the flat index of the first or -1)."""
    u = np.dtype(f"<u{x.dtype.itemsize}")
    mag = np.ascontiguousarray(x).reshape(-1).view(u) & u.type((1 << (8 * u.itemsize - 1)) - 1)
    hits = np.flatnonzero(mag >= limit)
    return hits.size, int(hits[0]) if hits.size else -1


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


def _transposed(a: np.ndarray):
    """`a` as a 2-D view [R, C] whose transpose [C, R] is C-contiguous (e.g. w.T.reshape(...) of a C-contiguous
    w), or None."""
    for k in range(1, a.ndim):
        try:
            m = a.reshape(math.prod(a.shape[:k]), -1, copy=False)
        except ValueError:
            continue
        if m.T.flags.c_contiguous:
            return m
    return None


def _transpose_into(out_RC: np.ndarray, x_CR: np.ndarray) -> None:
    """out = x.T (with a same-kind cast). numpy walks `x` down its columns, ~1 GB/s once `out` has many rows;
    16 rows of `x` at a time keep its reads in cache (~2-3 GB/s). A small `x` (in cache): one call is faster."""
    R, C = out_RC.shape
    if R < 128 and R * C <= 1 << 16:
        np.copyto(out_RC, x_CR.T, casting="same_kind")
        return
    for j in range(0, C, 16):
        np.copyto(out_RC[:, j:j + 16], x_CR[j:j + 16].T, casting="same_kind")


def _pwrite(fd: int, data, offset: int) -> None:
    mv = memoryview(data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data)
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


class AbortOnError:
    """`with writer:` aborts the writer (nothing half-written left) when the block raises; the block
    calls `close()` itself."""

    def __enter__(self):
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abort()


class PlannedWriter(AbortOnError):
    """Sharded safetensors whose tensors (name, shape, dtype) are all known before any is written.

    The constructor splits `specs` into shards of at most `shard_bytes` (a larger tensor gets
    its own), writes every header and sizes every file; `add(name, a, index)` then writes `a`
    as `tensor[index]` (leading indices, so a contiguous block) at its offset, in any order.
    Writes run on `threads` worker threads (0: in the caller), at most 2 * threads queued, each
    holding its array until written. With the native kernel (`use_native`: None uses it when
    built), blocks C-contiguous or transposed in their planned dtype go through it; others (casts)
    take the numpy path below. A block that is not C-contiguous in the planned dtype (a
    transposed view, a cast) is copied through a per-thread buffer of about CHUNK bytes (at
    least 128 rows of a transposed block), a few rows at a time. `close()` waits for the
    writes, checks every byte was written and writes the index json.
    """

    def __init__(self, directory, specs, shard_bytes: int = 2 << 30, threads: int | None = None,
                 use_native: bool | None = None):
        self.lib = native() if use_native is not False else None
        if use_native and self.lib is None:
            raise RuntimeError(f"{LIB} not found")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        groups, size = [[]], 0
        for name, shape, dtype in specs:
            dtype = np.dtype(dtype)
            if dtype not in CODES:
                raise SafetensorsError(f"{self.dir}: tensor {name} has unsupported dtype {dtype}")
            nbytes = math.prod(shape) * dtype.itemsize
            if groups[-1] and size + nbytes > shard_bytes:
                groups, size = groups + [[]], 0
            groups[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self.where, self.fds, self.files, self.weight_map = {}, [], [], {}
        self.total, self.written = 0, 0
        try:
            for i, group in enumerate(groups):
                file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                header, offset = {}, 0
                for name, shape, dtype, nbytes in group:
                    header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                                    "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
                header["__metadata__"] = {"format": "pt"}
                raw = json.dumps(header, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                fd = os.open(self.dir / file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                self.fds.append(fd)
                self.files.append(self.dir / file)
                _pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
                os.ftruncate(fd, 8 + len(raw) + offset)
                for name, shape, dtype, _ in group:
                    self.where[name] = (fd, shape, dtype, 8 + len(raw) + header[name]["data_offsets"][0])
                    self.weight_map[name] = file
                self.total += offset
        except BaseException:  # sizing a shard failed (a full disk, a file-size limit): nothing left behind
            for fd in self.fds:
                os.close(fd)
            for f in self.files:
                f.unlink(missing_ok=True)
            raise
        threads = self.threads = THREADS if threads is None else threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="PlannedWriter") if threads else None
        self.queued, self.queue_max, self.local = collections.deque(), 2 * threads, threading.local()
        self.run = None  # small blocks bound for consecutive offsets, not yet submitted

    def add(self, name: str, a: np.ndarray, index: tuple = ()) -> None:
        """Writes `a` (any strides; cast to the planned dtype) as tensor[index]."""
        if name not in self.where:
            raise SafetensorsError(f"{self.dir}: tensor {name} was not planned")
        fd, shape, dtype, offset = self.where[name]
        a = np.asarray(a)
        block = shape[len(index):]
        if a.shape != block or not np.can_cast(a.dtype, dtype, "same_kind"):
            raise SafetensorsError(f"{self.dir}: tensor {name}{list(index)} is {a.shape} {a.dtype}, "
                                   f"planned {block} {dtype}")
        nbytes = math.prod(block) * dtype.itemsize
        if index:
            offset += int(np.ravel_multi_index(index, shape[:len(index)])) * nbytes
        self.written += nbytes
        if nbytes == 0:
            return
        if self.run and (self.run[0] != fd or self.run[2] != offset or self.run[3] + nbytes > RUN):
            self._flush_run()
        if nbytes >= SPLIT and self.lib is not None and self.threads > 1 and a.dtype == dtype:
            t = None if a.flags.c_contiguous else _transposed(a)
            if t is not None:  # a large transposed block: its rows in one strip per thread, transposed at once
                step = -(-len(t) // self.threads)
                for i in range(0, len(t), step):
                    part = t[i:i + step]
                    self._submit(self._write_blocks, fd, offset + i * part[0].nbytes, part.nbytes, [(part, dtype)])
                return
        if nbytes >= RUN:
            self._submit(self._write_blocks, fd, offset, nbytes, [(a, dtype)])
            return
        if not self.run:
            self.run = [fd, offset, offset, 0, []]  # fd, start, end, bytes, [(block, dtype)]
        self.run[2] += nbytes
        self.run[3] += nbytes
        self.run[4].append((a, dtype))

    def _flush_run(self) -> None:
        if self.run:
            fd, start, _, nbytes, blocks = self.run
            self.run = None
            self._submit(self._write_blocks, fd, start, nbytes, blocks)

    def _submit(self, fn, *args) -> None:
        if self.pool is None:
            fn(*args)
            return
        while len(self.queued) >= self.queue_max:
            self.queued.popleft().result()
        self.queued.append(self.pool.submit(fn, *args))

    def _buffer(self, nbytes: int) -> np.ndarray:
        buf = getattr(self.local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self.local.buf = np.empty(max(nbytes, CHUNK), np.uint8)
        return buf[:nbytes]

    @staticmethod
    def _fill(out: np.ndarray, a: np.ndarray) -> None:
        """out[...] = a (out C-contiguous, same shape; a same-kind cast), transposing in tiles where `a` is a
        transposed view."""
        t = None if a.ndim < 2 or a.flags.c_contiguous else _transposed(a)
        if t is None:
            np.copyto(out, a, casting="same_kind")
        else:
            _transpose_into(out.reshape(t.shape), t.T)

    def _write_blocks(self, fd: int, start: int, nbytes: int, blocks: list) -> None:
        """Blocks [(array, dtype)] bound for consecutive offsets from `start`: with the native kernel when each is
        C-contiguous or a transposed view in its planned dtype, else with numpy."""
        desc = None if self.lib is None else np.empty((len(blocks), 8), np.int64)  # see block_t in safetensors.c
        row = 0
        for i, (a, dtype) in enumerate(blocks):
            if desc is None:
                break
            t = None if a.dtype != dtype or a.flags.c_contiguous else _transposed(a)  # [R, C]; t.T is [C, R] C-order
            if t is None and a.dtype == dtype and a.ndim == 2 and a.strides[0] == dtype.itemsize and \
                    a.strides[1] >= a.shape[0] * dtype.itemsize and a.strides[1] % dtype.itemsize == 0:
                t = a  # a strip of rows of a transposed view: its source rows are a.strides[1] apart
            if a.dtype == dtype and a.flags.c_contiguous:
                desc[i] = a.ctypes.data, 1, a.size, dtype.itemsize, 0, *(_source(a) or (-1, 0)), a.size
            elif t is not None:
                desc[i] = (t.ctypes.data, t.shape[1], t.shape[0], dtype.itemsize, 1, *(_source(a) or (-1, 0)),
                           t.strides[1] // dtype.itemsize)
                row = max(row, t.shape[1] * dtype.itemsize)
            else:
                desc = None
        if desc is None:
            if len(blocks) == 1 and nbytes >= RUN:
                self._write(fd, start, *blocks[0])
            else:
                self._write_run(fd, start, nbytes, blocks)
            for a, _ in blocks if self.lib is not None else ():  # read by numpy: drop the pages it mapped
                if _source(a) is not None:
                    self.lib.ling2_drop_pages(a.ctypes.data, a.nbytes)
            return
        cap = max(NATIVE_CHUNK, TILE * row)
        buf = self._buffer(cap + SOURCE_CHUNK)
        rc = self.lib.ling2_write_blocks(fd, start, desc.ctypes.data, len(blocks), buf.ctypes.data, cap,
                                         buf[cap:].ctypes.data, SOURCE_CHUNK)
        if rc:
            raise OSError(-rc, f"{self.dir}: copying {nbytes} bytes to offset {start} of a shard (reading the source "
                               f"blocks or writing them) failed: {os.strerror(-rc)}")

    def _write_run(self, fd: int, start: int, nbytes: int, blocks: list) -> None:
        """Blocks bound for consecutive offsets: gathered in the buffer, written with one pwrite."""
        buf, pos = self._buffer(nbytes), 0
        for a, dtype in blocks:
            n = a.size * dtype.itemsize
            self._fill(buf[pos:pos + n].view(dtype).reshape(a.shape), a)
            pos += n
        _pwrite(fd, buf, start)

    def _write(self, fd: int, offset: int, a: np.ndarray, dtype: np.dtype) -> None:
        """One large block: written as it is when C-contiguous in `dtype`, else in strips through the buffer."""
        if a.dtype == dtype and a.flags.c_contiguous:
            _pwrite(fd, a, offset)
            return
        t = _transposed(a) if a.ndim > 1 else None
        if t is not None:  # [R, C] rows in strips of >= 128 rows, each transposed from x = t.T in tiles
            R, C = t.shape
            rows = min(R, max(128, CHUNK // max(1, C * dtype.itemsize)))
            for i in range(0, R, rows):
                out = self._buffer(min(rows, R - i) * C * dtype.itemsize).view(dtype).reshape(-1, C)
                _transpose_into(out, t.T[:, i:i + rows])
                _pwrite(fd, out, offset + i * C * dtype.itemsize)
            return
        rows = max(1, CHUNK // max(1, a[0].nbytes))
        for i in range(0, len(a), rows):
            part = a[i:i + rows]
            out = self._buffer(part.size * dtype.itemsize).view(dtype).reshape(part.shape)
            np.copyto(out, part, casting="same_kind")
            _pwrite(fd, out, offset + i * (a.size // len(a)) * dtype.itemsize)

    def _drain(self) -> None:
        while self.queued:
            self.queued.popleft().result()

    def abort(self) -> None:
        """Gives up: waits for the writes in flight (their errors dropped), closes and removes the shards."""
        self.run = None
        for f in self.queued:
            f.exception()
        self.queued.clear()
        if self.pool is not None:
            self.pool.shutdown()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for file in self.files:
            file.unlink(missing_ok=True)

    def close(self) -> dict:
        """Waits for the queued writes, closes the shards and writes the index; returns it."""
        self._flush_run()
        self._drain()
        if self.written != self.total:  # the files stay open: the missing blocks may still be added
            raise SafetensorsError(f"{self.dir}: {self.written} of {self.total} planned bytes written")
        if self.pool is not None:
            self.pool.shutdown()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return index
