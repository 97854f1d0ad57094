"""The decoder's layers, scanned or unrolled, behind one call path.

A `LayerStack` holds the layers of a layer plan (`ling2.layers.plan`) in the state layout the plan
names, and offers two views of them whatever the layout:
  fold(f, x, extras, run)
               the forward: x, aux = f(layer, layer_index, x, extras) for every layer in index
               order; unrolled layers are called one by one, the scanned groups under one
               `lax.scan` with `layer_index` traced, or, on a mesh with a "stage" axis, pipelined
               (`ling2.layers.pipeline`: `extras`, per-row arrays, split with x into micro-batches);
  unstacked()  [(layer_index, layer)], every layer as its own module (scanned ones sliced out
               of the stack), for cached decoding and tests.
A layer whose constants depend on its place (GLA's decays) reads them from `layer_index`, so
nothing is patched into the layers from outside.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from ling2.layers import pipeline
from ling2.layers.plan import LayerPlan


class LayerGroup(nnx.Module):
    """Consecutive layers, one scan step."""

    def __init__(self, layers):
        self.layers = nnx.List(layers)


def stack_groups(groups):
    """One LayerGroup whose Variables hold every group's values on a leading 'layers' axis."""
    gdef, *_ = nnx.split(groups[0])
    states = [nnx.split(g)[1] for g in groups]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    for _, v in nnx.to_flat_state(stacked):
        names = v.get_metadata().get("out_sharding")
        if names:
            v.set_metadata(out_sharding=("layers", *names))
    return nnx.merge(gdef, stacked)


class LayerStack(nnx.Module):
    """Layers in plan order. The state keeps the plan's paths: unscanned `layers[i]`; scanned `prefix[i]`,
    `groups` (one `LayerGroup` stacked over `num_groups`) and `suffix[j]`. The decoder subclasses it so
    those paths stay directly under "decoder"."""

    def init_layers(self, plan: LayerPlan, layers: list):
        """Places `layers` (one module per plan layer, in index order) by the plan's layout."""
        self.scan = plan.scan
        if not plan.scan:
            self.layers = nnx.List(layers)
            return
        p, n, k = plan.prefix, plan.num_groups, plan.group_size
        self.prefix = nnx.List(layers[:p])
        self.suffix = nnx.List(layers[plan.suffix_start:])
        self.num_groups, self.group_size = n, k
        self.groups = stack_groups([LayerGroup(layers[p + g * k:p + (g + 1) * k]) for g in range(n)]) if n else None

    def _runs(self):
        """(first layer index, unrolled layers) before and after the scanned groups."""
        if not self.scan:
            return [(0, list(self.layers))], []
        p, n, k = len(self.prefix), self.num_groups, self.group_size
        return [(0, list(self.prefix))], [(p + n * k, list(self.suffix))]

    def fold(self, f, x, extras=(), run=None):
        """(x, {layer index: aux}) after x, aux = f(layer, layer_index, x, extras) over every layer in order.
        With `run` (a RunSpec) on a mesh of several stages the scanned groups run pipelined."""
        aux = {}
        before, after = self._runs()

        def unrolled(runs, x):
            for start, layers in runs:
                for j, layer in enumerate(layers):
                    x, aux[start + j] = f(layer, start + j, x, extras)
            return x

        x = unrolled(before, x)
        if self.scan and self.num_groups:
            p, n, k = len(self.prefix), self.num_groups, self.group_size
            gdef, stacked = nnx.split(self.groups)

            def group(state, g, x, ex):
                group_aux = []
                for j, layer in enumerate(nnx.merge(gdef, state).layers):
                    x, a = f(layer, p + g * k + j, x, ex)
                    group_aux.append(a)
                return x, group_aux

            if run is not None and pipeline.stages(run) > 1:
                x, group_aux = pipeline.pipeline(group, stacked, x, extras, run=run)
            else:
                x, group_aux = jax.lax.scan(lambda x, xs: group(*xs, x, extras), x,
                                            (stacked, jnp.arange(n, dtype=jnp.int32)))
            for j, a in enumerate(group_aux):
                for g in range(n):
                    aux[p + g * k + j] = None if a is None else jax.tree.map(lambda v: v[g], a)
        return unrolled(after, x), aux

    def scanned(self, layer_index: int) -> bool:
        """Whether layer `layer_index` is in the scanned groups."""
        if not (self.scan and self.num_groups):
            return False
        p = len(self.prefix)
        return p <= layer_index < p + self.num_groups * self.group_size

    def unstacked(self) -> list:
        """[(global index, layer)] in order; scanned layers are sliced out of the stack."""
        before, after = self._runs()
        out = [(start + j, layer) for start, layers in before for j, layer in enumerate(layers)]
        if self.scan and self.num_groups:
            p, k = len(self.prefix), self.group_size
            gdef, stacked = nnx.split(self.groups)
            for g in range(self.num_groups):
                group = nnx.merge(gdef, jax.tree.map(lambda v: v[g], stacked))
                out += [(p + g * k + j, layer) for j, layer in enumerate(group.layers)]
        return out + [(start + j, layer) for start, layers in after for j, layer in enumerate(layers)]
