"""Perplexity of a Ling2Model on Megatron data: token-averaged next-token cross-entropy over the
first `max_batches` global batches of a split, overall and per blend component.

The batches are the trainer's (the same split, sample order, transforms and loss weights:
`ling2.data.pipeline` with the checkpoint's data settings, the split sized for `max_batches`
evaluations as Megatron sizes it, so more batches than one pass repeat samples), so with the
trainer's config and `max_batches = eval_steps` the loss is the trainer's eval_loss
(`ling2.train.eval.Evaluator`).
Sample i of a blend comes from component dataset_index[i], which is how rows are attributed.
"""

import math

import jax
import numpy as np
from flax import nnx

from ling2.data import gpt_index, pipeline
from ling2.data.blend import BlendedDataset, parse_data_path
from ling2.data.errors import DataError
from ling2.data.gpt_index import SPLITS
from ling2.infer.load import InferError
from ling2.layers import losses
from ling2.train.data import resolve_data_path


def _row_sums(graphdef, state, mb):
    """Per row: (CE sum, loss-weight sum) [b] each, fp32."""
    model = nnx.merge(graphdef, state)
    out = model(mb["inputs"], mb["positions"], mb["segment_ids"], mb["segment_ids"] != 0)
    per_row = jax.vmap(lambda lg, t, w: losses.cross_entropy_sums(lg[None], t[None], w[None])[:2])
    return per_row(out.logits, mb["targets"], mb["loss_weights"])


def check_fits(cfg, n: int, split: str) -> None:
    """InferError naming --max_batches when the split sized for `n` batches (as the trainer sizes it) needs
    index arrays larger than this host's memory, found before any is built."""
    gbs = cfg.global_batch_size(1)
    samples = pipeline.split_sample_counts(cfg.model_copy(update={"eval_steps": n}), 1)[SPLITS.index(split)]
    need, have = gpt_index.min_index_bytes(samples), gpt_index.host_memory_bytes()
    if need > have:
        raise InferError(f"--max_batches={n}: {n} batches of {gbs} sequences size the {split} split at {samples} "
                         f"samples, index arrays of at least {need / 2**30:.1f} GiB, more than this host's "
                         f"{have / 2**30:.1f} GiB of memory")


def evaluate(model, cfg, data_path: str, find_file, split: str = "valid", max_batches: int | None = None,
             log=lambda s: None) -> dict:
    """{"loss", "perplexity", "tokens", "batches", "split", "data_path", "components": [...]}: loss is
    the mean CE per loss-weighted token, perplexity exp(loss); each component the same over its rows."""
    if split not in SPLITS:
        raise InferError(f"--split={split!r}: one of {SPLITS}")
    n = cfg.eval_steps if max_batches is None else max_batches
    if n < 1:
        raise InferError(f"--max_batches={n}: must be >= 1")
    check_fits(cfg, n, split)
    try:
        prefixes, weights = parse_data_path(data_path)
        resolved = resolve_data_path(data_path, find_file)
        cfg = cfg.model_copy(update={"data_path": resolved, "dataset_type": "mmap", "eval_steps": n})
        dataset = pipeline.datasets_from_config(cfg, 1, [split])[SPLITS.index(split)]
        if dataset is None:
            raise ValueError(f"data_split {cfg.data_split!r} leaves the {split} split empty")
        it = pipeline.make_data_iterator(cfg, 1, split, process_index=0, process_count=1, dataset=dataset)
    except (ValueError, OSError) as e:
        raise InferError(f"data ({split} split, --data_path={data_path!r}): {e}") from e
    gbs, b = cfg.global_batch_size(1), cfg.micro_batch_size(1)
    which = (np.asarray(dataset.dataset_index, np.int64) if isinstance(dataset, BlendedDataset)
             else np.zeros(len(dataset), np.int64))
    graphdef, state = nnx.split(model)
    sums = jax.jit(lambda state, mb: _row_sums(graphdef, state, mb))
    C = len(prefixes)
    ce, tok = np.zeros(C), np.zeros(C)
    for t in range(n):
        try:
            batch = next(it)
        except (DataError, OSError) as e:  # found as the batch is read: a token id outside the vocabulary, I/O
            raise InferError(f"data ({split} split, --data_path={data_path!r}), batch {t + 1}: {e}") from e
        rows = which[t * gbs:(t + 1) * gbs]
        for m in range(0, gbs, b):
            mb = {k: np.asarray(v)[m:m + b] for k, v in batch.items()}
            s, w = (np.asarray(x, np.float64) for x in sums(state, mb))
            np.add.at(ce, rows[m:m + b], s)
            np.add.at(tok, rows[m:m + b], w)
        log(f"batch {t + 1}/{n}: loss so far {ce.sum() / max(tok.sum(), 1):.4f}")

    def summary(c, n_tok):
        loss = c / max(n_tok, 1.0)
        return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": n_tok}

    out = {"split": split, "data_path": data_path, "batches": n, "batch_size": gbs,
           "seq_len": cfg.max_target_length, **summary(ce.sum(), tok.sum())}
    out["components"] = [{"prefix": p, "weight": None if weights is None else weights[i], **summary(ce[i], tok[i])}
                         for i, p in enumerate(prefixes)]
    return out
