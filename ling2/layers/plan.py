"""The layer plan: every decoder and MTP layer of a model, described once (`ModelSpec.plan`).

Each `LayerSpec` names a layer's global index, attention kind (cfg.layer_types), MLP kind
(cfg.mlp_types) and where its module sits in the model state. Unscanned, layer i is at
("decoder", "layers", i). With `scan_layers` the stack splits into
  prefix  ("decoder", "prefix", i):          every leading group that holds a dense layer;
  groups  ("decoder", "groups", "layers", j), stack index g: `num_groups` consecutive groups
          of `group_size` (= inhomogeneous_layer_cycle_interval) layers with one pattern,
          stacked on a leading "layers" axis and run by one `lax.scan`;
  suffix  ("decoder", "suffix", j):          a trailing partial group.
MTP depth d is layer L + d at ("mtp", "depths", d, "layer"), always the full-attention kind (MLA) + MoE.

The decoder builds itself from this plan; the converter's HF mapping, the checkpoint
relayout and the expert-bias bookkeeping iterate it. A new attention kind only needs a
name in cfg.layer_types and a module registered in `ling2.layers.attention.registry.ATTENTION`.
"""

from typing import NamedTuple

from ling2.config.kinds import FULL
from ling2.config.specs import PlanSpec


class LayerSpec(NamedTuple):
    index: int  # global layer index; MTP depth d is num_decoder_layers + d
    attn: str  # attention kind, e.g. "gla", "mla"
    mlp: str  # "dense" or "moe"
    path: tuple  # key path of the layer's module in the model state
    stack: tuple = ()  # (g,): index on the leading "layers" axis of a scanned group; () otherwise
    mtp: bool = False


class LayerPlan(NamedTuple):
    layers: tuple  # LayerSpec of every decoder layer, in index order
    mtp: tuple  # LayerSpec of every MTP depth
    scan: bool
    prefix: int  # layers [0, prefix) unscanned (scan only)
    num_groups: int  # scanned groups (scan only)
    group_size: int

    @property
    def suffix_start(self) -> int:
        """First layer of the unscanned suffix (scan only)."""
        return self.prefix + self.num_groups * self.group_size

    def all(self) -> tuple:
        """Decoder layers then MTP depths."""
        return self.layers + self.mtp


def scan_layout(spec: PlanSpec) -> tuple[int, int, int]:
    """(prefix_end, num_groups, group_size) of the scanned stack: layers [0, prefix_end) unscanned,
    then num_groups groups of group_size, then the rest unscanned.

    Raises ValueError when the scanned groups would not all have one layer pattern."""
    L, k = spec.num_decoder_layers, spec.inhomogeneous_layer_cycle_interval
    full_end = (L // k) * k
    prefix_end = min(-(-spec.first_num_dense_layers // k) * k, full_end)
    n = max(full_end - prefix_end, 0) // k
    kinds = list(zip(spec.layer_types, spec.mlp_types))
    pattern = kinds[prefix_end:prefix_end + k]
    for g in range(1, n):
        start = prefix_end + g * k
        if kinds[start:start + k] != pattern:
            raise ValueError(f"scan_layers: layers {start}..{start + k - 1} are {kinds[start:start + k]}, unlike the "
                             f"first scanned group {pattern}; scanned groups need one pattern (set scan_layers=false)")
    return prefix_end, n, k


def layer_plan(spec: PlanSpec, scan: bool) -> LayerPlan:
    """The plan of `spec`'s layers, their repeated groups stacked and scanned with `scan` (see the module doc)."""
    L = spec.num_decoder_layers
    kinds = list(zip(spec.layer_types, spec.mlp_types))
    if scan:
        p, n, k = scan_layout(spec)
    else:
        p, n, k = L, 0, spec.inhomogeneous_layer_cycle_interval
    layers = []
    for i, (attn, mlp) in enumerate(kinds):
        if not scan:
            path, stack = ("decoder", "layers", i), ()
        elif i < p:
            path, stack = ("decoder", "prefix", i), ()
        elif i < p + n * k:
            path, stack = ("decoder", "groups", "layers", (i - p) % k), ((i - p) // k,)
        else:
            path, stack = ("decoder", "suffix", i - p - n * k), ()
        layers.append(LayerSpec(i, attn, mlp, path, stack))
    mtp = tuple(LayerSpec(L + d, FULL, "moe", ("mtp", "depths", d, "layer"), (), True)
                for d in range(spec.mtp_num_layers))
    return LayerPlan(tuple(layers), mtp, bool(scan), p, n, k)
