"""Grain input pipeline over Megatron samples: source -> transforms -> per-host batches.

A sample is `max_target_length + add` token ids. A grain record is one host batch, read
in one vectorised pass; the decoupled transforms (which work on one sample or a batch)
turn text [b, S + add] into
  inputs, targets, positions, segment_ids: [b, S] int32;  loss_weights: [b, S] float32.
Global batch t is samples [t*B, (t+1)*B) of the (already shuffled) Megatron order; host p of
P reads the contiguous slice [t*B + p*b, t*B + (p+1)*b), b = B/P, as Megatron's
data-parallel sampler. Iterators are grain's, so `get_state`/`set_state` resume exactly.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence

import grain
import numpy as np

from ling2.data.blend import build_splits
from ling2.data.gpt_index import SPLITS

SAMPLE_DIR = Path(os.path.abspath(__file__)).parents[2] / "data" / "sample"  # runfiles under Bazel


def sample_prefix() -> str:
    """The bundled sample corpus (.bin/.idx prefix), from the repo or Bazel runfiles."""
    return str(SAMPLE_DIR / "sample_text_document")


def sample_tokenizer() -> str:
    return str(SAMPLE_DIR / "tokenizer.json")


def read_samples(dataset, ids) -> np.ndarray:
    """[len(ids), S + add] int32 samples; batched when the dataset supports it."""
    if hasattr(dataset, "samples"):
        return dataset.samples(ids, np.int32)
    return np.stack([np.asarray(dataset[int(i)], dtype=np.int32) for i in ids])


class SyntheticDataset:
    """Deterministic random samples (documents of random length ended by EOD), for benchmarks."""

    def __init__(self, num_samples: int, length: int, vocab_size: int, eod_id: int = 2,
                 mean_doc_length: int = 512, seed: int = 0):
        self.num_samples, self.length, self.vocab_size = num_samples, length, vocab_size
        self.eod_id, self.p_eod, self.seed = eod_id, 1.0 / max(1, mean_doc_length), seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(i)])
        text = rng.integers(3, self.vocab_size, size=self.length, dtype=np.int32)
        text[rng.random(self.length) < self.p_eod] = self.eod_id
        return text


class HostBatches(grain.sources.RandomAccessDataSource):
    """Record t = this host's share of global batch t: {"text": int32 [B/P, S + add]}.

    The share is Megatron's contiguous data-parallel slice of samples [t*B, (t+1)*B).
    """

    def __init__(self, dataset, global_batch: int, process_index: int = 0,
                 process_count: int = 1):
        if global_batch % process_count:
            raise ValueError(f"global batch {global_batch} is not divisible by "
                             f"{process_count} processes")
        self.dataset, self.global_batch = dataset, global_batch
        self.local = global_batch // process_count
        self.offset = process_index * self.local

    def __len__(self) -> int:
        return len(self.dataset) // self.global_batch

    def __getitem__(self, t: int) -> dict:
        first = int(t) * self.global_batch + self.offset
        return {"text": read_samples(self.dataset, np.arange(first, first + self.local))}


@dataclasses.dataclass
class AddBos(grain.transforms.Map):
    """Inserts bos_id after every EOD (a document starting inside the sample); keeps the length."""

    bos_id: int
    eod_id: int

    def _row(self, text):
        at = np.flatnonzero(text[:-1] == self.eod_id) + 1
        return np.insert(text, at, self.bos_id)[: text.size] if at.size else text

    def map(self, x: dict) -> dict:
        text = x["text"]
        rows = np.stack([self._row(r) for r in text.reshape(-1, text.shape[-1])])
        return {**x, "text": rows.reshape(text.shape)}


@dataclasses.dataclass
class GenerateDocSegmentIds(grain.transforms.Map):
    """segment_ids [..., S]: with reset_attention_mask, 1 + number of EODs before the position
    in the inputs (an EOD belongs to the document it ends); else all 1. Padding gets 0."""

    eod_id: int
    reset_attention_mask: bool
    pad_id: int = -1
    add_extra_token: bool = True

    def map(self, x: dict) -> dict:
        text = x["text"]
        inputs = text[..., :-1] if self.add_extra_token else text
        if self.reset_attention_mask:
            is_eod = (inputs == self.eod_id).astype(np.int32)
            seg = np.cumsum(is_eod, axis=-1, dtype=np.int32) - is_eod + 1
        else:
            seg = np.ones(inputs.shape, np.int32)
        if self.pad_id >= 0:
            seg[inputs == self.pad_id] = 0
        return {**x, "segment_ids": seg}


@dataclasses.dataclass
class SplitInputsTargets(grain.transforms.Map):
    """text [..., S + add] -> inputs, targets, positions, loss_weights [..., S] (Megatron's rules).

    targets are text shifted by one (without the extra token the last target is padding).
    positions restart after each EOD with reset_position_ids. loss_weights are 0 where the
    input is EOD (eod_mask_loss) and where the target is pad_id; pad ids become 0.
    """

    eod_id: int
    pad_id: int = -1
    eod_mask_loss: bool = False
    reset_position_ids: bool = True
    add_extra_token: bool = True

    def map(self, x: dict) -> dict:
        text = x["text"]
        if self.add_extra_token:
            inputs, targets = text[..., :-1].copy(), text[..., 1:].copy()
        else:
            inputs, targets = text.copy(), np.roll(text, -1, axis=-1)
            targets[..., -1] = self.pad_id
        n = inputs.shape[-1]
        pos = np.broadcast_to(np.arange(n, dtype=np.int32), inputs.shape).copy()
        if self.reset_position_ids:
            starts = np.zeros(inputs.shape, np.int32)
            starts[..., 1:] = np.where(inputs[..., :-1] == self.eod_id, pos[..., 1:], 0)
            pos -= np.maximum.accumulate(starts, axis=-1)
        w = np.ones(inputs.shape, np.float32)
        if self.eod_mask_loss:
            w[inputs == self.eod_id] = 0.0
        if self.pad_id >= 0 or not self.add_extra_token:
            w[targets == self.pad_id] = 0.0
            inputs[inputs == self.pad_id] = 0
            targets[targets == self.pad_id] = 0
        out = {k: v for k, v in x.items() if k != "text"}
        out.update(inputs=inputs.astype(np.int32), targets=targets.astype(np.int32),
                   positions=pos, loss_weights=w)
        return out


def transforms(eod_id: int, pad_id: int = -1, bos_id: int = -1, add_bos: bool = False,
               reset_attention_mask: bool = True, reset_position_ids: bool = True,
               eod_mask_loss: bool = False, add_extra_token: bool = True) -> list:
    if pad_id >= 0 and pad_id in (eod_id, bos_id):
        warnings.warn(f"pad_id {pad_id} equals the EOD/BOS id: padding is not masked "
                      "(Megatron turns such a pad id into -1)")
        pad_id = -1
    out = []
    if add_bos and bos_id >= 0:
        out.append(AddBos(bos_id, eod_id))
    out.append(GenerateDocSegmentIds(eod_id, reset_attention_mask, pad_id, add_extra_token))
    out.append(SplitInputsTargets(eod_id, pad_id, eod_mask_loss, reset_position_ids,
                                  add_extra_token))
    return out


def make_iterator(dataset, global_batch: int, ops: Sequence, process_index: int = 0,
                  process_count: int = 1, worker_count: int = 0):
    """Checkpointable iterator of this host's batches: dict of [global_batch / P, S] arrays.

    `dataset`: anything with len() and [i] -> tokens (GPTDataset, BlendedDataset, ...).
    """
    host = HostBatches(dataset, global_batch, process_index, process_count)
    if len(host) == 0:
        raise ValueError(f"{len(dataset)} samples make no global batch of {global_batch}")
    ds = grain.MapDataset.source(host)
    for op in ops:
        ds = ds.map(op)
    ds = ds.to_iter_dataset()
    if worker_count > 0:
        from absl import flags
        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags (no absl app here)
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return iter(ds)


def split_sample_counts(config, num_devices: int) -> list[int]:
    """Samples per split, as Megatron: train steps*B, valid (steps//interval + 1)*eval*B,
    test eval*B."""
    gbs = config.global_batch_size(num_devices)
    evals = (config.steps // config.eval_interval + 1) * config.eval_steps if \
        config.eval_interval else config.eval_steps
    return [config.steps * gbs, evals * gbs, config.eval_steps * gbs]


def datasets_from_config(config, num_devices: int, splits: Sequence[str] = SPLITS) -> list:
    """[train, valid, test] (None where empty or not in `splits`) from Ling2's data settings."""
    if not config.data_path:
        raise ValueError("data_path is empty: set it to a .bin/.idx prefix or "
                         "'w1 prefix1 w2 prefix2 ...'")
    counts = split_sample_counts(config, num_devices)
    return build_splits(config.data_path, config.data_split, config.max_target_length,
                        counts, seed=config.data_seed,
                        add_extra_token=config.add_extra_token_to_sequence,
                        cache_dir=config.blend_cache_dir or None,
                        index_dir=config.blend_index_dir or None, pad_id=config.pad_id,
                        splits=splits)


def make_data_iterator(config, num_devices: int, split: str = "train",
                       process_index: Optional[int] = None,
                       process_count: Optional[int] = None, dataset=None):
    """This host's batch iterator for `split` (global batch = config.global_batch_size)."""
    if process_index is None or process_count is None:
        import jax
        process_index, process_count = jax.process_index(), jax.process_count()
    gbs = config.global_batch_size(num_devices)
    if config.dataset_type not in ("mmap", "synthetic"):
        raise ValueError(f"dataset_type {config.dataset_type!r}: want 'mmap' or 'synthetic'")
    if config.dataset_type == "synthetic":
        n = split_sample_counts(config, num_devices)[SPLITS.index(split)]
        dataset = SyntheticDataset(n, config.max_target_length +
                                   int(config.add_extra_token_to_sequence), config.vocab_size,
                                   config.eod_id, seed=config.data_seed)
    else:
        if dataset is None:
            dataset = datasets_from_config(config, num_devices, [split])[SPLITS.index(split)]
        if dataset is None:
            raise ValueError(f"data_split {config.data_split!r} leaves the {split} split empty")
    ops = transforms(config.eod_id, config.pad_id, config.bos_id, config.add_bos,
                     config.reset_attention_mask, config.reset_position_ids,
                     config.eod_mask_loss, config.add_extra_token_to_sequence)
    return make_iterator(dataset, gbs, ops, process_index, process_count,
                         config.grain_worker_count)
