"""Megatron-LM `.bin`/`.idx` token datasets: a zero-copy mmap reader and a streaming writer.

`.idx` layout (little-endian): magic `MMIDIDX\\0\\0` (9 bytes), version u64 = 1, dtype code u8
(Megatron's codes; only the integer ones, 1-5 and 8, are token files), sequence count u64,
document count u64 (= documents + 1), then int32 sequence lengths, int64 byte pointers into
`.bin`, int64 document indices (sequence ids; document d is sequences [di[d], di[d+1])), and,
for multimodal files only, int8 sequence modes.
`.bin` is the raw concatenated tokens. The writer's output is byte-identical to Megatron's
`IndexedDatasetBuilder` for the same tokens. All byte arithmetic is int64.
"""

from __future__ import annotations

import array
import contextlib
import os
import shutil
import struct
from typing import Optional, Sequence

import numpy as np

from ling2.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8

DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODES = {dt: code for code, dt in DTYPES.items()}
TOKEN_CODES = {code for code, dt in DTYPES.items() if dt.kind in "iu"}  # float codes hold no token ids


class DataFormatError(DataError):
    """A `.bin`/`.idx` file is malformed; the message names the file and byte offset."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def optimal_dtype(vocab_size: Optional[int]) -> np.dtype:
    """Megatron's token dtype rule: uint16 below 65500 tokens, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair; arrays returned are views into the mmaps.

    Args:
      prefix: path without the `.bin`/`.idx` suffix.
      multimodal: whether the `.idx` carries per-sequence modes. None detects it from the
        file size (the header does not flag it).
    """

    def __init__(self, prefix: str, multimodal: Optional[bool] = None):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                what = ("a directory, not a file" if os.path.isdir(p) else
                        "not a regular file" if os.path.exists(p) else "no such file")
                raise DataError(f"{p}: {what} (dataset prefix {prefix!r})")
        isize = os.path.getsize(ipath)
        if isize < HEADER_BYTES:
            raise DataFormatError(
                f"{ipath}: truncated header: {isize} bytes, the header needs {HEADER_BYTES}")
        with open(ipath, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:9] != MAGIC:
            raise DataFormatError(f"{ipath}: bad magic {head[:9]!r} at byte 0, want {MAGIC!r}")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise DataFormatError(f"{ipath}: unsupported version {version} at byte 9, want 1")
        code = head[17]
        if code not in DTYPES:
            raise DataFormatError(f"{ipath}: unknown dtype code {code} at byte 17")
        if code not in TOKEN_CODES:
            raise DataFormatError(
                f"{ipath}: dtype code {code} ({DTYPES[code]}) at byte 17 is not an integer type; "
                f"token files use codes {sorted(TOKEN_CODES)} (Megatron's integer dtypes)")
        self.dtype = DTYPES[code]
        n, d = struct.unpack("<QQ", head[18:34])
        self._check_counts(ipath, isize, n, d)
        base = HEADER_BYTES + 12 * n + 8 * d
        if multimodal is None:
            multimodal = isize == base + n and n > 0
        want = base + (n if multimodal else 0)
        if isize != want:
            what = "truncated" if isize < want else "has trailing bytes"
            raise DataFormatError(
                f"{ipath}: {what}: {isize} bytes, but {n} sequences and {d} document "
                f"indices{' with modes' if multimodal else ''} need {want}")
        self.multimodal = multimodal

        # Plain ndarray views of the mmap (which they keep alive): they index ~10x faster.
        self._idx = np.memmap(ipath, dtype=np.uint8, mode="r").view(np.ndarray)
        o_len, o_ptr, o_doc = HEADER_BYTES, HEADER_BYTES + 4 * n, HEADER_BYTES + 12 * n
        self.sequence_lengths = self._idx[o_len:o_ptr].view("<i4")
        self.sequence_pointers = self._idx[o_ptr:o_doc].view("<i8")
        self.document_indices = self._idx[o_doc:base].view("<i8")
        self.sequence_modes = self._idx[base:want].view(np.int8) if multimodal else None
        self._validate(ipath, bpath, n, o_len, o_ptr, o_doc)

        size = os.path.getsize(bpath)
        count = size // self.dtype.itemsize
        # An all-empty dataset has an empty .bin, which cannot be mmapped.
        mm = (np.memmap(bpath, dtype=self.dtype, mode="r", shape=(count,))
              if count else np.zeros(0, self.dtype))
        self._bin = mm.view(np.ndarray)
        self._starts = None

    def __reduce__(self):
        # Worker processes reopen the mmaps instead of pickling the data.
        return (IndexedDataset, (self.prefix, self.multimodal))

    @staticmethod
    def _check_counts(ipath: str, isize: int, n: int, d: int) -> None:
        if n == 0:
            raise DataFormatError(f"{ipath}: empty dataset: sequence count is 0 (byte 18)")
        if d == 0:
            raise DataFormatError(
                f"{ipath}: document count is 0 at byte 26; it must be documents + 1 >= 1")
        if HEADER_BYTES + 12 * n + 8 * d > isize:
            raise DataFormatError(
                f"{ipath}: truncated: {isize} bytes, but {n} sequences (byte 18) and {d} "
                f"document indices (byte 26) need {HEADER_BYTES + 12 * n + 8 * d}")

    def _validate(self, ipath, bpath, n, o_len, o_ptr, o_doc) -> None:
        lengths, ptrs, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        bad = np.flatnonzero(lengths < 0)
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(f"{ipath}: negative sequence length {lengths[i]} for "
                                  f"sequence {i} at byte {o_len + 4 * i}")
        if docs[0] != 0:
            raise DataFormatError(
                f"{ipath}: document index must start at 0, got {docs[0]} at byte {o_doc}")
        bad = np.flatnonzero(np.diff(docs) < 0)
        if bad.size:
            i = int(bad[0]) + 1
            raise DataFormatError(f"{ipath}: document index decreases at entry {i} "
                                  f"(byte {o_doc + 8 * i})")
        if docs[-1] != n:
            raise DataFormatError(
                f"{ipath}: document index ends at {docs[-1]} (byte {o_doc + 8 * (len(docs) - 1)})"
                f" but there are {n} sequences")
        bsize = os.path.getsize(bpath)
        item = self.dtype.itemsize
        ends = ptrs + lengths.astype(np.int64) * item
        bad = np.flatnonzero((ptrs < 0) | (ptrs % item != 0) | (ends > bsize))
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(
                f"{ipath}: sequence {i} (pointer at byte {o_ptr + 8 * i}) spans bytes "
                f"[{ptrs[i]}, {ends[i]}) of {bpath}, which has {bsize} bytes"
                + (" (truncated .bin?)" if ends[i] > bsize else ""))
        # Megatron's builder writes the sequences back to back: each starts where the one before ends. Anything
        # else (a wrong dtype code, pointers or lengths of another file) would read other tokens silently.
        starts = np.concatenate([[0], ends[:-1]]) if n else ends
        bad = np.flatnonzero(ptrs != starts)
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(
                f"{ipath}: sequence {i} (pointer at byte {o_ptr + 8 * i}) starts at byte {ptrs[i]} of {bpath}, "
                f"but the sequences before it end at byte {starts[i]} ({np.dtype(self.dtype).name} tokens of "
                f"{item} bytes: is the dtype code right?)")
        if n and ends[-1] != bsize:
            raise DataFormatError(f"{ipath}: its {n} sequences end at byte {ends[-1]} but {bpath} has {bsize} bytes "
                                  f"(a .bin and .idx of different datasets, or the wrong dtype code?)")

    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def token_starts(self) -> np.ndarray:
        """int64 element offset of each sequence in `.bin` (cached)."""
        if self._starts is None:
            self._starts = self.sequence_pointers // self.dtype.itemsize
        return self._starts

    def get(self, seq: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `seq`, as a view into the mmap."""
        n = len(self)
        if not 0 <= seq < n:
            raise IndexError(f"{self.prefix}: sequence {seq} out of range [0, {n})")
        size = int(self.sequence_lengths[seq])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) out of "
                             f"sequence {seq} of length {size}")
        start = int(self.sequence_pointers[seq]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def __getitem__(self, seq: int) -> np.ndarray:
        return self.get(seq)

    def mode(self, seq: int) -> int:
        if self.sequence_modes is None:
            raise ValueError(f"{self.prefix}: not a multimodal dataset")
        return int(self.sequence_modes[seq])

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (a view when its sequences are contiguous)."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"{self.prefix}: document {doc} out of range "
                             f"[0, {self.num_documents})")
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if lo == hi:
            return self._bin[:0]
        first = int(self.sequence_pointers[lo]) // self.dtype.itemsize
        total = int(self.sequence_lengths[lo:hi].sum(dtype=np.int64))
        last = int(self.sequence_pointers[hi - 1]) // self.dtype.itemsize
        if last + int(self.sequence_lengths[hi - 1]) == first + total:
            return self._bin[first:first + total]
        return np.concatenate([self.get(s) for s in range(lo, hi)])


class IndexedDatasetBuilder:
    """Streams tokens to `.bin`; keeps only the compact index arrays in memory.

    Use `add_item` per sequence then `end_document`, or `add_document`; `add_index` appends a
    whole dataset (merge); `finalize(idx_path)` writes the `.idx`; `discard()` abandons the build.
    """

    def __init__(self, bin_file: str, dtype=np.int32, multimodal: bool = False):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES or CODES[self.dtype] not in TOKEN_CODES:
            raise ValueError(f"{bin_file}: unsupported token dtype {self.dtype} (token ids are integers)")
        self.bin_file = bin_file
        self._out = open(bin_file, "wb")
        self._idx_file = None  # the `.idx` that `finalize` began writing
        self.multimodal = multimodal
        self.sequence_lengths = array.array("i")
        self.document_indices = array.array("q", [0])
        self.sequence_modes = array.array("b") if multimodal else None

    def _as_tokens(self, tokens) -> np.ndarray:
        x = np.asarray(tokens)
        if x.ndim != 1:
            x = x.reshape(-1)
        if x.size and self.dtype.kind in "iu" and x.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            lo, hi = x.min(), x.max()
            if lo < info.min or hi > info.max:
                raise ValueError(f"{self.bin_file}: token ids [{lo}, {hi}] do not fit "
                                 f"{self.dtype} (range [{info.min}, {info.max}])")
        if x.size >= 2**31:
            raise ValueError(f"{self.bin_file}: a sequence of {x.size} tokens exceeds int32")
        return np.ascontiguousarray(x, dtype=self.dtype)

    def add_item(self, tokens, mode: int = 0) -> None:
        x = self._as_tokens(tokens)
        self._out.write(x.tobytes())
        self.sequence_lengths.append(x.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: Sequence[int],
                     modes: Optional[Sequence[int]] = None) -> None:
        """One document of sequences with the given lengths (an empty list: empty document)."""
        x = self._as_tokens(tokens)
        if sum(int(l) for l in lengths) != x.size:
            raise ValueError(f"{self.bin_file}: sequence lengths sum to {sum(lengths)} but the "
                             f"document has {x.size} tokens")
        self._out.write(x.tobytes())
        self.sequence_lengths.extend(int(l) for l in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_documents(self, tokens, lengths) -> None:
        """Many single-sequence documents at once (tokens concatenated, lengths per document)."""
        x = self._as_tokens(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != x.size or (lengths < 0).any():
            raise ValueError(f"{self.bin_file}: document lengths sum to {int(lengths.sum())} "
                             f"but {x.size} tokens were given")
        self._out.write(x.tobytes())
        n0 = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(lengths.astype(np.int32).tobytes())
        self.document_indices.frombytes(
            (n0 + np.arange(1, lengths.size + 1, dtype=np.int64)).tobytes())
        if self.multimodal:
            self.sequence_modes.frombytes(np.zeros(lengths.size, np.int8).tobytes())

    def add_index(self, prefix: str) -> None:
        """Append a whole dataset (its documents follow the ones already added)."""
        ds = IndexedDataset(prefix, multimodal=self.multimodal)
        if ds.dtype != self.dtype:
            raise ValueError(f"{idx_path(prefix)}: dtype {ds.dtype} differs from the "
                             f"builder's {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(ds.sequence_lengths.astype(np.int32))
        self.document_indices.extend((ds.document_indices[1:] + offset).astype(np.int64))
        if self.multimodal:
            self.sequence_modes.extend(ds.sequence_modes.astype(np.int8))
        del ds
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._out)

    def discard(self) -> None:
        """Deletes the partial `.bin` and any `.idx` that `finalize` began, so a failed build leaves no file
        behind; raises nothing, so the error that failed the build is the one reported. The buffered tail of the
        `.bin` is dropped unwritten: on a full disk writing it would fail again."""
        with contextlib.suppress(OSError):
            self._out.raw.close()  # the BufferedWriter is closed with it, its buffer never flushed
        for path in (self.bin_file, self._idx_file):
            if path is not None:
                with contextlib.suppress(OSError):
                    os.remove(path)

    def finalize(self, idx_file: str) -> None:
        self._out.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        self._idx_file = idx_file
        with open(idx_file, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.frombuffer(self.document_indices, dtype=np.int64).astype("<i8").tobytes())
            if self.multimodal:
                f.write(np.frombuffer(self.sequence_modes, dtype=np.int8).tobytes())


def write_dataset(prefix: str, documents: Sequence[Sequence[Sequence[int]]], dtype=np.int32,
                  modes: Optional[Sequence[Sequence[int]]] = None) -> None:
    """Writes documents given as lists of sequences of token ids (tests, small tools)."""
    b = IndexedDatasetBuilder(bin_path(prefix), dtype=dtype, multimodal=modes is not None)
    for i, doc in enumerate(documents):
        for j, seq in enumerate(doc):
            b.add_item(np.asarray(seq, dtype=np.int64), mode=modes[i][j] if modes else 0)
        b.end_document()
    b.finalize(idx_path(prefix))


def merge_datasets(prefixes: Sequence[str], out_prefix: str) -> None:
    """Concatenates whole datasets (same dtype) into one `.bin`/`.idx`."""
    if not prefixes:
        raise ValueError("merge_datasets: no input prefixes")
    first = IndexedDataset(prefixes[0])
    b = IndexedDatasetBuilder(bin_path(out_prefix), dtype=first.dtype,
                              multimodal=first.multimodal)
    del first
    for p in prefixes:
        b.add_index(p)
    b.finalize(idx_path(out_prefix))
