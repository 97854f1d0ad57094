"""Evaluation: token-averaged next-token cross-entropy over the validation split.

The CE-sum function is compiled once per Evaluator (shapes are fixed by the config); each
evaluation starts the validation iterator afresh, so every evaluation sees the same
`eval_steps` batches. Batch arrays are [M, B, S]: micro-batches, rows, positions.
"""

import types

import jax
from flax import nnx

from ling2.checkpoint import merge
from ling2.checkpoint.state import flat, model_leaves, unflat
from ling2.train.runtime import data_share, to_global


class Evaluator:
    """`evaluate(state)` -> mean CE over cfg.eval_steps validation batches (at least one)."""

    def __init__(self, cfg, mesh, graphdef, make_iter):
        self.cfg, self.mesh, self.make_iter = cfg, mesh, make_iter

        @jax.jit
        def ce(params, rest, mb):
            model = nnx.merge(graphdef, params, rest)
            s = model.loss_sums(mb["inputs"], mb["targets"], mb["loss_weights"], mb["positions"], mb["segment_ids"],
                                main_only=True)
            return s.ce, s.tokens

        self._ce = ce

    def evaluate(self, state) -> float:
        it = self.make_iter(self.cfg, "valid", self.mesh.size, data_share(self.cfg, self.mesh))
        tot, cnt = 0.0, 0.0
        for _ in range(max(self.cfg.eval_steps, 1)):
            batch = to_global(next(it), self.cfg, self.mesh)
            for m in range(batch["inputs"].shape[0]):
                s, n = self._ce(state.params, state.rest, jax.tree.map(lambda x_MBS: x_MBS[m], batch))
                tot, cnt = tot + float(s), cnt + float(n)  # host sync: eval is off the step path
        return tot / max(cnt, 1.0)


def merged_state(state, step_dirs, cfg):
    """A view of `state` whose params and rest are the WSM merge of `step_dirs` (oldest first; weights from
    cfg.merge_shape), read leaf by leaf on the host and placed in the live arrays' shardings; `state`
    itself is untouched."""
    weights = merge.decay_coefficients(cfg.merge_shape, len(step_dirs))
    sources = [merge.Source(d, cfg) for d in step_dirs]
    leaves = {tuple(map(str, p)): (p, leaf) for p, leaf in model_leaves(cfg).items()}

    def one(tree):
        pure = nnx.to_pure_dict(tree)
        new = {}
        for p, live in flat(pure).items():
            path, leaf = leaves[tuple(map(str, p))]
            new[p] = jax.device_put(merge.merged_leaf(sources, weights, path, leaf), live.sharding)
        out = jax.tree.map(lambda x: x, tree)
        nnx.replace_by_pure_dict(out, unflat(new))
        return out

    return types.SimpleNamespace(params=one(state.params), rest=one(state.rest))

