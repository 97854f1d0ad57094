"""Orbax checkpoints of the train state, the grain iterator state and the step.

Layout: {run_dir}/checkpoints/{step}/{state,data,meta}. Saves are async when configured;
`latest_step` + `restore` give automatic resume. Restoring into a model of another shape
fails with a `CheckpointError` naming every mismatched parameter and both shapes.
"""

from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    pass


def _path_str(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


class Checkpointer:
    def __init__(self, directory, cfg):
        self.directory = Path(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_checkpoints_to_keep,
            save_interval_steps=cfg.checkpoint_period,
            enable_async_checkpointing=cfg.async_checkpointing,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory.absolute(), options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self):
        return self.manager.latest_step()

    def save(self, step: int, state, data_iter, meta: dict, force: bool = False) -> bool:
        """Saves at the configured interval (or always with force); a step already saved is kept."""
        if step in self.manager.all_steps():
            return False
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        return self.manager.save(step, args=ocp.args.Composite(**args), force=force)

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
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
