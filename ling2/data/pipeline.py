"""Grain input pipeline over Megatron samples: source -> transforms -> per-host batches.

A sample is `max_target_length + add` token ids and its real length (shorter only for a
keep-partial last sample). A grain record is one host batch, read in one vectorised pass;
the decoupled transforms (which work on one sample or a batch) turn text [b, S + add] into
  inputs, targets, positions, segment_ids: [b, S] int32;  loss_weights: [b, S] float32,
as Megatron's `GPTDataset.__getitem__`: the pad id is `megatron_pad_id` (-1 when there is
none or it collides with EOD/BOS), it fills every position past the real length, and then
inputs/targets equal to it become 0 and targets equal to it get loss weight 0. Segment ids
come from EOD positions only (padding, known by position, gets 0), never from the pad id.
Global batch t is samples [t*B, (t+1)*B) of the (already shuffled) Megatron order; host p of
P reads the contiguous slice [t*B + p*b, t*B + (p+1)*b), b = B/P, as Megatron's
data-parallel sampler. Iterators are grain's, so `get_state`/`set_state` resume exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import grain
import numpy as np

from ling2.data.blend import build_splits
from ling2.data.errors import DataError
from ling2.data.gpt_index import SPLITS

SAMPLE_DIR = Path(os.path.abspath(__file__)).parents[2] / "data" / "sample"  # runfiles under Bazel


def sample_prefix() -> str:
    """The bundled sample corpus (.bin/.idx prefix), from the repo or Bazel runfiles."""
    return str(SAMPLE_DIR / "sample_text_document")


def sample_tokenizer() -> str:
    return str(SAMPLE_DIR / "tokenizer.json")


def read_samples(dataset, ids) -> tuple[np.ndarray, np.ndarray]:
    """([len(ids), S + add] int32 samples, [len(ids)] int32 real lengths); batched when the
    dataset supports it (GPTDataset, BlendedDataset), else every sample is full."""
    if hasattr(dataset, "read"):
        return dataset.read(ids, np.int32)
    text = np.stack([np.asarray(dataset[int(i)], dtype=np.int32) for i in ids])
    return text, np.full(len(text), text.shape[-1], np.int32)


def megatron_pad_id(pad_id: int, eod_id: int, bos_id: int = -1) -> int:
    """The pad id the pipeline uses, as Megatron's MegatronDataset: `pad_id`, or -1 when there
    is none (< 0) or it equals another special id (EOD, BOS), with a warning: then pad tokens
    already in the data are trained on like any token."""
    if pad_id < 0:
        return -1
    if pad_id in (eod_id, bos_id):
        warnings.warn(f"pad_id {pad_id} equals the EOD/BOS id: pad tokens in the data are not "
                      "masked; padding uses -1 (as Megatron)")
        return -1
    return pad_id


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
    """Record t = this host's share of global batch t: {"text": int32 [B/P, S + add],
    "length": int32 [B/P] real tokens per sample}.

    The share is Megatron's contiguous data-parallel slice of samples [t*B, (t+1)*B).
    """

    def __init__(self, dataset, global_batch: int, process_index: int = 0,
                 process_count: int = 1):
        if global_batch < 1:
            raise DataError(f"the global batch size is {global_batch}: it must be >= 1")
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
        text, length = read_samples(self.dataset, np.arange(first, first + self.local))
        return {"text": text, "length": length}


def _real(x: dict, width: int) -> np.ndarray:
    """[..., width] bool: positions before the sample's real length (all without a length)."""
    text = x["text"]
    if "length" not in x:
        return np.ones(text.shape[:-1] + (width,), bool)
    return np.arange(width) < np.asarray(x["length"])[..., None]


@dataclasses.dataclass
class AddBos(grain.transforms.Map):
    """Inserts bos_id after every EOD (a document starting inside the sample); keeps the length
    (a BOS after the last real token is not real)."""

    bos_id: int
    eod_id: int

    def _row(self, text, n):
        at = np.flatnonzero(text[:n - 1] == self.eod_id) + 1
        return (np.insert(text, at, self.bos_id)[: text.size] if at.size else text,
                min(text.size, n + at.size))

    def map(self, x: dict) -> dict:
        text = x["text"]
        flat = text.reshape(-1, text.shape[-1])
        n = np.broadcast_to(x.get("length", text.shape[-1]), text.shape[:-1]).reshape(-1)
        rows, lengths = zip(*(self._row(r, int(k)) for r, k in zip(flat, n)))
        out = {**x, "text": np.stack(rows).reshape(text.shape)}
        if "length" in x:
            out["length"] = np.array(lengths, np.int32).reshape(np.shape(x["length"]))
        return out


@dataclasses.dataclass
class GenerateDocSegmentIds(grain.transforms.Map):
    """segment_ids [..., S]: with reset_attention_mask, 1 + number of EODs before the position
    in the inputs (an EOD belongs to the document it ends); else all 1. Positions past the
    sample's real length (padding) get 0."""

    eod_id: int
    reset_attention_mask: bool
    add_extra_token: bool = True

    def map(self, x: dict) -> dict:
        text = x["text"]
        inputs = text[..., :-1] if self.add_extra_token else text
        if self.reset_attention_mask:
            is_eod = (inputs == self.eod_id).astype(np.int32)
            seg = np.cumsum(is_eod, axis=-1, dtype=np.int32) - is_eod + 1
        else:
            seg = np.ones(inputs.shape, np.int32)
        seg[~_real(x, inputs.shape[-1])] = 0
        return {**x, "segment_ids": seg}


@dataclasses.dataclass
class SplitInputsTargets(grain.transforms.Map):
    """text [..., S + add] -> inputs, targets, positions, loss_weights [..., S], as Megatron's
    GPTDataset.__getitem__ with pad id `pad_id` (already `megatron_pad_id`).

    Positions past the real length are set to pad_id; targets are text shifted by one
    (without the extra token the last target is pad_id); positions restart after each EOD with
    reset_position_ids; loss_weights are 0 where the input is EOD (eod_mask_loss) and where
    the target is pad_id; inputs and targets equal to pad_id become 0.
    """

    eod_id: int
    pad_id: int = -1
    eod_mask_loss: bool = False
    reset_position_ids: bool = True
    add_extra_token: bool = True

    def map(self, x: dict) -> dict:
        text = np.where(_real(x, x["text"].shape[-1]), x["text"], self.pad_id)
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
        w[targets == self.pad_id] = 0.0
        inputs[inputs == self.pad_id] = 0
        targets[targets == self.pad_id] = 0
        out = {k: v for k, v in x.items() if k not in ("text", "length")}
        out.update(inputs=inputs.astype(np.int32), targets=targets.astype(np.int32),
                   positions=pos, loss_weights=w)
        return out


def transforms(eod_id: int, pad_id: int = -1, bos_id: int = -1, add_bos: bool = False,
               reset_attention_mask: bool = True, reset_position_ids: bool = True,
               eod_mask_loss: bool = False, add_extra_token: bool = True) -> list:
    """The record -> model-batch transforms; every pad rule lives here (`megatron_pad_id`
    once, then `SplitInputsTargets`)."""
    pad = megatron_pad_id(pad_id, eod_id, bos_id)
    out = []
    if add_bos and bos_id >= 0:
        out.append(AddBos(bos_id, eod_id))
    out.append(GenerateDocSegmentIds(eod_id, reset_attention_mask, add_extra_token))
    out.append(SplitInputsTargets(eod_id, pad, eod_mask_loss, reset_position_ids,
                                  add_extra_token))
    return out


PREFETCH_BYTES = 256 * 2**20  # host memory the read-ahead of batches may hold


def read_options(batch_bytes: int) -> grain.ReadOptions:
    """Grain's read-ahead sized by bytes, not batches: as many batches as fit in PREFETCH_BYTES (at least 2,
    at most 16). Grain's default of 500 batches ahead would hold 500 x 40 MiB for 8 rows of 128K tokens."""
    ahead = int(min(16, max(2, PREFETCH_BYTES // max(batch_bytes, 1))))
    return grain.ReadOptions(num_threads=min(ahead, 16), prefetch_buffer_size=ahead)


def make_iterator(dataset, global_batch: int, ops: Sequence, process_index: int = 0,
                  process_count: int = 1, worker_count: int = 0):
    """Checkpointable iterator of this host's batches: dict of [global_batch / P, S] arrays.

    `dataset`: anything with len() and [i] -> tokens (GPTDataset, BlendedDataset, ...). The read-ahead
    holds at most `PREFETCH_BYTES` of batches (`read_options`), whatever the sequence length.
    """
    host = HostBatches(dataset, global_batch, process_index, process_count)
    if len(host) == 0:
        raise DataError(f"{len(dataset)} samples make no global batch of {global_batch}")
    width = len(dataset[0]) if not hasattr(dataset, "read") else dataset.read(np.arange(1), np.int32)[0].shape[-1]
    batch_bytes = host.local * width * 4 * 6  # the text and the five [b, S] arrays made from it
    ds = grain.MapDataset.source(host)
    for op in ops:
        ds = ds.map(op)
    ds = ds.to_iter_dataset(read_options(batch_bytes))
    if worker_count > 0:
        from absl import flags
        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags (no absl app here)
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count),
                            worker_init_fn=functools.partial(end_with_parent, os.getpid()))
    return iter(ds)


def end_with_parent(parent: int, *worker) -> None:
    """Runs first in each grain worker process: a thread ends the process once its parent has ended, however that
    ended (kill -9 included). Grain's workers otherwise outlive the trainer, holding its stdout open."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="end_with_parent", daemon=True).start()


def split_sample_counts(config, num_devices: int) -> list[int]:
    """Samples per split, as Megatron: train steps*B, valid (steps//interval + 1)*eval*B,
    test eval*B."""
    gbs = config.global_batch_size(num_devices)
    evals = (config.steps // config.eval_interval + 1) * config.eval_steps if \
        config.eval_interval else config.eval_steps
    return [config.steps * gbs, evals * gbs, config.eval_steps * gbs]


def datasets_from_config(config, num_devices: int, splits: Sequence[str] = SPLITS) -> list:
    """[train, valid, test] (None where empty or not in `splits`) from Ling2's data settings."""
    if not config.data_path and not config.blend_per_split:
        raise DataError("data_path is empty: set it to a .bin/.idx prefix or "
                        "'w1 prefix1 w2 prefix2 ...' (or set blend_per_split)")
    for field in ("blend_cache_dir", "blend_index_dir"):
        path = getattr(config, field)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise DataError(f"{field}: {path} is a file, not a directory")
    counts = split_sample_counts(config, num_devices)
    return build_splits(config.data_path, config.data_split, config.max_target_length,
                        counts, seed=config.data_seed,
                        add_extra_token=config.add_extra_token_to_sequence,
                        drop_last_valid=config.drop_last_partial_validation_sequence,
                        cache_dir=config.blend_cache_dir or None,
                        index_dir=config.blend_index_dir or None, splits=splits,
                        vocab_size=config.vocab_size,
                        exact_sample_count=config.exact_sample_count,
                        blend_per_split=config.blend_per_split or None)


def make_data_iterator(config, num_devices: int, split: str = "train",
                       process_index: Optional[int] = None,
                       process_count: Optional[int] = None, dataset=None):
    """This host's batch iterator for `split` (global batch = config.global_batch_size)."""
    if process_index is None or process_count is None:
        import jax
        process_index, process_count = jax.process_index(), jax.process_count()
    gbs = config.global_batch_size(num_devices)
    if gbs < 1:
        raise DataError(
            f"the global batch size is 0: per_device_batch_size={config.per_device_batch_size} "
            f"x {num_devices} device(s) = {config.per_device_batch_size * num_devices} "
            f"sequences per micro-batch, which rounds down to 0; raise per_device_batch_size")
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
            where = (f"blend_per_split has no {split} blend" if config.blend_per_split else
                     f"data_split {config.data_split!r} leaves the {split} split empty")
            raise DataError(where)
    ops = transforms(config.eod_id, config.pad_id, config.bos_id, config.add_bos,
                     config.reset_attention_mask, config.reset_position_ids,
                     config.eod_mask_loss, config.add_extra_token_to_sequence)
    return make_iterator(dataset, gbs, ops, process_index, process_count,
                         config.grain_worker_count)
