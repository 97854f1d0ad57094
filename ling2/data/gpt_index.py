"""GPT sample indices identical to Megatron-LM's GPTDataset, sample for sample.

Units are sequences (not documents). For a split with token count T, sequence length S and
`add` = 1 if `add_extra_token_to_sequence`:
  epochs E  = smallest E with E*T >= num_samples*S + add (1 when num_samples is None)
  samples n = (E*T - add) // S (drop-last; keep-partial rounds up)
One `numpy.random.RandomState(seed)` shuffles, in order: the document index (sequence ids
tiled E times; the final epoch shuffled on its own when it contributes < 80% of an epoch),
then the shuffle index (the separate final-epoch samples shuffled on their own).
Pre-shuffle sample j is the stream slice [j*S, j*S + S + add) of the concatenated
sequences in document-index order; `sample_index[j]` is where that slice starts, as
(document-index position, token offset). Everything is int64 and vectorised; peak memory
is the output plus one chunk (no E x N blow-up).

Differences from Megatron, only off its default (drop-last) path: keep-partial counts
samples with an exact integer ceil (Megatron's C++ uses float32, wrong past 2^24 tokens)
and ends the last sample at the last non-empty sequence; a split with too few tokens raises
instead of asserting or looping forever.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Optional

import numpy as np

from ling2.data import gather
from ling2.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")
_CHUNK = 1 << 18


def parse_split(split: str) -> list[float]:
    """"969,30,1" -> normalised [train, valid, test] fractions (missing ones are 0)."""
    parts = [p for p in re.split(r"[,/ ]+", split.strip()) if p]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"data_split {split!r}: not a list of numbers like '969,30,1'")
    if not 1 <= len(vals) <= 3 or any(v < 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"data_split {split!r}: need 1 to 3 non-negative numbers")
    vals += [0.0] * (3 - len(vals))
    total = float(np.sum(np.array(vals, np.float64)))
    if total <= 0:
        raise ValueError(f"data_split {split!r}: the parts sum to 0")
    return (np.array(vals, np.float64) / total).tolist()


def split_matrix(split: str) -> list[Optional[tuple[float, float]]]:
    """Book-ends [(lo, hi) or None] per split, as Megatron's cumulative sums."""
    out, lo = [], 0.0
    for v in parse_split(split):
        hi = lo + v
        out.append((lo, hi) if hi > lo else None)
        lo = hi
    return out


def split_range(num_sequences: int, split: str, name: str) -> tuple[int, int]:
    """Sequence ids [beg, end) of split `name`; Python round() as Megatron (half to even)."""
    bounds = split_matrix(split)[SPLITS.index(name)]
    if bounds is None:
        return 0, 0
    lo, hi = bounds
    return int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences)))


def num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int,
               add: int) -> int:
    if num_samples is None:
        return 1
    need = num_samples * seq_length + add
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(indices: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Sequence ids tiled `epochs` times and shuffled (int64)."""
    indices = np.asarray(indices, dtype=np.int64)
    if not separate_final_epoch or epochs == 1:
        out = np.tile(indices, epochs)
        rng.shuffle(out)
        return out
    out = np.empty(indices.size * epochs, dtype=np.int64)
    head = out[: indices.size * (epochs - 1)]
    head.reshape(epochs - 1, indices.size)[:] = indices
    rng.shuffle(head)
    tail = out[indices.size * (epochs - 1):]
    tail[:] = indices
    rng.shuffle(tail)
    return out


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int, epochs: int, tokens_per_epoch: int,
                       drop_last: bool = True, add: int = 1) -> np.ndarray:
    """[n + 1, 2] int64: row j = (document-index position, offset) where sample j starts.

    Row j >= 1 is stream position q = j*S placed in the entry holding token q + add - 1
    (the previous sample's last token), so a boundary at a document end stays in that
    document; empty documents are never chosen. Matches Megatron's helpers.cpp.
    """
    total = epochs * tokens_per_epoch
    if seq_length < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_length}")
    if total - add < 1 or total < 2:
        raise ValueError(f"{total} tokens cannot make one sample of length {seq_length}")
    n = (total - add) // seq_length if drop_last else -(-(total - add) // seq_length)
    out = np.zeros((n + 1, 2), dtype=np.int64)
    carry = 0  # tokens before the current chunk
    for a in range(0, document_index.shape[0], _CHUNK):
        lens = sequence_lengths[document_index[a:a + _CHUNK]].astype(np.int64)
        ends = np.cumsum(lens, out=lens)
        ends += carry
        hi = int(ends[-1])
        # samples j in [1, n] whose located token x = j*S + add - 1 lies in [carry, hi)
        j0 = max(1, -(-(carry - add + 1) // seq_length))
        j1 = min(n, (hi - add) // seq_length)
        if j1 >= j0:
            q = np.arange(j0, j1 + 1, dtype=np.int64) * seq_length
            pos = np.searchsorted(ends, q + (add - 1), side="right")
            out[j0:j1 + 1, 0] = pos + a
            out[j0:j1 + 1, 1] = q - (ends[pos] - sequence_lengths[document_index[a + pos]])
        carry = hi
        del lens, ends
    if not drop_last and n * seq_length > total - add:
        # Keep-partial: the last (short) sample ends at the stream end. Megatron points at the
        # last entry even when it is an empty sequence (and then asserts); we use the last
        # non-empty one.
        last = document_index.shape[0] - 1
        while sequence_lengths[document_index[last]] == 0:
            last -= 1
        start = total - int(sequence_lengths[document_index[last]])
        out[n] = (last, total - add - start)
    return out


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """arange(num_samples) shuffled, then arange(num_samples, total_size) shuffled (int64)."""
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_indices(sequence_lengths: np.ndarray, indices: np.ndarray, seq_length: int,
                  num_samples: Optional[int], seed: int, add_extra_token: bool = True,
                  drop_last: bool = True, name: str = "dataset"):
    """(document_index, sample_index, shuffle_index) for one split, as Megatron builds them."""
    add = int(bool(add_extra_token))
    tokens = int(sequence_lengths[indices].sum(dtype=np.int64)) if len(indices) else 0
    if tokens < 2 or (num_samples is None and tokens - add < (seq_length if drop_last else 1)):
        raise ValueError(
            f"{name}: the split has {tokens} tokens, too few for one sample of "
            f"sequence length {seq_length} (+{add} extra token)")
    epochs = num_epochs(tokens, num_samples, seq_length, add)
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens - add) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens - add) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    doc = build_document_index(indices, epochs, rng, separate)
    sample = build_sample_index(sequence_lengths, doc, seq_length, epochs, tokens,
                                drop_last, add)
    n = sample.shape[0] - 1
    shuffle = build_shuffle_index(sans_final if separate else n, n, rng)
    return doc, sample, shuffle


def _save(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, arr, allow_pickle=False)
    os.replace(tmp, path)


def megatron_descriptions(index_dir: Optional[str], kind: str, split: str):
    """(base path, parsed description.txt) of each readable `{md5}-{kind}-{split}` index set in a directory.

    Megatron hashes its tokenizer into the file name, so callers match on the description's fields.
    """
    if not index_dir or not os.path.isdir(index_dir):
        return
    suffix = f"-{kind}-{split}-description.txt"
    for fn in sorted(os.listdir(index_dir)):
        if not fn.endswith(suffix):
            continue
        try:
            with open(os.path.join(index_dir, fn)) as f:
                desc = json.load(f)
        except (OSError, ValueError):
            continue
        yield os.path.join(index_dir, fn[: -len("-description.txt")]), desc


def _find_megatron_indices(index_dir: str, dataset_path: str, split: str, num_samples,
                           seq_length: int, seed: int) -> Optional[str]:
    """Base path `{dir}/{md5}-GPTDataset-{split}` of Megatron's prebuilt indices for this dataset."""
    for base, desc in megatron_descriptions(index_dir, "GPTDataset", split):
        same_path = (desc.get("dataset_path") == dataset_path or os.path.basename(
            str(desc.get("dataset_path"))) == os.path.basename(dataset_path))
        if (same_path and desc.get("sequence_length") == seq_length
                and desc.get("random_seed") == seed and desc.get("num_samples") == num_samples):
            return base
    return None


class GPTDataset:
    """Samples of `seq_length + add` tokens from one split of an IndexedDataset.

    `dataset[i]` returns int64 tokens (pad_id-filled only for a keep-partial last sample).
    Indices are loaded from Megatron's prebuilt `.npy` in `index_dir` when present, else
    from / to our cache in `cache_dir`, else built in memory.
    """

    def __init__(self, dataset: IndexedDataset, split: str = "train", data_split: str = "1,0,0",
                 seq_length: int = 2048, num_samples: Optional[int] = None, seed: int = 1234,
                 add_extra_token: bool = True, drop_last: bool = True,
                 cache_dir: Optional[str] = None, index_dir: Optional[str] = None,
                 pad_id: int = -1):
        self.dataset = dataset
        self.split = split
        self.seq_length = int(seq_length)
        self.add = int(bool(add_extra_token))
        self.pad_id = pad_id
        self.num_samples = num_samples
        beg, end = split_range(len(dataset), data_split, split)
        self.description = json.dumps({
            "class": "GPTDataset", "dataset_path": dataset.prefix, "num_samples": num_samples,
            "index_split": split, "random_seed": seed, "sequence_length": self.seq_length,
            "split": data_split, "split_range": [beg, end], "add_extra_token": self.add,
            "drop_last": drop_last, "num_sequences": len(dataset),
        }, indent=4)
        self.hash = hashlib.md5(self.description.encode()).hexdigest()

        base = _find_megatron_indices(index_dir, dataset.prefix, split, num_samples,
                                      self.seq_length, seed)
        self.source = "megatron"
        if base is None and cache_dir:
            base = os.path.join(cache_dir, f"{self.hash}-GPTDataset-{split}")
            self.source = "cache"
        names = ("document_index", "sample_index", "shuffle_index")
        if base is not None and all(os.path.isfile(f"{base}-{k}.npy") for k in names):
            doc, sample, shuffle = (np.load(f"{base}-{k}.npy", mmap_mode="r") for k in names)
            self._check_loaded(base, doc, sample, shuffle, beg, end)
        else:
            self.source = "built"
            doc, sample, shuffle = build_indices(
                dataset.sequence_lengths, np.arange(beg, end, dtype=np.int64), self.seq_length,
                num_samples, seed, add_extra_token, drop_last,
                name=f"{dataset.prefix} ({split} split, sequences [{beg}, {end}))")
            if cache_dir:
                os.makedirs(cache_dir, exist_ok=True)
                base = os.path.join(cache_dir, f"{self.hash}-GPTDataset-{split}")
                for k, arr in zip(names, (doc, sample, shuffle)):
                    _save(f"{base}-{k}.npy", arr)
                with open(f"{base}-description.txt", "w") as f:
                    f.write(self.description)
        self.document_index, self.sample_index, self.shuffle_index = doc, sample, shuffle
        if self.source != "built":  # loaded: check every sample now, not mid-run
            self._check_all()
        if num_samples is not None and len(self) < num_samples:
            raise ValueError(f"{dataset.prefix}: {len(self)} samples < requested {num_samples}")

    def _check_loaded(self, base, doc, sample, shuffle, beg, end) -> None:
        if sample.ndim != 2 or sample.shape[1] != 2 or shuffle.shape[0] != sample.shape[0] - 1:
            raise ValueError(f"{base}-*.npy: inconsistent shapes: sample_index {sample.shape}, "
                             f"shuffle_index {shuffle.shape}")
        if doc.size and (int(doc.min()) < beg or int(doc.max()) >= end):
            raise ValueError(f"{base}-document_index.npy: sequence ids outside the split "
                             f"[{beg}, {end})")
        if shuffle.size and int(shuffle.max()) >= shuffle.shape[0]:
            raise ValueError(f"{base}-shuffle_index.npy: entry >= {shuffle.shape[0]}")
        if int(sample[:, 0].max()) >= doc.shape[0] or int(sample[:, 0].min()) < 0:
            raise ValueError(f"{base}-sample_index.npy: position outside the document index "
                             f"[0, {doc.shape[0]})")
        if shuffle.size and int(shuffle.min()) < 0:
            raise ValueError(f"{base}-shuffle_index.npy: negative entry")

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sample(int(self.shuffle_index[i]))

    def samples(self, ids, dtype=np.int64) -> np.ndarray:
        """dataset[i] for every i in `ids` as one [len(ids), seq_length + add] array."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self._read(np.asarray(self.shuffle_index[ids], dtype=np.int64), dtype)

    def sample(self, j: int, dtype=np.int64) -> np.ndarray:
        """Pre-shuffle sample j: seq_length + add tokens (`_read` of one, in Python scalars)."""
        ds, n, want = self.dataset, len(self.sample_index) - 1, self.seq_length + self.add
        if not 0 <= j < n:
            raise IndexError(f"{ds.prefix}: sample ids must be in [0, {n})")
        (b, bo), (e, eo) = self.sample_index[j:j + 2].tolist()
        seqs, item = self.document_index[b:e + 1].tolist(), ds.dtype.itemsize
        orig = (ds.sequence_pointers[seqs] // item).tolist()
        ends = [p + m for p, m in zip(orig, ds.sequence_lengths[seqs].tolist())]
        starts = orig.copy()
        if seqs:
            starts[0] += bo
            ends[-1] = orig[-1] + eo + self.add
        got = self._join([x * item for pair in zip(starts, ends) for x in pair])
        if got.size == want:
            return got.astype(dtype, copy=False)
        out = np.full(want, self.pad_id, dtype=dtype)  # a keep-partial last sample
        out[:got.size] = got
        return out

    def _pieces(self, js: np.ndarray):
        """Every piece (a slice of one sequence) of samples `js`, vectorised over the batch:
        token bounds [starts, ends) in the `.bin`, each sample's first piece and total length,
        and the pieces' sequences with their start and length (for `_check`)."""
        ds = self.dataset
        beg, end = self.sample_index[js], self.sample_index[js + 1]
        n_pieces = end[:, 0] - beg[:, 0] + 1
        first = np.cumsum(n_pieces) - n_pieces
        pos = np.repeat(beg[:, 0] - first, n_pieces) + np.arange(int(n_pieces.sum()))
        seqs = self.document_index[pos]
        orig = ds.sequence_pointers[seqs] // ds.dtype.itemsize
        size = ds.sequence_lengths[seqs].astype(np.int64)
        starts, ends = orig.copy(), orig + size
        starts[first] += beg[:, 1]
        last = first + n_pieces - 1
        ends[last] = orig[last] + end[:, 1] + self.add
        totals = np.add.reduceat(ends - starts, first) if starts.size else np.zeros(js.size, np.int64)
        return starts, ends, first, totals, (n_pieces, seqs, orig, size)

    def _check_all(self) -> None:
        """`_check` of every sample, natively when the kernel is built (~8x faster)."""
        n = len(self.sample_index) - 1
        for c in range(0, n, 1 << 20):
            js = np.arange(c, min(c + (1 << 20), n))
            if self._gather(js, None) is None:
                for k in range(0, js.size, 4096):
                    self._check(js[k:k + 4096])

    def _gather(self, js: np.ndarray, out: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """Native read (or check, out=None) of samples `js` into out [len(js), S + add]: each
        sample's token count, or None without the kernel. Raises `_check`'s error for a sample
        that does not fit."""
        ds, totals = self.dataset, np.empty(js.size, np.int64)
        rc = gather.gather_samples(ds._bin, ds.dtype.itemsize, ds.sequence_pointers,
                                   ds.sequence_lengths, self.document_index, self.sample_index,
                                   js, self.add, self.seq_length + self.add, out, totals)
        if rc:
            self._check(js[rc - 1:rc])
            raise ValueError(f"{ds.prefix}: sample {js[rc - 1]} does not fit this dataset")
        return None if rc is None else totals

    def _check(self, js: np.ndarray) -> None:
        """Raises ValueError unless samples `js` read only inside their own sequences and each
        has seq_length + add tokens (fewer only for the last, keep-partial, sample)."""
        ds, n, want = self.dataset, len(self.sample_index) - 1, self.seq_length + self.add
        n_pieces = self.sample_index[js + 1, 0] - self.sample_index[js, 0] + 1
        if js.size and int(n_pieces.min()) < 1:
            r = int(np.argmin(n_pieces))
            raise ValueError(f"{ds.prefix}: sample {js[r]} ends at document-index position "
                             f"{self.sample_index[js[r] + 1, 0]} before it starts at "
                             f"{self.sample_index[js[r], 0]}")
        starts, ends, first, totals, (_, seqs, orig, size) = self._pieces(js)
        bad = np.flatnonzero((starts < orig) | (starts > ends) | (ends > orig + size))
        if bad.size:  # never read outside the sequence a piece belongs to
            k = int(bad[0])
            raise ValueError(
                f"{ds.prefix}: sample {js[np.searchsorted(first, k, 'right') - 1]} reads tokens "
                f"[{starts[k] - orig[k]}, {ends[k] - orig[k]}) of sequence {seqs[k]} of length "
                f"{size[k]}: the sample index does not fit this dataset")
        bad = np.flatnonzero((totals > want) | ((totals < want) & (js != n - 1)))
        if bad.size:
            raise ValueError(f"{ds.prefix}: sample {js[bad[0]]} has {totals[bad[0]]} tokens, "
                             f"want {want}: the sample index does not fit this dataset")

    def _read(self, js: np.ndarray, dtype) -> np.ndarray:
        """Pre-shuffle samples `js` (valid ids) as [len(js), seq_length + add] `dtype` tokens.
        The native gather checks every piece as it copies; the numpy fallback relies on the
        sample index having been checked against the dataset when it was loaded."""
        ds, want = self.dataset, self.seq_length + self.add
        got = np.empty((js.size, want), ds.dtype)
        totals = self._gather(js, got)
        if totals is None:
            starts, ends, _, totals, _ = self._pieces(js)
            flat = self._join((np.stack((starts, ends), axis=1).ravel() * ds.dtype.itemsize).tolist())
            if flat.size == got.size:
                got = flat.reshape(got.shape)
            else:
                got[np.arange(want) < totals[:, None]] = flat
        if (totals != want).any():  # a keep-partial last sample
            got = got.astype(dtype)
            got[np.arange(want) >= totals[:, None]] = self.pad_id
        return got.astype(dtype, copy=False)

    def _join(self, bounds: list) -> np.ndarray:
        """Bytes [b[0], b[1]), [b[2], b[3]), ... of the `.bin`, concatenated, as tokens: one
        `bytearray.join` of memoryview slices of the mmap, so every piece is copied in C."""
        mv = memoryview(self.dataset._bin).cast("B")
        it = iter(bounds)
        return np.frombuffer(bytearray().join(map(mv.__getitem__, map(slice, it, it))), dtype=self.dataset.dtype)
