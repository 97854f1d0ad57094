"""GPT sample indices identical to Megatron-LM's GPTDataset, sample for sample.

Units are sequences (not documents). For a split with token count T, sequence length S and
`add` = 1 if `add_extra_token_to_sequence`:
  epochs E  = smallest E with E*T >= num_samples*S + add (1 when num_samples is None)
  samples n = (E*T - add) // S (drop-last); keep-partial rounds up, in float32 as Megatron's
              helpers.cpp (`ceil(float(E*T - add) / S)`), or exactly with `exact_sample_count`
One `numpy.random.RandomState(seed)` shuffles, in order: the document index (sequence ids
tiled E times; the final epoch shuffled on its own when it contributes < 80% of an epoch),
then the shuffle index (the separate final-epoch samples shuffled on their own).
Pre-shuffle sample j is the stream slice [j*S, j*S + S + add) of the concatenated
sequences in document-index order; `sample_index[j]` is where that slice starts, as
(document-index position, token offset). Indices are int32 where the values fit (Megatron's
dtypes; int64 past 2^31), built vectorised; peak memory is the output plus one chunk.

Differences from Megatron, only where Megatron fails: a keep-partial index whose last
document-index entries are empty sequences ends at the last non-empty one (Megatron asserts);
a split too small for one sample raises a DataError (Megatron tiles it into samples that
repeat the same tokens, asserts below 2 tokens, or loops forever at 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Optional

import numpy as np

from ling2.data import gather, index_cache
from ling2.data.errors import DataError
from ling2.data.indexed import CODES, IndexedDataset

SPLITS = ("train", "valid", "test")
_CHUNK = 1 << 18
_I32 = np.iinfo(np.int32).max


def index_dtype(max_value: int) -> np.dtype:
    """int32 when every value fits (Megatron's dtype), else int64."""
    return np.dtype(np.int32 if max_value <= _I32 else np.int64)


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
    if not math.isfinite(sum(vals)):
        raise ValueError(f"data_split {split!r}: the parts sum past the largest float; scale them down")
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


def split_bounds(split: Optional[str], name: str) -> Optional[tuple[float, float]]:
    """Split `name`'s book-ends; None for a `split` string of None: the whole dataset (a
    per-split blend, Megatron's `blend_per_split`)."""
    return (0.0, 1.0) if split is None else split_matrix(split)[SPLITS.index(name)]


def bounds_range(num_sequences: int, bounds) -> tuple[int, int]:
    """Sequence ids [beg, end) of book-ends (lo, hi); Python round() as Megatron (half to even)."""
    if bounds is None:
        return 0, 0
    lo, hi = bounds
    return int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences)))


def split_range(num_sequences: int, split: Optional[str], name: str) -> tuple[int, int]:
    """Sequence ids [beg, end) of split `name`."""
    return bounds_range(num_sequences, split_bounds(split, name))


def num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int,
               add: int) -> int:
    if num_samples is None:
        return 1
    need = num_samples * seq_length + add
    return max(1, -(-need // tokens_per_epoch))


def sample_count(total_tokens: int, seq_length: int, add: int, drop_last: bool = True,
                 exact: bool = False) -> int:
    """Samples in a stream of `total_tokens` (all epochs). Drop-last: (total - add) // S.
    Keep-partial rounds up: by default as Megatron's helpers.cpp, `ceil(float(total - add) /
    S)` in float32 (past 2^24 tokens it can be one short, dropping the partial sample, or
    over, adding samples of only the stream's last `add` tokens); `exact` uses integers."""
    m = total_tokens - add
    if drop_last:
        return m // seq_length
    if exact:
        return -(-m // seq_length)
    return int(np.ceil(np.array(m, np.int64).astype(np.float32) / np.float32(seq_length)))


def build_document_index(indices: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Sequence ids tiled `epochs` times and shuffled (int32 where they fit)."""
    indices = np.asarray(indices)
    out = np.empty(indices.size * epochs,
                   dtype=index_dtype(int(indices.max()) if indices.size else 0))
    if not separate_final_epoch or epochs == 1:
        out.reshape(epochs, indices.size)[:] = indices
        rng.shuffle(out)
        return out
    head = out[: indices.size * (epochs - 1)]
    head.reshape(epochs - 1, indices.size)[:] = indices
    rng.shuffle(head)
    tail = out[indices.size * (epochs - 1):]
    tail[:] = indices
    rng.shuffle(tail)
    return out


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int, epochs: int, tokens_per_epoch: int,
                       drop_last: bool = True, add: int = 1, exact: bool = False) -> np.ndarray:
    """[n + 1, 2]: row j = (document-index position, offset) where sample j starts; int32
    when positions and sequence lengths fit (Megatron's rule), else int64.

    Row j >= 1 is stream position q = j*S placed in the entry holding token q + add - 1
    (the previous sample's last token), so a boundary at a document end stays in that
    document; empty documents are never chosen. Rows past the last full sample (keep-partial)
    hold the stream end, (last non-empty entry, its length - add). Matches Megatron's
    helpers.cpp (the sample count as `sample_count`).
    """
    total = epochs * tokens_per_epoch
    if seq_length < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_length}")
    if total - add < 1 or total < 2:
        raise DataError(f"{total} tokens cannot make one sample of length {seq_length}")
    n = sample_count(total, seq_length, add, drop_last, exact)
    n_full = min(n, (total - add) // seq_length)
    longest = int(sequence_lengths.max()) if sequence_lengths.size else 0
    out = np.zeros((n + 1, 2), dtype=index_dtype(max(document_index.shape[0], longest)))
    carry = 0  # tokens before the current chunk
    for a in range(0, document_index.shape[0], _CHUNK):
        lens = sequence_lengths[document_index[a:a + _CHUNK]].astype(np.int64)
        ends = np.cumsum(lens, out=lens)
        ends += carry
        hi = int(ends[-1])
        # samples j in [1, n] whose located token x = j*S + add - 1 lies in [carry, hi)
        j0 = max(1, -(-(carry - add + 1) // seq_length))
        j1 = min(n_full, (hi - add) // seq_length)
        if j1 >= j0:
            q = np.arange(j0, j1 + 1, dtype=np.int64) * seq_length
            pos = np.searchsorted(ends, q + (add - 1), side="right")
            out[j0:j1 + 1, 0] = pos + a
            out[j0:j1 + 1, 1] = q - (ends[pos] - sequence_lengths[document_index[a + pos]])
        carry = hi
        del lens, ends
    if n > n_full:
        # Keep-partial: the short sample(s) end at the stream end. Megatron points at the last
        # entry even when it is an empty sequence (and then asserts); we use the last
        # non-empty one.
        last = document_index.shape[0] - 1
        while sequence_lengths[document_index[last]] == 0:
            last -= 1
        out[n_full + 1:] = (last, int(sequence_lengths[document_index[last]]) - add)
    return out


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """arange(num_samples) shuffled, then arange(num_samples, total_size) shuffled (int32
    where they fit)."""
    dtype = index_dtype(total_size)
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def check_enough_tokens(tokens: int, seq_length: int, add: int, num_samples: Optional[int],
                        drop_last: bool, name: str) -> None:
    """DataError unless one pass over the split makes a sample: S + add tokens, or (keep-partial
    with no sample count) at least 1 + add."""
    need = 1 + add if (num_samples is None and not drop_last) else seq_length + add
    if tokens < max(need, 2):
        raise DataError(
            f"{name}: the split has {tokens} tokens, too few for one sample of "
            f"sequence length {seq_length} (+{add} extra token)")


def min_index_bytes(samples: int, epochs: int = 0, num_sequences: int = 0) -> int:
    """The smallest size of a split's index arrays (int32 everywhere): the document index tiled `epochs`
    times over `num_sequences`, the sample index ([samples + 1, 2]) and the shuffle index."""
    return 4 * (epochs * num_sequences + (samples + 1) * 2 + samples)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_index_fits(num_sequences: int, epochs: int, num_samples: Optional[int], name: str) -> None:
    """DataError when the split's index arrays, at their smallest, would not fit this host's memory: a run
    asking for far more samples than it means to (steps=1e11) is named before numpy tries to allocate
    terabytes, and a run that fits is never refused."""
    samples = num_samples or 0
    need, have = min_index_bytes(samples, epochs, num_sequences), host_memory_bytes()
    if need > have:
        raise DataError(f"{name}: {samples} samples take {epochs} epochs over the split, index arrays of at "
                        f"least {need / 2**30:.1f} GiB, more than this host's {have / 2**30:.1f} GiB of memory "
                        f"(fewer steps, a smaller global batch, or more data)")


def build_indices(sequence_lengths: np.ndarray, indices: np.ndarray, seq_length: int,
                  num_samples: Optional[int], seed: int, add_extra_token: bool = True,
                  drop_last: bool = True, name: str = "dataset", exact: bool = False):
    """(document_index, sample_index, shuffle_index) for one split, as Megatron builds them."""
    add = int(bool(add_extra_token))
    tokens = int(sequence_lengths[indices].sum(dtype=np.int64)) if len(indices) else 0
    check_enough_tokens(tokens, seq_length, add, num_samples, drop_last, name)
    epochs = num_epochs(tokens, num_samples, seq_length, add)
    check_index_fits(len(indices), epochs, num_samples, name)
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens - add) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens - add) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    doc = build_document_index(indices, epochs, rng, separate)
    sample = build_sample_index(sequence_lengths, doc, seq_length, epochs, tokens,
                                drop_last, add, exact)
    n = sample.shape[0] - 1
    shuffle = build_shuffle_index(sans_final if separate else n, n, rng)
    return doc, sample, shuffle


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


def _found_bounds(desc: dict, split: str):
    """The book-ends of split `split` recorded in a description: Megatron's `split_matrix`
    (null with `blend_per_split`: the whole dataset), else our `split` string."""
    if "split_matrix" in desc:
        m = desc["split_matrix"]
        return (0.0, 1.0) if m is None else m[SPLITS.index(split)]
    return split_bounds(desc.get("split"), split)


def _mismatches(desc: dict, want: dict, split: str, num_sequences: int) -> list[str]:
    """'field: requested X, found Y' for every field of a prebuilt index's description that
    differs from the request (the split compared by the sequence range it selects)."""
    out = [f"{k}: requested {want[k]}, found {desc.get(k)}"
           for k in ("sequence_length", "random_seed", "num_samples") if desc.get(k) != want[k]]
    try:
        found = bounds_range(num_sequences, _found_bounds(desc, split))
    except (ValueError, TypeError, IndexError):
        found = None
    wanted = bounds_range(num_sequences, split_bounds(want["split"], split))
    if found != wanted:
        out.append(f"split: requested {want['split']!r} ({split} = sequences "
                   f"[{wanted[0]}, {wanted[1]})), found {desc.get('split')!r}"
                   + (f" (sequences [{found[0]}, {found[1]}))" if found else ""))
    for k in ("add_extra_token", "drop_last"):  # in our own descriptions only
        if k in desc and bool(desc[k]) != bool(want[k]):
            out.append(f"{k}: requested {bool(want[k])}, found {bool(desc[k])}")
    return out


def same_dir(a: Optional[str], b: Optional[str]) -> bool:
    """Whether a and b name one existing directory (then blend_index_dir is also the cache)."""
    return bool(a and b and os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b))


def rebuildable(source: str, base: str, index_dir: Optional[str], cache_dir: Optional[str]) -> bool:
    """Whether a damaged index set may be rebuilt: it is in our cache, found there by its hash
    (`source` "cache"), or written by us in a blend_index_dir that is also the cache."""
    return source == "cache" or (same_dir(index_dir, cache_dir) and index_cache.ours(base))


def _find_prebuilt(index_dir: Optional[str], dataset_path: str, split: str, want: dict,
                   num_sequences: int, strict: bool = True) -> Optional[str]:
    """Base path `{dir}/{md5}-GPTDataset-{split}` of the prebuilt indices (Megatron's or ours)
    for this dataset and request; None when the directory has none for this dataset. Raises
    a DataError naming the differing fields when it has some, but none for this request
    (unless not `strict`)."""
    found = []
    for base, desc in megatron_descriptions(index_dir, "GPTDataset", split):
        path = str(desc.get("dataset_path"))
        if path == dataset_path or os.path.basename(path) == os.path.basename(dataset_path):
            diff = _mismatches(desc, want, split, num_sequences)
            if not diff:
                return base
            found.append((len(diff), base, diff))
    if not found or not strict:
        return None
    _, base, diff = min(found)
    raise DataError(
        f"{base}-description.txt: the prebuilt GPTDataset {split} indices for {dataset_path} "
        f"do not match this request ({len(found)} candidate(s) in {index_dir}; the closest "
        f"differs in {'; '.join(diff)}). Point blend_index_dir at indices built for this "
        f"request, or set it to '' to build them")


class GPTDataset:
    """Samples of `seq_length + add` tokens from one split of an IndexedDataset.

    `dataset[i]` returns int64 tokens (a keep-partial sample filled with `pad_id` past its
    real length; `read` gives that length). `data_split` None takes the whole dataset (a
    per-split blend). With `vocab_size`, every read checks the token ids and raises a
    DataError naming file, sequence and offset of one outside [0, vocab_size). Indices are
    loaded from prebuilt `.npy` in `index_dir` when it has a set for this dataset (which must
    match the request, unless `index_dir` is also `cache_dir`), else from / to our cache in
    `cache_dir`, else built in memory; loaded sets are verified first (`index_cache`).
    """

    def __init__(self, dataset: IndexedDataset, split: str = "train",
                 data_split: Optional[str] = "1,0,0", seq_length: int = 2048,
                 num_samples: Optional[int] = None, seed: int = 1234,
                 add_extra_token: bool = True, drop_last: bool = True,
                 cache_dir: Optional[str] = None, index_dir: Optional[str] = None,
                 pad_id: int = -1, vocab_size: Optional[int] = None,
                 exact_sample_count: bool = False):
        self.dataset = dataset
        self.split = split
        self.seq_length = int(seq_length)
        self.add = int(bool(add_extra_token))
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self._id_limit = None  # (unsigned view, limit, whether any id can fail), on first use
        self.num_samples = num_samples
        beg, end = split_range(len(dataset), data_split, split)
        name = f"{dataset.prefix} ({split} split, sequences [{beg}, {end}))"
        tokens = int(dataset.sequence_lengths[beg:end].sum(dtype=np.int64))
        check_enough_tokens(tokens, self.seq_length, self.add, num_samples, drop_last, name)
        epochs = num_epochs(tokens, num_samples, self.seq_length, self.add)
        check_index_fits(end - beg, epochs, num_samples, name)
        request = {"sequence_length": self.seq_length, "random_seed": seed,
                   "num_samples": num_samples, "split": data_split,
                   "add_extra_token": self.add, "drop_last": drop_last}
        self.description = json.dumps({
            "class": "GPTDataset", "dataset_path": dataset.prefix, "num_samples": num_samples,
            "index_split": split, "random_seed": seed, "sequence_length": self.seq_length,
            "split": data_split, "split_range": [beg, end], "add_extra_token": self.add,
            "drop_last": drop_last, "exact_sample_count": exact_sample_count,
            "num_sequences": len(dataset),
        }, indent=4)
        self.hash = hashlib.md5(self.description.encode()).hexdigest()

        base = _find_prebuilt(index_dir, dataset.prefix, split, request, len(dataset),
                              strict=not same_dir(index_dir, cache_dir))
        self.source = "megatron"
        if base is None and cache_dir:
            base = os.path.join(cache_dir, f"{self.hash}-GPTDataset-{split}")
            self.source = "cache"
        names = ("document_index", "sample_index", "shuffle_index")
        loaded = None if base is None else index_cache.load(
            base, names, rebuild=rebuildable(self.source, base, index_dir, cache_dir))
        if loaded is not None:
            doc, sample, shuffle = loaded
            self._check_loaded(base, doc, sample, shuffle, beg, end)
            want_n = sample_count(epochs * tokens, self.seq_length, self.add, drop_last,
                                  exact_sample_count)
            if doc.shape[0] != epochs * (end - beg) or sample.shape[0] - 1 != want_n:
                raise DataError(
                    f"{base}-*.npy: {sample.shape[0] - 1} samples over {doc.shape[0]} "
                    f"document-index entries, but this request (num_samples={num_samples}, "
                    f"add_extra_token={bool(self.add)}, drop_last={drop_last}"
                    + ("" if drop_last else f", exact_sample_count={exact_sample_count}")
                    + f") makes {want_n} over {epochs} epoch(s) of {end - beg} sequences: "
                    f"the indices were built for another request")
        else:
            self.source = "built"
            doc, sample, shuffle = build_indices(
                dataset.sequence_lengths, np.arange(beg, end, dtype=np.int64), self.seq_length,
                num_samples, seed, add_extra_token, drop_last, name=name,
                exact=exact_sample_count)
            if cache_dir:
                os.makedirs(cache_dir, exist_ok=True)
                index_cache.save(os.path.join(cache_dir, f"{self.hash}-GPTDataset-{split}"),
                                 dict(zip(names, (doc, sample, shuffle))), self.description)
        self.document_index, self.sample_index, self.shuffle_index = doc, sample, shuffle
        # Samples before n_full are full; later ones (keep-partial) may be short.
        self.n_full = min(len(sample) - 1, (epochs * tokens - self.add) // self.seq_length)
        if self.source != "built":  # loaded: check every sample now, not mid-run
            self._check_all()
        if num_samples is not None and len(self) < num_samples:
            raise DataError(f"{dataset.prefix}: {len(self)} samples < requested {num_samples}")

    def _check_loaded(self, base, doc, sample, shuffle, beg, end) -> None:
        if sample.ndim != 2 or sample.shape[1] != 2 or shuffle.shape[0] != sample.shape[0] - 1:
            raise DataError(f"{base}-*.npy: inconsistent shapes: sample_index {sample.shape}, "
                            f"shuffle_index {shuffle.shape}")
        if doc.size and (int(doc.min()) < beg or int(doc.max()) >= end):
            raise DataError(f"{base}-document_index.npy: sequence ids outside the split "
                            f"[{beg}, {end})")
        if shuffle.size and int(shuffle.max()) >= shuffle.shape[0]:
            raise DataError(f"{base}-shuffle_index.npy: entry >= {shuffle.shape[0]}")
        if int(sample[:, 0].max()) >= doc.shape[0] or int(sample[:, 0].min()) < 0:
            raise DataError(f"{base}-sample_index.npy: position outside the document index "
                            f"[0, {doc.shape[0]})")
        if shuffle.size and int(shuffle.min()) < 0:
            raise DataError(f"{base}-shuffle_index.npy: negative entry")

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sample(int(self.shuffle_index[i]))

    def samples(self, ids, dtype=np.int64) -> np.ndarray:
        """dataset[i] for every i in `ids` as one [len(ids), seq_length + add] array."""
        return self.read(ids, dtype)[0]

    def read(self, ids, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [len(ids), seq_length + add], real lengths [len(ids)] int32) of dataset[i]
        for every i in `ids`; tokens past a sample's real length are `pad_id`."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        got, totals = self._read(np.asarray(self.shuffle_index[ids], dtype=np.int64), dtype)
        return got, totals.astype(np.int32)

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
        if self._outside(got):
            self._raise_bad_id(j, got)
        if got.size == want:
            return got.astype(dtype, copy=False)
        out = np.full(want, self.pad_id, dtype=dtype)  # a keep-partial sample
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
        that does not fit, and `_raise_bad_id`'s for a token id outside the vocabulary."""
        ds, totals = self.dataset, np.empty(js.size, np.int64)
        rc = gather.gather_samples(ds._bin, CODES[ds.dtype], ds.dtype.itemsize,
                                   ds.sequence_pointers, ds.sequence_lengths,
                                   self.document_index, self.sample_index, self.n_full, js,
                                   self.add, self.seq_length + self.add, out, totals,
                                   self.vocab_size if out is not None else None)
        if rc is not None and rc > 0:
            self._check(js[rc - 1:rc])
            raise DataError(f"{ds.prefix}: sample {js[rc - 1]} does not fit this dataset")
        if rc is not None and rc < 0:
            self._raise_bad_id(js[-rc - 1], out[-rc - 1, :totals[-rc - 1]])
        return None if rc is None else totals

    def _check(self, js: np.ndarray) -> None:
        """Raises DataError unless samples `js` read only inside their own sequences and each
        has seq_length + add tokens (fewer only past the last full sample, keep-partial)."""
        ds, want = self.dataset, self.seq_length + self.add
        n_pieces = self.sample_index[js + 1, 0] - self.sample_index[js, 0] + 1
        if js.size and int(n_pieces.min()) < 1:
            r = int(np.argmin(n_pieces))
            raise DataError(f"{ds.prefix}: sample {js[r]} ends at document-index position "
                            f"{self.sample_index[js[r] + 1, 0]} before it starts at "
                            f"{self.sample_index[js[r], 0]}")
        starts, ends, first, totals, (_, seqs, orig, size) = self._pieces(js)
        bad = np.flatnonzero((starts < orig) | (starts > ends) | (ends > orig + size))
        if bad.size:  # never read outside the sequence a piece belongs to
            k = int(bad[0])
            raise DataError(
                f"{ds.prefix}: sample {js[np.searchsorted(first, k, 'right') - 1]} reads tokens "
                f"[{starts[k] - orig[k]}, {ends[k] - orig[k]}) of sequence {seqs[k]} of length "
                f"{size[k]}: the sample index does not fit this dataset")
        bad = np.flatnonzero((totals > want) | ((totals < want) & (js < self.n_full)))
        if bad.size:
            raise DataError(f"{ds.prefix}: sample {js[bad[0]]} has {totals[bad[0]]} tokens, "
                            f"want {want}: the sample index does not fit this dataset")

    def _outside(self, tokens: np.ndarray) -> bool:
        """Whether any of `tokens` (the `.bin`'s dtype) lies outside [0, vocab_size); False
        without a vocab_size."""
        v = self.vocab_size
        if v is None or not tokens.size:
            return False
        if tokens.dtype.kind not in "iu":
            return not bool(((tokens >= 0) & (tokens < v)).all())
        if self._id_limit is None:
            dt = tokens.dtype
            # One max over the ids read as unsigned: a negative one reads as >= 2^(bits - 1).
            top = np.iinfo(dt).max + 1 if dt.kind == "u" else 1 << (8 * dt.itemsize - 1)
            self._id_limit = (np.dtype(f"u{dt.itemsize}"), min(v, top), v < top or dt.kind == "i")
        view, lim, needed = self._id_limit
        return needed and bool(tokens.view(view).max() >= lim)

    def _raise_bad_id(self, j: int, tokens: np.ndarray) -> None:
        """DataError for the first id outside the vocabulary in `tokens`, pre-shuffle sample
        j's real tokens: the `.bin`, sequence, document, offset and id."""
        ds, v = self.dataset, self.vocab_size
        vals = tokens.astype(np.float64)
        c = int(np.flatnonzero(~((vals >= 0) & (vals < v)))[0])
        starts, ends, _, _, (_, seqs, orig, _) = self._pieces(np.array([j], np.int64))
        before = np.cumsum(ends - starts) - (ends - starts)
        k = int(np.searchsorted(before, c, "right")) - 1
        at = int(starts[k]) + c - int(before[k])
        seq = int(seqs[k])
        doc = int(np.searchsorted(ds.document_indices, seq, "right")) - 1
        value = tokens[c].item()
        raise DataError(
            f"{ds.prefix}.bin: token id {value} at sequence {seq} (document {doc}), token "
            f"offset {at - int(orig[k])} (byte {at * ds.dtype.itemsize}) is outside the "
            f"vocabulary [0, vocab_size={v}) (read for sample {j} of the {self.split} split)")

    def _read(self, js: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
        """Pre-shuffle samples `js` (valid ids) as ([len(js), seq_length + add] `dtype`
        tokens, int64 real lengths). The native gather checks every piece (and with a
        vocab_size every id) as it copies; the numpy fallback relies on the sample index having
        been checked against the dataset when it was loaded, and checks ids after the copy."""
        ds, want = self.dataset, self.seq_length + self.add
        got = np.empty((js.size, want), ds.dtype)
        totals = self._gather(js, got)
        native = totals is not None
        if not native:
            starts, ends, _, totals, _ = self._pieces(js)
            flat = self._join((np.stack((starts, ends), axis=1).ravel() * ds.dtype.itemsize).tolist())
            if flat.size == got.size:
                got = flat.reshape(got.shape)
            else:
                got[np.arange(want) < totals[:, None]] = flat
        short = totals != want
        if short.any():  # keep-partial samples
            tail = np.arange(want) >= totals[:, None]
            if not native:
                got[tail] = 0
        if not native and self._outside(got):
            r = next(r for r in range(js.size) if self._outside(got[r, :totals[r]]))
            self._raise_bad_id(js[r], got[r, :totals[r]])
        if short.any():
            got = got.astype(dtype)
            got[tail] = self.pad_id
        return got.astype(dtype, copy=False), totals

    def _join(self, bounds: list) -> np.ndarray:
        """Bytes [b[0], b[1]), [b[2], b[3]), ... of the `.bin`, concatenated, as tokens: one
        `bytearray.join` of memoryview slices of the mmap, so every piece is copied in C."""
        mv = memoryview(self.dataset._bin).cast("B")
        it = iter(bounds)
        return np.frombuffer(bytearray().join(map(mv.__getitem__, map(slice, it, it))), dtype=self.dataset.dtype)
