"""Checkpoint merging (WSM: warmup-stable-merge): the weighted average of a run's checkpoints in place of a
learning-rate decay.

Checkpoints theta_1..theta_k of a constant-rate run are theta_0 + eta (g_1 + ... + g_i) (g_j the update
of interval j). A decayed schedule with rate multipliers alpha_1 = 1 >= alpha_2 >= ... >= alpha_k over the
same intervals ends at theta_0 + eta sum_j alpha_j g_j. The merge sum_i c_i theta_i equals it when
sum_{i >= j} c_i = alpha_j, that is c_i = alpha_i - alpha_{i+1} (alpha_{k+1} = 0): coefficients that are
non-negative and sum to alpha_1 = 1. `decay_coefficients` samples a decay shape at the k intervals:
linear gives the uniform average; cosine and 1-sqrt weigh the later checkpoints less.

`merge` reads one tensor at a time from every input (orbax partial restores of a trainer step's `state`
item, or a state directory's safetensors), accumulates in float64 and writes a state directory
(`ling2.checkpoint.state`: config.yml + state/), which load_parameters_path, //ling2/infer:generate,
:evaluate and ling2_to_hf read. Host memory stays near one tensor per input.
"""

import math
from pathlib import Path

import numpy as np

from ling2.checkpoint.safetensors_io import INDEX_NAME, ShardedReader
from ling2.checkpoint.state import STATE_NAME, CheckpointError, check_step_state, key, model_leaves, published_steps, state_writer
from ling2.config.schema import FIELD_GROUPS

SHAPES = ("uniform", "linear", "cosine", "1-sqrt")
MODEL_GROUPS = ("Model", "Rope", "LinearAttention", "Mla", "MoE", "DeepSeekMoE", "Mtp")


def decay_coefficients(shape: str, k: int) -> np.ndarray:
    """[k] merge weights of k consecutive checkpoints (oldest first) that emulate the decay `shape` over
    their k intervals: alpha_j = f((j - 1) / k), c_i = alpha_i - alpha_{i+1}."""
    if k < 1:
        raise ValueError(f"merge: need at least one checkpoint, got {k}")
    if shape in ("uniform", "linear"):
        f = lambda x: 1.0 - x  # noqa: E731
    elif shape == "cosine":
        f = lambda x: 0.5 * (1.0 + math.cos(math.pi * x))  # noqa: E731
    elif shape == "1-sqrt":
        f = lambda x: 1.0 - math.sqrt(x)  # noqa: E731
    else:
        raise ValueError(f"merge: unknown decay shape {shape!r} (one of {SHAPES})")
    alpha = np.array([f(j / k) for j in range(k)] + [0.0])
    return alpha[:-1] - alpha[1:]


def check_weights(weights, n: int) -> np.ndarray:
    """The weights as float64, or ValueError naming what is wrong: their count, a negative or non-finite one,
    or a sum other than 1 (within 1e-6)."""
    w = np.asarray(weights, np.float64)
    if w.shape != (n,):
        raise ValueError(f"merge: {w.size} weights for {n} checkpoints")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"merge: weights must be finite and >= 0, got {w.tolist()}")
    if abs(w.sum() - 1.0) > 1e-6:
        raise ValueError(f"merge: weights sum to {w.sum():.9g}, not 1: {w.tolist()}")
    return w


def _model_fields():
    return {f for f, g in FIELD_GROUPS.items() if g.__name__ in MODEL_GROUPS}


def same_model(configs: dict):
    """The first config, or CheckpointError naming every model field on which the inputs disagree."""
    items = list(configs.items())
    first_dir, first = items[0]
    fields = _model_fields()
    a = first.model_dump(mode="json")
    diffs = []
    for d, cfg in items[1:]:
        b = cfg.model_dump(mode="json")
        diffs += [f"  {k}: {a[k]!r} in {first_dir}, {b[k]!r} in {d}" for k in sorted(fields) if a[k] != b[k]]
    if diffs:
        raise CheckpointError("merge: the checkpoints are of different models:\n" + "\n".join(diffs))
    return first


class Source:
    """One input's tensors by model leaf path: a state directory's safetensors or a trainer step's orbax
    `state` item (partial restores of one leaf)."""

    def __init__(self, step_dir: Path, cfg):
        self.dir, self.cfg = step_dir, cfg
        state = step_dir / STATE_NAME
        self.reader = ShardedReader(state) if (state / INDEX_NAME).is_file() else None
        if self.reader is None:
            import jax
            import orbax.checkpoint as ocp

            if not state.is_dir():
                raise CheckpointError(f"merge: {step_dir} has no state item")
            check_step_state(step_dir)
            with ocp.PyTreeCheckpointer() as c:
                meta = c.metadata(state)
            tree = getattr(getattr(meta, "item_metadata", None), "tree", None) or meta
            self.where = {}
            for part in ("params", "rest"):
                for path, m in jax.tree_util.tree_flatten_with_path(tree.get(part) or {})[0]:
                    keys = tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
                    if keys and keys[-1] == "value":  # nnx.State keeps Variable.value
                        self.where[keys[:-1]] = (part,) + keys
            self.state = state

    def read(self, path: tuple) -> np.ndarray:
        if self.reader is not None:
            return self.reader.read(key(path))
        import orbax.checkpoint as ocp

        loc = self.where.get(tuple(map(str, path)))
        if loc is None:
            raise CheckpointError(f"merge: {self.dir} has no tensor {key(path)}")

        def nest(v):
            for k in reversed(loc):
                v = {k: v}
            return v

        leaf = model_leaves(self.cfg)[path]
        item, args = nest(np.zeros(leaf.shape, leaf.dtype)), nest(ocp.RestoreArgs(restore_type=np.ndarray))
        with ocp.PyTreeCheckpointer() as c:
            got = c.restore(self.state, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
        for k in loc:
            got = got[k]
        return np.asarray(got)


def merged_leaf(sources, weights, path, leaf) -> np.ndarray:
    """sum_i w_i x_i of one model leaf over the inputs, accumulated in float64, in the leaf's dtype."""
    acc = np.zeros(leaf.shape, np.float64)
    for src, c in zip(sources, weights):
        x = src.read(path)
        if x.shape != tuple(leaf.shape):
            raise CheckpointError(f"merge: {src.dir}: {key(path)} has shape {x.shape}, the model {leaf.shape}")
        acc += c * x.astype(np.float64)
    return acc.astype(leaf.dtype)


def merge(step_dirs, weights, out_dir, log=print) -> Path:
    """Writes the weighted average of the checkpoints in `step_dirs` (trainer step or state directories of
    one model) as a state directory `out_dir`; returns it. Raises CheckpointError / ValueError, naming the
    input, on a missing directory, different models or bad weights."""
    from ling2.checkpoint.manager import saved_config

    dirs = [Path(d) for d in step_dirs]
    w = check_weights(weights, len(dirs))
    for d in dirs:
        if not d.is_dir():
            raise CheckpointError(f"merge: {d} is not a directory")
        if d.resolve() == Path(out_dir).resolve():
            raise CheckpointError(f"merge: --out {out_dir} is one of the checkpoints merged; write elsewhere")
    configs = {d: saved_config(d) for d in dirs}
    cfg = same_model(configs)
    sources = [Source(d, configs[d]) for d in dirs]
    leaves = model_leaves(cfg)
    with state_writer(out_dir, cfg) as writer:  # a failure leaves out_dir's old contents
        for path, leaf in leaves.items():
            writer.add(key(path), merged_leaf(sources, w, path, leaf))
        writer.close()
    log(f"merged {len(dirs)} checkpoints ({', '.join(f'{c:.4g}' for c in w)}) into {Path(out_dir).absolute()}: "
        f"{len(leaves)} tensors")
    return Path(out_dir).absolute()


def step_dirs_of(run_dir, steps=None, last: int = 0) -> list[Path]:
    """The step directories {run_dir}/checkpoints/{s} of `steps` (ints), or of the newest `last` steps;
    CheckpointError naming a missing step or a run with fewer checkpoints."""
    root = Path(run_dir) / "checkpoints"
    have = published_steps(root)
    if steps:
        missing = [s for s in steps if s not in have]
        if missing:
            raise CheckpointError(f"merge: {root} has no step(s) {missing} (it has {have})")
        return [root / str(s) for s in steps]
    if last < 1 or len(have) < last:
        raise CheckpointError(f"merge: --last={last} but {root} has {len(have)} checkpoint(s) {have}")
    return [root / str(s) for s in have[-last:]]


def main(argv) -> int:
    """//ling2/checkpoint:merge: see the module doc; exit 2 on bad input."""
    import sys

    from absl import flags, logging

    logging.set_verbosity(logging.ERROR)  # orbax warns of each step's item-level metadata file it does not need
    F = flags.FLAGS
    def numbers(flag: str, text: str, kind):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"merge: --{flag}={text}: want comma-separated {kind.__name__}s") from None

    try:
        if F.run_dir and not Path(F.run_dir).is_dir():
            raise ValueError(f"merge: --run_dir {F.run_dir}: no such directory")
        dirs = (step_dirs_of(F.run_dir, numbers("steps", F.steps, int), F.last) if F.run_dir
                else [Path(d) for d in F.step_dirs.split(",") if d.strip()])
        if not dirs:
            raise ValueError("merge: name the checkpoints: --run_dir with --steps or --last, or --step_dirs")
        weights = numbers("weights", F.weights, float) if F.weights else decay_coefficients(F.shape, len(dirs))
        if not F.out:
            raise ValueError("merge: --out is required")
        merge(dirs, weights, F.out)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a write the file system refuses (a full disk): the old --out is kept (StateWriter)
        print(f"error: merge: --out {F.out}: cannot write the merged checkpoint: {e.strerror or e}"
              + (f" ({e.filename})" if e.filename else ""), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    from absl import app, flags

    flags.DEFINE_string("run_dir", "", "A training run: merge checkpoints of {run_dir}/checkpoints.")
    flags.DEFINE_string("steps", "", "Comma-separated steps of --run_dir to merge (oldest first).")
    flags.DEFINE_integer("last", 0, "Merge the newest N checkpoints of --run_dir.")
    flags.DEFINE_string("step_dirs", "", "Comma-separated step or state directories (instead of --run_dir).")
    flags.DEFINE_string("shape", "uniform", f"Decay shape the weights emulate: one of {SHAPES}.")
    flags.DEFINE_string("weights", "", "Explicit comma-separated weights (oldest first; must sum to 1).")
    flags.DEFINE_string("out", "", "Output state directory.")
    from ling2.config import cli

    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)
