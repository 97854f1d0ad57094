"""Random HF checkpoints in a Ling2 config's layout, for tests."""

import json

import numpy as np

from ling2.checkpoint.safetensors_io import ShardedWriter
from ling2.checkpoint.state import model_leaves
from ling2.convert import hf_config, mapping


def write_random_hf(directory, cfg, layout="bailing", drop=(), rename=None, extra=None, seed=0, dtype=np.float32,
                    shard_bytes=1 << 20):
    """Writes a random HF checkpoint for `cfg` (shards + index + config.json); returns {name: array}.

    drop: names left out; rename: {old: new}; extra: tensors added or replacing generated ones.
    """
    leaves = model_leaves(cfg)
    rng = np.random.default_rng(seed)
    tensors = {}
    for e in mapping.entries(cfg, layout, {p: v.shape for p, v in leaves.items()}):
        tensors[e.hf] = rng.standard_normal(mapping.hf_shape(e, leaves[e.path].shape)).astype(dtype)
    tensors = {(rename or {}).get(n, n): a for n, a in tensors.items() if n not in drop}
    tensors.update(extra or {})
    w = ShardedWriter(directory, shard_bytes=shard_bytes)
    for n, a in tensors.items():
        w.add(n, a)
    w.close()
    (directory / "config.json").write_text(json.dumps(hf_config.config_to_hf(cfg, layout)))
    return tensors


def mtp_names(cfg, layout="bailing"):
    """The HF names of `cfg`'s MTP tensors in `layout` (to drop, as transformers' save_pretrained of Ling 3 does)."""
    leaves = model_leaves(cfg)
    return [e.hf for e in mapping.entries(cfg, layout, {p: v.shape for p, v in leaves.items()}) if e.mtp]
