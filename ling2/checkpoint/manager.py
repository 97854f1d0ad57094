"""The trainer's checkpoints: orbax step directories of the train state, the grain iterator state and the step.

Layout: {run_dir}/checkpoints/{step}/{state,data,meta}, meta holding the step and the resolved config.
`latest_step` + `restore` give automatic resume. Restoring into a model of another shape fails with a
`CheckpointError` naming every mismatched parameter and both shapes.

An async save blocks the loop only while it copies the state (later steps donate its buffers;
accelerators copy to pinned host memory) and takes the data position; a background thread then runs
orbax's whole save (orbax's own async mode spends ~0.2 s of per-leaf bookkeeping before returning).
One save at a time: `wait`, `close` and the next save finish it and raise its error. Orbax's barriers
go through the jax.distributed client (`active_processes` = all processes), which is safe off the
main thread; its default device-collective barriers are not.
"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from ling2.checkpoint.state import CheckpointError
from ling2.config import to_yaml

CONFIG_KEY = "config"  # the resolved config YAML each step's `meta` item records


def _path_str(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def snapshot(tree, memory_kind=None):
    """A copy of `tree`'s jax arrays, same shardings, that later (donating) steps cannot touch; ready on return.

    memory_kind "pinned_host" copies to host memory (accelerators); None keeps each array's own."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    dst = [leaves[i].sharding.with_memory_kind(memory_kind) if memory_kind else leaves[i].sharding for i in idx]
    copies = jax.block_until_ready(jax.device_put([leaves[i] for i in idx], dst, may_alias=False))
    for i, c in zip(idx, copies):
        leaves[i] = c
    return jax.tree.unflatten(treedef, leaves)


class _DataState:
    """A data iterator's `get_state()` taken at save time (grain's handler calls `get_state`)."""

    def __init__(self, it):
        self.state = it.get_state()

    def get_state(self):
        return self.state


class Checkpointer:
    def __init__(self, directory, cfg):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)  # orbax: no create=True with active_processes
        self.period = cfg.checkpoint_period
        self.config_yaml = to_yaml(cfg)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_checkpoints_to_keep,
            enable_async_checkpointing=False,  # our thread runs the whole save
            create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                active_processes=set(range(jax.process_count()))),
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
        self._pool = ThreadPoolExecutor(1, "checkpoint") if cfg.async_checkpointing else None
        self._pending = None  # (step, Future) of the save in flight
        self._last = self.manager.latest_step()

    def latest_step(self):
        return self.manager.latest_step()

    def due(self, step: int) -> bool:
        """Whether `save` would write `step` without force (a period step after the last saved)."""
        return step % self.period == 0 and (self._last is None or step > self._last)

    def save(self, step: int, state, data_iter, meta: dict, force: bool = False) -> bool:
        """Saves every `checkpoint_period`-th step (any step with force), never one at or before the last
        saved. Async: returns once `state` and the data position are copied. `meta` gets the resolved
        config as YAML under CONFIG_KEY (what `ling2.checkpoint.state.read_config` of the step reads)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()  # a failed background save surfaces at the next step
        if self._last is not None and step <= self._last:
            return False
        if not (force or step % self.period == 0):
            return False
        self.wait()
        if self._pool is not None:
            state = snapshot(state, None if jax.default_backend() == "cpu" else "pinned_host")
        meta = {**meta, CONFIG_KEY: self.config_yaml}
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(_DataState(data_iter))
        args = ocp.args.Composite(**args)
        self._last = step
        if self._pool is None:
            self.manager.save(step, args=args, force=True)
        else:
            self._pending = step, self._pool.submit(self.manager.save, step, args=args, force=True)
        return True

    def check_shapes(self, step: int, target) -> None:
        """Raises CheckpointError listing every parameter whose saved shape differs from `target`'s."""
        saved = self.manager.item_metadata(step)["state"]
        saved_flat = {_path_str(p): getattr(v, "shape", None) for p, v in jax.tree_util.tree_leaves_with_path(saved)}
        want_flat = {_path_str(p): tuple(np.shape(v)) for p, v in jax.tree_util.tree_leaves_with_path(target)}
        bad = []
        for k in sorted(set(saved_flat) | set(want_flat)):
            s, w = saved_flat.get(k, "missing"), want_flat.get(k, "missing")
            if s is not None and s != "missing":
                s = tuple(s)
            if s != w:
                bad.append(f"  {k}: checkpoint {s} vs model {w}")
        if bad:
            raise CheckpointError(f"{self.directory / str(step)}: checkpoint does not match the model:\n" + "\n".join(bad))

    def restore(self, step: int, target, data_iter):
        """Restores into `target` (a pytree of arrays or ShapeDtypeStructs with shardings) and `data_iter`."""
        self.check_shapes(step, target)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        args = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return out["state"], out["meta"]

    def wait(self):
        """Blocks until the save in flight is on disk; its error is raised here as a CheckpointError."""
        if self._pending is None:
            return
        (step, future), self._pending = self._pending, None
        try:
            future.result()
        except Exception as e:
            raise CheckpointError(f"{self.directory / str(step)}: saving the checkpoint failed: {e}") from e

    def close(self):
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self.manager.close()
