"""Ling2's model-state directories, and moving weights between layouts and into a model.

Two kinds of directory hold the state of a `Ling2Model`:
  a state directory (the converter's output, `save_state`):
    config.yml  the resolved config (`ling2.config.to_yaml`), read back with `read_config`;
    state/      one safetensors tensor per leaf of the model's pure-dict state, named by its key
                path joined with "/" (e.g. decoder/layers/3/attention/qkv), sharded with an index
                (`safetensors_io`), in the model's dtype and layout (scanned leaves stacked [group, ...]);
  a trainer step directory ({run}/checkpoints/{step}, `ling2.checkpoint.manager`), whose orbax
    item `state` holds the TrainState: `params` + `rest` together are every Variable.
`load_state` reads either into the model's key structure (re-laid out when the saved config
scans differently), `relayout` moves a state between the scanned and unscanned layouts along
the layer plan, `load_into` writes a state into a model. Leaf shapes come from the abstract
model (`model_leaves`: nnx.eval_shape, cached per config), so they never drift from it.
"""

import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from ling2.checkpoint.safetensors_io import INDEX_NAME, AbortOnError, PlannedWriter, SafetensorsError, ShardedReader
from ling2.config import ConfigError, load_config, to_yaml
from ling2.config.paths import replaced
from ling2.config.loader import load_yaml, without_removed
from ling2.layers.model import abstract_model
from ling2.layers.spec import ModelSpec

CONFIG_NAME = "config.yml"
STATE_NAME = "state"
STATE_SHARD = 2 << 30


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the model; the message names the
    directory and every offending leaf with both shapes."""


def published_steps(checkpoints_dir) -> list[int]:
    """The steps published under a run's checkpoints directory ({run}/checkpoints/{step}), oldest first; a save
    in flight (orbax's temporary directory) is not among them. [] when the directory does not exist."""
    d = Path(checkpoints_dir)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


class Leaf(NamedTuple):
    shape: tuple
    dtype: np.dtype


def flat(tree, prefix=()) -> dict:
    """{key path tuple: leaf} of a nested dict."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flat(v, prefix + (k,)))
        return out
    return {prefix: tree}


def unflat(items: dict) -> dict:
    out = {}
    for path, v in items.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def key(path) -> str:
    """A leaf's name in a state directory: its key path joined with '/'."""
    return "/".join(map(str, path))


def model_leaves(cfg) -> dict:
    """{key path: Leaf(shape, dtype)} of every Variable of the Ling2Model of `cfg`, in nnx's order."""
    leaves = flat(nnx.to_pure_dict(nnx.state(abstract_model(ModelSpec.of(cfg)))))
    return {p: Leaf(tuple(v.shape), np.dtype(v.dtype)) for p, v in leaves.items()}


def check_shapes(shapes: dict, leaves: dict, where: str) -> None:
    """Raises CheckpointError listing every leaf whose shape ({path: shape}, str or int keys) differs
    from the model's `leaves`."""
    want = {tuple(map(str, p)): tuple(v.shape) for p, v in leaves.items()}
    have = {tuple(map(str, p)): tuple(v) for p, v in shapes.items()}
    lines = [f"  {key(p)}: checkpoint {have.get(p, 'missing')} vs model {want.get(p, 'missing')}"
             for p in sorted(set(want) | set(have)) if have.get(p) != want.get(p)]
    if lines:
        raise CheckpointError(f"{where}: Ling2 state does not match the config:\n" + "\n".join(lines))


def read_config(path, *overrides):
    """A Ling2 config from a resolved YAML (e.g. a state directory's config.yml), plus overrides."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: Ling2 config not found")
    try:
        data = load_yaml(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed YAML: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a Ling2 config (a mapping of key: value)")
    try:
        return load_config(*overrides, named=[(str(path), without_removed(data))])
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _not_a_state_dir(out: Path) -> str | None:
    """Why `out` holds something a state directory written there would destroy (a trainer step, files of
    another kind under state/), or None."""
    state = out / STATE_NAME
    if (out / "meta").is_dir() or (out / "_CHECKPOINT_METADATA").exists():
        return "it is a trainer step directory"
    if state.exists() and not state.is_dir():
        return f"{STATE_NAME} is a file"
    if state.is_dir():
        other = sorted(p.name for p in state.iterdir() if p.name != INDEX_NAME and not p.name.endswith(".safetensors"))
        if other:
            return f"its {STATE_NAME}/ holds {', '.join(other[:3])}, which no state directory has (a trainer checkpoint?)"
    return None


PARTIAL, OLD, COMMIT = ".state.partial", ".state.old", ".config.yml.partial"  # StateWriter's hidden siblings


def finish_interrupted_save(out_dir) -> None:
    """Completes a StateWriter.close() that was killed while it swapped the new state/ and config.yml in: once
    COMMIT (the new config.yml) exists the new tensors are whole, so the swap is carried forward (old state/
    aside, the new one in, config.yml replaced, the old removed). Without COMMIT nothing is done: a reader
    never sees the new state/ beside the old config.yml, or none at all. Every step is a rename, so a kill
    here too leaves a directory the next call finishes. CheckpointError when the file system refuses."""
    out = Path(out_dir)
    commit, partial, state, old = out / COMMIT, out / PARTIAL, out / STATE_NAME, out / OLD
    if not commit.is_file():
        shutil.rmtree(old, ignore_errors=True)  # a finished swap's leftover
        return
    try:
        if partial.is_dir():
            if state.exists():
                shutil.rmtree(old, ignore_errors=True)
                state.rename(old)
            partial.rename(state)
        commit.replace(out / CONFIG_NAME)
    except OSError as e:
        raise CheckpointError(f"{out}: a save into it was interrupted while its new state/ and {CONFIG_NAME} were "
                              f"put in place, and cannot be finished here: {e.strerror or e}") from None
    shutil.rmtree(old, ignore_errors=True)


class StateWriter(AbortOnError):
    """Writes a state directory (see the module doc): the tensors go to a hidden sibling of `state/`, which
    replaces `state/` (and config.yml) only at `close()`, so a failed, interrupted or killed write leaves the
    directory as it was. Refuses a directory holding anything else (a trainer step) before writing a byte."""

    def __init__(self, out_dir, cfg, order=()):
        leaves = model_leaves(cfg)
        self.out, self.cfg = Path(out_dir).absolute(), cfg
        if self.out.exists() and not self.out.is_dir():
            raise CheckpointError(f"{self.out}: exists and is not a directory")
        if (why := _not_a_state_dir(self.out)) is not None:
            raise CheckpointError(f"{self.out}: not written, {why}; choose another output directory")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.out}: cannot create the output directory: {e.strerror}") from None
        finish_interrupted_save(self.out)
        shutil.rmtree(self.out / PARTIAL, ignore_errors=True)  # a killed write's unfinished tensors
        paths = list(dict.fromkeys(list(order) + list(leaves)))
        self.writer = PlannedWriter(self.out / PARTIAL, [(key(p), leaves[p].shape, leaves[p].dtype)
                                                             for p in paths], STATE_SHARD)
        self.lib = self.writer.lib

    def add(self, name: str, a, index: tuple = ()) -> None:
        self.writer.add(name, a, index)

    def close(self) -> dict:
        """Finishes the tensors, then puts them and config.yml in place of the old ones; returns the index.
        The new config.yml is written whole beside the old one first (COMMIT): from then on the new state is
        complete, and a kill during the renames that follow is finished by `finish_interrupted_save`."""
        index = self.writer.close()
        with replaced(self.out / COMMIT) as f:
            f.write(to_yaml(self.cfg))
        finish_interrupted_save(self.out)
        return index

    def abort(self) -> None:
        """Gives up: removes what was written; the directory keeps its old state/ and config.yml."""
        self.writer.abort()
        shutil.rmtree(self.out / PARTIAL, ignore_errors=True)


def state_writer(out_dir, cfg, order=()) -> StateWriter:
    """The StateWriter of `out_dir` (one safetensors tensor per leaf, the leaves in `order` first)."""
    return StateWriter(out_dir, cfg, order)


def save_state(out_dir, state: dict, cfg) -> Path:
    """Writes a state directory (see the module doc) of an in-memory pure-dict state."""
    leaves = model_leaves(cfg)
    items = {tuple(map(str, p)): v for p, v in flat(state).items()}
    check_shapes({p: np.shape(v) for p, v in items.items()}, leaves, "state")
    with state_writer(out_dir, cfg) as writer:
        for p in leaves:
            writer.add(key(p), np.asarray(items[tuple(map(str, p))]))
        writer.close()
    return Path(out_dir).absolute()


def relayout(state: dict, cfg_from, cfg_to) -> dict:
    """The same weights in cfg_to's layout (scanned <-> unscanned): each layer's subtree moves from its
    place in cfg_from's layer plan to its place in cfg_to's; every other leaf keeps its path."""
    src = {tuple(map(str, p)): np.asarray(v) for p, v in flat(state).items()}
    leaves = model_leaves(cfg_to)
    dst = {p: np.empty(v.shape, v.dtype) for p, v in leaves.items()}
    dst_by_str = {tuple(map(str, p)): p for p in dst}
    to_specs = {s.index: s for s in ModelSpec.of(cfg_to).plan.all()}
    moved = set()
    for s in ModelSpec.of(cfg_from).plan.all():
        t = to_specs[s.index]
        head = tuple(map(str, s.path))
        for p, v in src.items():
            if p[:len(head)] == head:
                d = dst_by_str[tuple(map(str, t.path)) + p[len(head):]]
                dst[d][t.stack] = v[s.stack]
                moved.add(p)
    for p, v in src.items():
        if p not in moved:
            dst[dst_by_str[p]][...] = v
    return unflat(dst)


def load_state(ckpt_dir, cfg, verified: bool = False) -> dict:
    """The pure-dict state (model key types) of a state directory or a trainer step directory.

    A state directory saved with the other `scan_layers` is re-laid out to `cfg`'s. A trainer step's state
    files are checked against their checksums first (`check_step_state`: every byte read once more), unless
    the caller has just done so (`verified`).
    """
    finish_interrupted_save(ckpt_dir)
    saved = Path(ckpt_dir) / CONFIG_NAME
    if saved.is_file():
        saved_cfg = read_config(saved)
        if saved_cfg.scan_layers != cfg.scan_layers:
            relaid = model_leaves(saved_cfg.model_copy(update={"scan_layers": cfg.scan_layers}))
            check_shapes({p: v.shape for p, v in relaid.items()}, model_leaves(cfg), str(Path(ckpt_dir)))
            return relayout(_load_state(ckpt_dir, saved_cfg, verified), saved_cfg, cfg)
    return _load_state(ckpt_dir, cfg, verified)


def check_step_state(step_dir) -> None:
    """CheckpointError unless a trainer step's state item holds its files as they were saved (its checksums)."""
    from ling2.checkpoint.manager import verify  # (the manager imports this module)

    reason = verify(Path(step_dir), items=(STATE_NAME,), whole=False)
    if reason is not None:
        raise CheckpointError(f"{Path(step_dir)}: unusable checkpoint: {reason}")


def _load_state(ckpt_dir, cfg, verified: bool) -> dict:
    path = Path(ckpt_dir).absolute() / STATE_NAME
    leaves = model_leaves(cfg)
    if (path / INDEX_NAME).is_file():  # a state directory: one safetensors tensor per leaf
        try:
            reader = ShardedReader(path)
            check_shapes({tuple(n.split("/")): reader.shape(n) for n in reader.names()}, leaves, str(path))
            return unflat({p: reader.read(key(p)) for p in leaves})
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no state directory or orbax state item")
    if not verified:
        check_step_state(ckpt_dir)
    try:  # as host numpy arrays: the item's saved shardings name the devices of the run that wrote it
        with ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(path)
            meta = getattr(getattr(meta, "item_metadata", None), "tree", None) or meta
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
            tree = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    except (ValueError, OSError, KeyError) as e:  # orbax/tensorstore on a damaged item
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CheckpointError(f"{path}: unreadable orbax state item: {first[:500]}") from None
    if "params" in tree and "decoder" not in tree:  # trainer TrainState: trainable params + the rest
        items = flat(tree["params"])
        items.update(flat(tree.get("rest") or {}))
        items = {p[:-1] if p[-1] == "value" else p: v for p, v in items.items()}  # nnx.State keeps Variable.value
    else:
        items = flat(tree)
    items = {tuple(map(str, p)): v for p, v in items.items()}
    check_shapes({p: np.shape(v) for p, v in items.items()}, leaves, str(path))
    return unflat({p: np.asarray(items[tuple(map(str, p))]) for p in leaves})


def load_into(model, ckpt_dir, cfg) -> None:
    """Overwrites every Variable of `model` (a Ling2Model of `cfg`) with a checkpoint's values."""
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, load_state(ckpt_dir, cfg)))
    nnx.update(model, state)
