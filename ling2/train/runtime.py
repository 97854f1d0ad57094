"""Where a run executes: the device mesh, parameter shardings, global batches and device peak FLOP/s.

The mesh is (stage, data, fsdp, expert, context, tensor) from cfg.ici_*_parallelism (one -1 fills the
devices of a slice) times cfg.dcn_*_parallelism across slices (multi-slice; slices outermost).
Parameters carry logical axis names (`out_sharding` metadata); the config's
`logical_axis_rules` map them to mesh axes (`ling2.layers.sharding.logical_to_spec`).
"""

import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ling2.config import ConfigError
from ling2.config.schema import MESH_AXES
from ling2.layers import sharding
from ling2.layers.spec import ModelSpec

# Peak dense bf16 FLOP/s per device, by a substring of jax's device_kind (lower case).
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12, "v5 lite": 197e12, "v5e": 197e12,
              "v5p": 459e12, "v5": 459e12, "v6 lite": 918e12, "v6e": 918e12, "v4": 275e12}


def _sizes(cfg, net: str, count: int) -> list[int]:
    """Per-axis sizes of cfg.{net}_*_parallelism over `count` devices (ici) or slices (dcn); one -1 fills.
    Raises ConfigError when they do not fit."""
    sizes = [getattr(cfg, f"{net}_{a}_parallelism") for a in MESH_AXES]
    what = "devices per slice" if net == "ici" else "slices"
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if count % known:
            raise ConfigError(f"{net}_*_parallelism: fixed sizes {dict(zip(MESH_AXES, sizes))} do not divide the "
                              f"{count} {what}")
        sizes[sizes.index(-1)] = count // known
    if math.prod(sizes) != count:
        raise ConfigError(f"{net}_*_parallelism: mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} {what}, "
                         f"have {count}")
    return sizes


def mesh_shapes(cfg, num_devices: int, num_slices: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ici, dcn) per-axis sizes: ici over the devices of one slice, dcn over the slices."""
    if num_devices % num_slices:
        raise ConfigError(f"{num_devices} devices do not split into {num_slices} equal slices")
    return tuple(_sizes(cfg, "ici", num_devices // num_slices)), tuple(_sizes(cfg, "dcn", num_slices))


def mesh_shape(cfg, num_devices: int, num_slices: int = 1) -> tuple[int, ...]:
    """The (stage, data, fsdp, expert, context, tensor) sizes: dcn x ici per axis (one -1 fills within each)."""
    ici, dcn = mesh_shapes(cfg, num_devices, num_slices)
    return tuple(i * d for i, d in zip(ici, dcn))


def hybrid_device_array(slices: list, ici: tuple, dcn: tuple) -> np.ndarray:
    """Devices [dcn0*ici0, dcn1*ici1, ...] from `slices` (one list of devices per slice): each slice
    fills an ici block, and along every axis the slice index is the outer part of the mesh index,
    so only the dcn part of an axis crosses slices."""
    n = len(dcn)
    blocks = np.empty((len(slices), math.prod(ici)), dtype=object)
    for i, s in enumerate(slices):
        blocks[i, :] = list(s)
    arr = blocks.reshape(*dcn, *ici)  # (d0, d1, .., i0, i1, ..)
    arr = arr.transpose([k for a in range(n) for k in (a, n + a)])  # (d0, i0, d1, i1, ..)
    return arr.reshape([d * i for d, i in zip(dcn, ici)])


def pipeline_problem(cfg, stages: int, rows: int, expert: int = 1) -> None:
    """ConfigError naming the field when `stages` pipeline stages cannot run cfg's model on micro-batches of
    `rows` rows with an expert axis of size `expert` (`ling2.layers.pipeline`)."""
    if expert > 1 and not cfg.sparse_matmul:
        raise ConfigError("sparse_matmul: a pipeline stage runs the expert-parallel exchange on its own experts' "
                          "weights, which the dense-capacity path (sparse_matmul=false) cannot use; set "
                          "sparse_matmul=true")
    if not cfg.scan_layers:
        raise ConfigError(f"scan_layers: pipeline stages ({stages}) split the scanned layer groups; set scan_layers=true")
    groups = ModelSpec.of(cfg).plan.num_groups
    if groups % stages:
        raise ConfigError(f"ici_stage_parallelism: {stages} stages do not divide the model's {groups} scanned layer "
                          f"groups")
    if rows % cfg.pipeline_microbatches:
        raise ConfigError(f"pipeline_microbatches: {cfg.pipeline_microbatches} does not divide the {rows} rows of a "
                          "micro-batch")


def make_mesh(cfg, devices=None) -> Mesh:
    """A (stage, data, fsdp, expert, context, tensor) mesh over `devices` (default: all). Over several slices (devices'
    slice_index) each axis is dcn x ici, slices outermost: cfg.dcn_*_parallelism slices along it."""
    devices = jax.devices() if devices is None else list(devices)
    rows = cfg.per_device_batch_size * len(devices)
    if rows != int(rows):
        raise ConfigError(f"per_device_batch_size: {cfg.per_device_batch_size:g} x {len(devices)} device(s) = {rows:g} "
                          f"sequences per micro-batch, not a whole number")
    k = cfg.num_experts_per_tok if cfg.num_experts else 1
    if rows * cfg.max_target_length * k >= 2**31:
        raise ConfigError(f"per_device_batch_size: {int(rows):,} sequences x {cfg.max_target_length} tokens x {k} experts "
                          f"each = {rows * cfg.max_target_length * k:,.0f} rows per micro-batch, past what JAX indexes "
                          f"(int32, < 2^31); use gradient_accumulation_steps for a larger batch")
    by_slice: dict = {}
    for d in devices:
        by_slice.setdefault(getattr(d, "slice_index", 0) or 0, []).append(d)
    ici, dcn = mesh_shapes(cfg, len(devices), len(by_slice))
    context = MESH_AXES.index("context")
    problem = cfg.context_problem(ici[context] * dcn[context])
    if problem:
        raise ConfigError(f"ici_context_parallelism: {problem}")
    stages = ici[MESH_AXES.index("stage")] * dcn[MESH_AXES.index("stage")]
    expert = ici[MESH_AXES.index("expert")] * dcn[MESH_AXES.index("expert")]
    if stages > 1:
        pipeline_problem(cfg, stages, int(cfg.per_device_batch_size * len(devices)), expert)
    if cfg.moe_ep_all_to_all == "ragged" and expert > 1 and devices[0].platform == "cpu":
        raise ConfigError("moe_ep_all_to_all: 'ragged' cannot run on CPU devices (XLA:CPU has no ragged "
                          "all-to-all); use 'auto' or 'padded' ('emulated' runs the ragged offsets with padded "
                          "collectives)")
    if len(by_slice) == 1:
        arr = np.asarray(devices, dtype=object).reshape(ici)
    else:
        arr = hybrid_device_array([by_slice[k] for k in sorted(by_slice)], ici, dcn)
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


class DataShare(NamedTuple):
    """This process's part of every global batch [M, b, S]: the rows of row group `group` of `groups` (the loader's
    share: Megatron's contiguous data-parallel slice of the samples) and positions [start, stop) of each row.
    The processes of one context group load the same samples and keep each their own token range."""
    group: int
    groups: int
    start: int
    stop: int


def share_of(blocks, rows: int, length: int) -> DataShare:
    """The DataShare of a process whose devices hold `blocks` {(row start, row stop, position start, position
    stop)} of a [rows, length] micro-batch. ConfigError unless they tile one block of whole row groups."""
    r0, r1 = min(b[0] for b in blocks), max(b[1] for b in blocks)
    p0, p1 = min(b[2] for b in blocks), max(b[3] for b in blocks)
    n = r1 - r0
    if sum((b[1] - b[0]) * (b[3] - b[2]) for b in blocks) != n * (p1 - p0) or rows % n or r0 % n:
        raise ConfigError(f"mesh: this process's devices hold rows {sorted({b[:2] for b in blocks})} x positions "
                          f"{sorted({b[2:] for b in blocks})} of each [{rows}, {length}] micro-batch: not one block "
                          "of whole row groups; order the devices so each process holds one range of rows and of "
                          "positions")
    return DataShare(r0 // n, rows // n, p0, p1)


def data_share(cfg, mesh: Mesh) -> DataShare:
    """This process's DataShare under `batch_sharding`: whole rows unless the context axis spans processes."""
    b, S = cfg.micro_batch_size(mesh.size), cfg.max_target_length
    if jax.process_count() == 1:
        return DataShare(0, 1, 0, S)
    held = batch_sharding(cfg, mesh, b, S).addressable_devices_indices_map((1, b, S)).values()
    return share_of({(r.start or 0, b if r.stop is None else r.stop, p.start or 0, S if p.stop is None else p.stop)
                     for _, r, p in held}, b, S)


def state_shardings(state, mesh: Mesh, rules):
    """NamedShardings for a tree whose nnx Variables carry logical `out_sharding` names (an nnx.State,
    or optimizer state built from one); other leaves are replicated."""
    rules = sharding.rules_dict(rules)

    def one(v):
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        if not names:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, sharding.logical_to_spec(tuple(names), v.shape, rules, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(cfg, mesh: Mesh, rows: int, length: int) -> NamedSharding:
    """Sharding of a global [M, rows, S] batch array: rows and positions split like activations (the
    sequence over the context axis)."""
    spec = sharding.logical_to_spec(("activation_batch", "activation_length"), (rows, length),
                                    sharding.rules_dict(cfg.logical_axis_rules), mesh)
    return NamedSharding(mesh, PartitionSpec(None, *spec))


def to_global(batch: dict, cfg, mesh) -> dict:
    """This process's rows [M, b_local, S] of its row group (`data_share`) -> global arrays [M, b, S], rows and
    positions sharded like activations. A process whose devices hold part of each row's positions (a context
    group spanning processes) keeps only its own token range of the rows it was given."""
    share = data_share(cfg, mesh)
    out = {}
    for k, x_MBS in batch.items():
        x_MBS = np.asarray(x_MBS)
        M, b, S = x_MBS.shape
        shard = batch_sharding(cfg, mesh, b * share.groups, S)
        if jax.process_count() == 1:
            out[k] = jax.device_put(x_MBS, shard)
        else:
            local = x_MBS[..., share.start:share.stop]
            out[k] = jax.make_array_from_process_local_data(shard, local, (M, b * share.groups, S))
    return out


def peak_flops_per_device(device=None) -> float:
    """Peak dense FLOP/s of one device: the table for accelerators, a quick fp32 matmul measure on CPU."""
    d = device or jax.devices()[0]
    kind = getattr(d, "device_kind", "").lower()
    for k, v in PEAK_FLOPS.items():
        if k in kind:
            return v
    n = 1024
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(3):  # best of three: the machine may be busy
        t = time.perf_counter()
        for _ in range(5):
            y = f(x)
        y.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 5 * 2 * n**3 / best / max(len(jax.local_devices()), 1)
