"""Blending GPT datasets as Megatron-LM's BlendedDataset / BlendedMegatronDatasetBuilder.

Matches Megatron-LM commit d98e8a64 (2026-08-22):
  * weights w (normalised) and a size N per split: component i is built for
    ceil(ceil(N*w_i) * (1 + 0.005)) samples; the blend has sum_i ceil(N*w_i) samples (can
    exceed N); the greedy runs on the weights normalised a second time, as Megatron does.
  * no weights, size N: weights are the component lengths, size min(N, sum of lengths).
  * no weights, no size: exhaustive blending of every component sample.
  * a single prefix without a weight is a plain GPTDataset.
  * per-split blends (`blend_per_split`): each split has its own blend over whole datasets
    (no split string); a single prefix, weighted or not, is a plain GPTDataset.
Greedy: for sample s, x = max(s, 1); pick k maximising w_k*x - count_k (strict >, ties to the
lowest k); dataset_index[s] = k (int16), dataset_sample_index[s] = count_k (int64).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from ling2.data import index_cache
from ling2.data.errors import DataError
from ling2.data.gpt_index import (SPLITS, GPTDataset, megatron_descriptions, rebuildable,
                                  same_dir, split_matrix)
from ling2.data.indexed import IndexedDataset

SURPLUS = 0.005


def parse_data_path(data_path: str, field: str = "data_path") -> tuple[list[str], Optional[list[float]]]:
    """"0.3 /a 0.7 /b" -> (["/a", "/b"], [0.3, 0.7]); "/a /b" -> (["/a", "/b"], None)."""
    toks = data_path.split() if isinstance(data_path, str) else [str(t) for t in data_path]
    if not toks:
        raise ValueError(f"{field} is empty")

    def num(t):
        try:
            return float(t)
        except ValueError:
            return None

    nums = [num(t) for t in toks]
    if all(v is None for v in nums):
        return toks, None
    if len(toks) % 2 or any(v is None for v in nums[0::2]) or any(
            v is not None for v in nums[1::2]):
        raise ValueError(f"{field} {data_path!r}: expected 'weight prefix' pairs or only "
                         f"prefixes; got {len(toks)} items with weights and paths mismatched")
    weights, prefixes = [float(v) for v in nums[0::2]], toks[1::2]
    for i, w in enumerate(weights):
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"{field} {data_path!r}: weight {i} ({toks[2 * i]!r}) for "
                             f"{prefixes[i]} must be > 0")
    if not math.isfinite(sum(weights)):
        raise ValueError(f"{field} {data_path!r}: the weights sum past the largest float; scale them down")
    return prefixes, weights


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def component_sizes(weights: Sequence[float], size: int,
                    surplus: float = SURPLUS) -> tuple[list[int], list[int]]:
    """(target, built) samples per component for normalised weights and a blend size."""
    target = [int(math.ceil(size * w)) for w in weights]
    built = [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]
    return target, built


def build_blending_indices(weights: Sequence[float], size: int):
    """Megatron's greedy blend: (dataset_index int16, dataset_sample_index int64)."""
    w = [float(x) for x in weights]
    k = len(w)
    counts = [0] * k
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    di, si = memoryview(dataset_index), memoryview(sample_index)
    for s in range(size):
        x = max(float(s), 1.0)
        best, err = 0, w[0] * x - counts[0]
        for j in range(1, k):
            e = w[j] * x - counts[j]
            if e > err:
                best, err = j, e
        di[s] = best
        si[s] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]):
    """Every sample of every component, interleaved in proportion to the sizes."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    live = [j for j in range(len(sizes)) if sizes[j] > 0]
    dataset_index = np.zeros(total, dtype=np.int16)
    sample_index = np.zeros(total, dtype=np.int64)
    for s in range(total):
        x = max(float(s), 1.0)
        best, err = -1, -math.inf
        for j in live:
            e = w[j] * x - counts[j]
            if e > err:
                best, err = j, e
        dataset_index[s] = best
        sample_index[s] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            live.remove(best)
    return dataset_index, sample_index


def _find_prebuilt_blend(index_dir, prefixes, split, weights, size,
                         strict: bool = True) -> Optional[str]:
    """Base path of the prebuilt BlendedDataset indices for these datasets (by name), or None
    when there are none; a DataError naming the fields when they were built for another
    size or weights (unless not `strict`)."""
    names = [os.path.basename(p) for p in prefixes]
    found = []
    for base, desc in megatron_descriptions(index_dir, "BlendedDataset", split):
        try:
            paths = [os.path.basename(str(d["dataset_path"])) for d in desc["datasets"]]
        except (KeyError, TypeError):
            continue
        if paths != names:
            continue
        diff = []
        if desc.get("size") != size:
            diff.append(f"size: requested {size}, found {desc.get('size')}")
        got = desc.get("weights")
        try:
            same = len(got) == len(weights) and np.allclose(normalize(got), normalize(weights),
                                                            rtol=1e-9, atol=1e-12)
        except (TypeError, ValueError):
            same = False
        if not same:
            diff.append(f"weights: requested {list(weights)}, found {got}")
        if not diff:
            return base
        found.append((len(diff), base, diff))
    if not found or not strict:
        return None
    _, base, diff = min(found)
    raise DataError(
        f"{base}-description.txt: the prebuilt BlendedDataset {split} indices for {names} do "
        f"not match this request ({'; '.join(diff)}). Point blend_index_dir at indices built "
        f"for this request, or set it to '' to build them")


class BlendedDataset:
    """Samples drawn from several GPTDatasets by the greedy blend; `ds[i]` -> int64 tokens."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float],
                 size: Optional[int], split: str = "train", cache_dir: Optional[str] = None,
                 index_dir: Optional[str] = None):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"blend weights must be > 0, got {list(weights)}")
        if len(datasets) >= 32767:
            raise ValueError("at most 32766 datasets can be blended (int16 dataset index)")
        if size is not None:
            weights = normalize(weights)
        self.datasets, self.weights, self.size, self.split = list(datasets), weights, size, split
        self.description = json.dumps({
            "class": "BlendedDataset", "datasets": [json.loads(d.description) for d in datasets],
            "split": split, "weights": list(weights), "size": size}, indent=4)
        self.hash = hashlib.md5(self.description.encode()).hexdigest()
        names = ("dataset_index", "dataset_sample_index")
        base = _find_prebuilt_blend(index_dir, [d.dataset.prefix for d in datasets], split,
                                    weights, size, strict=not same_dir(index_dir, cache_dir))
        self.source = "megatron"
        if base is None and cache_dir:
            base = os.path.join(cache_dir, f"{self.hash}-BlendedDataset-{split}")
            self.source = "cache"
        loaded = None if base is None else index_cache.load(
            base, names, rebuild=rebuildable(self.source, base, index_dir, cache_dir))
        if loaded is not None:
            self.dataset_index, self.dataset_sample_index = loaded
        else:
            self.source = "built"
            if size is not None:
                di, dsi = build_blending_indices(weights, size)
            else:
                if any(w != int(w) for w in weights):
                    raise ValueError("blending without a size needs integer weights (sizes)")
                di, dsi = build_exhaustive_blending_indices(weights)
            self.dataset_index, self.dataset_sample_index = di, dsi
            if cache_dir:
                os.makedirs(cache_dir, exist_ok=True)
                index_cache.save(os.path.join(cache_dir, f"{self.hash}-BlendedDataset-{split}"),
                                 dict(zip(names, (di, dsi))), self.description)
        counts = np.bincount(np.asarray(self.dataset_index, dtype=np.int64),
                             minlength=len(datasets))
        for k, (c, d) in enumerate(zip(counts, datasets)):
            if c > len(d):
                raise DataError(f"the {split} blend draws {c} samples from dataset {k} "
                                 f"({d.dataset.prefix}) which has only {len(d)}")

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def samples(self, ids, dtype=np.int64) -> np.ndarray:
        """[len(ids), S + add]: each component's samples read in one batched call."""
        return self.read(ids, dtype)[0]

    def read(self, ids, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [len(ids), S + add], real lengths [len(ids)] int32), as GPTDataset.read."""
        ids = np.asarray(ids, dtype=np.int64)
        which = np.asarray(self.dataset_index[ids], dtype=np.int64)
        local = np.asarray(self.dataset_sample_index[ids], dtype=np.int64)
        d0 = self.datasets[0]
        out = np.empty((ids.size, d0.seq_length + d0.add), dtype=dtype)
        lengths = np.empty(ids.size, np.int32)
        for k in np.unique(which).tolist():
            rows = which == k
            out[rows], lengths[rows] = self.datasets[k].read(local[rows], dtype)
        return out, lengths


def build_splits(data_path: str, data_split: str, seq_length: int,
                 num_samples: Sequence[Optional[int]], seed: int = 1234,
                 add_extra_token: bool = True, drop_last_valid: bool = True,
                 cache_dir: Optional[str] = None, index_dir: Optional[str] = None,
                 splits: Sequence[str] = SPLITS, vocab_size: Optional[int] = None,
                 exact_sample_count: bool = False,
                 blend_per_split: Optional[Sequence[str]] = None) -> list:
    """[train, valid, test] datasets (GPTDataset, BlendedDataset or None) as Megatron's builder.

    num_samples: requested samples per split (None: one pass / exhaustive). Only `splits` are
    built; a split asking for 0 samples is None (Megatron would still build it).
    blend_per_split: three data_path strings (train, valid, test; '' for none) used instead
    of `data_path` and `data_split`, as Megatron's `blend_per_split`.
    """
    low = {}

    def low_level(p):
        if p not in low:
            low[p] = IndexedDataset(p)
        return low[p]

    def gpt(p, split, n, frac):
        return GPTDataset(low_level(p), split, frac, seq_length, n, seed, add_extra_token,
                          drop_last=drop_last_valid if split == "valid" else True,
                          cache_dir=cache_dir, index_dir=index_dir, vocab_size=vocab_size,
                          exact_sample_count=exact_sample_count)

    def blended(prefixes, weights, split, n, frac):
        if weights is not None:
            if n is None:
                raise DataError(f"a blend with weights needs a sample count for the {split} "
                                f"split")
            target, built = component_sizes(weights, n)
            parts = [gpt(p, split, b, frac) for p, b in zip(prefixes, built)]
            return BlendedDataset(parts, weights, sum(target), split, cache_dir, index_dir)
        parts = [gpt(p, split, None, frac) for p in prefixes]
        lens = [len(d) for d in parts]
        size = None if n is None else min(n, sum(lens))
        return BlendedDataset(parts, lens, size, split, cache_dir, index_dir)

    out = []
    if blend_per_split:
        if len(blend_per_split) != len(SPLITS):
            raise ValueError(f"blend_per_split: want {len(SPLITS)} entries (train, valid, test; "
                             f"'' for none), got {len(blend_per_split)}")
        for i, split in enumerate(SPLITS):
            path = blend_per_split[i]
            if not path or not path.strip() or split not in splits or num_samples[i] == 0:
                out.append(None)
                continue
            prefixes, weights = parse_data_path(path, f"blend_per_split[{i}] ({split})")
            if len(prefixes) == 1:
                out.append(gpt(prefixes[0], split, num_samples[i], None))
            else:
                out.append(blended(prefixes, None if weights is None else normalize(weights),
                                   split, num_samples[i], None))
        return out

    prefixes, weights = parse_data_path(data_path)
    bounds = split_matrix(data_split)
    if weights is not None:
        weights = normalize(weights)
    for i, split in enumerate(SPLITS):
        if bounds[i] is None or split not in splits or num_samples[i] == 0:
            out.append(None)
        elif len(prefixes) == 1 and weights is None:
            out.append(gpt(prefixes[0], split, num_samples[i], data_split))
        else:
            out.append(blended(prefixes, weights, split, num_samples[i], data_split))
    return out
