"""The trainer's view of the data pipeline: batches shaped [M, b, S] for gradient accumulation.

Relative prefixes in `data_path` resolve through `find_file` (the user's directory first,
then the repository for bundled data).
"""

import json

import numpy as np

from ling2.data import pipeline
from ling2.data.errors import DataError


def resolve_data_path(data_path: str, find_file) -> str:
    """Maps every prefix of a Megatron-style 'w1 p1 w2 p2' (or a single prefix) through find_file."""
    parts = data_path.split()

    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False

    return " ".join(p if is_number(p) else str(find_file(p)) for p in parts)


class MicroBatches:
    """Wraps a grain iterator of [M*b, S] batches as [M, b, S]; keeps its checkpointable state."""

    def __init__(self, inner, micro: int):
        self.inner, self.micro = inner, micro

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        return {k: np.asarray(x_BS).reshape(self.micro, -1, *np.shape(x_BS)[1:]) for k, x_BS in batch.items()}

    def get_state(self) -> bytes:
        return json.dumps(self.inner.get_state()).encode()

    def set_state(self, state: bytes) -> None:
        self.inner.set_state(json.loads(state))

    def start_prefetch(self) -> None:
        if hasattr(self.inner, "start_prefetch"):
            self.inner.start_prefetch()


def make_iterator_factory(find_file):
    """(cfg, split, num_devices, share) -> MicroBatches over this host's rows of each global batch: row group
    share.group of share.groups (`ling2.train.runtime.DataShare`; whole rows, its positions cut by `to_global`)."""

    def make(cfg, split: str, num_devices: int, share) -> MicroBatches:
        if cfg.dataset_type == "mmap":
            cfg = cfg.model_copy(update={
                "data_path": resolve_data_path(cfg.data_path, find_file),
                "blend_per_split": [resolve_data_path(p, find_file) for p in cfg.blend_per_split]})
        try:
            it = pipeline.make_data_iterator(cfg, num_devices, split, process_index=share.group,
                                             process_count=share.groups)
        except (ValueError, OSError) as e:
            raise DataError(f"data ({split} split, data_path={cfg.data_path!r}): {e}") from e
        return MicroBatches(it, cfg.gradient_accumulation_steps)

    return make
