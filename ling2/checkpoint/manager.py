"""The trainer's checkpoints: orbax step directories of the train state, the grain iterator state,
the step and the run's resolved config; a checksum of every file; resume from the newest good step.

Layout: {run_dir}/checkpoints/{step}/{state,data,meta,config} + checksums.json. `resume_step` picks
the newest step that verifies and `restore` restores it; `saved_config(step_dir)` reads a
checkpoint's config back. Restoring into a model of another shape fails with a `CheckpointError`
naming every mismatched parameter and both shapes; resuming under a changed config is checked by
`check_resume_config` (see `ling2.config.schema.resume_class`).

Integrity: process 0 records the size and CRC-32 of every file of a step in `checksums.json`. The
commit is atomic: orbax writes a step into `{step}.orbax-checkpoint-tmp`, its finalize renames that to
a sealed name that is still temporary to orbax, `checksums.json` is written there, and one rename
publishes the step with its checksums (`_StepPath`). A crash at any point leaves either the whole
step or no step; orbax removes the temporary directories when the next run starts. On resume every
file is checked again (the files are split over the processes); a step that is empty, lacks an item,
its metadata or `checksums.json`, or whose bytes changed is reported, moved aside to
`{step}.rejected`, and the newest good step before it is used.

Crash tests: `$LING2_CHECKPOINT_KILL=phase:step` makes the process SIGKILL itself when the save of
`step` reaches `phase`, one of `SAVE_PHASES` (in their order in a save; those between "begin" and
"done" happen on process 0 only).

An async save blocks the loop only while it copies the state (later steps donate its buffers;
accelerators copy to pinned host memory) and takes the data position; a background thread then runs
orbax's whole save (orbax's own async mode spends ~0.2 s of per-leaf bookkeeping before returning).
One save at a time: `wait`, `close` and the next save finish it and raise its error (one line; a
full disk is named as such); `poll`, which the trainer calls every step, raises it as soon as the save has
failed, without waiting for one in flight. Orbax's barriers go through the jax.distributed client
(`active_processes` = all processes), which is safe off the main thread; its default
device-collective barriers are not.
"""

import errno
import json
import logging
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from ling2.checkpoint import save_noise
from ling2.checkpoint.state import CONFIG_NAME, CheckpointError, published_steps, read_config
from ling2.config import ConfigError, load_config
from ling2.config.files import crc32
from ling2.config.loader import without_removed
from ling2.config.schema import RESUME_FIXED, RESUME_WARN, resume_class

CHECKSUMS = "checksums.json"
CONFIG_ITEM = "config"
REJECTED = ".rejected"
ITEMS = ("state", "meta", CONFIG_ITEM)  # and "data" when the run has a data iterator
SEALED = "-sealed"  # appended to orbax's temporary name: the step is whole, its checksums not yet written

KILL_ENV = "LING2_CHECKPOINT_KILL"
SAVE_PHASES = (
    "begin",        # the save starts (async: on the checkpoint thread); nothing written
    "created",      # orbax's temporary step directory exists, no item in it yet
    "written",      # every item written; orbax's finalize (commit time, commit_success.txt) not yet run
    "sealed",       # orbax's finalize done, the directory renamed to its sealed name
    "checksummed",  # checksums.json written in the sealed directory
    "published",    # renamed to {step}: the commit point
    "done",         # orbax's save returned (older steps past max_checkpoints_to_keep removed)
)


def _phase(name: str, step) -> None:
    """A point of the save sequence; the process kills itself here when $LING2_CHECKPOINT_KILL names it."""
    if os.environ.get(KILL_ENV) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


class ResumeConfigError(CheckpointError):
    """Resuming a checkpoint under a config that changes the model, the data or the batch shape."""


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


def _files(step_dir: Path) -> list[str]:
    """Every file under a step directory but the checksum file, as sorted relative paths."""
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def write_checksums(step_dir) -> dict:
    """Records {file: [size, crc32]} of every file of a finished step directory in checksums.json
    (written to a temporary name, then renamed: the file exists only once it is whole)."""
    step_dir = Path(step_dir)
    files = {f: [(step_dir / f).stat().st_size, crc32(step_dir / f)] for f in _files(step_dir)}
    tmp = step_dir / (CHECKSUMS + ".tmp")
    tmp.write_text(json.dumps({"algorithm": "crc32", "files": files}, indent=0))
    os.replace(tmp, step_dir / CHECKSUMS)
    return files


def verify(step_dir, items=ITEMS, part: int = 0, parts: int = 1, whole: bool = True) -> Optional[str]:
    """None when a step directory is whole, else why not: empty, no checksums.json (an unfinished
    save), a missing item or file, or a file whose size or CRC-32 differs from the one recorded at
    save. Only every `parts`-th recorded file from `part` on is read (the processes split them).
    whole=False checks only the files of `items` (a reader of the weights alone needs its state item)."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir() or not any(step_dir.iterdir()):
        return "empty directory"
    path = step_dir / CHECKSUMS
    if not path.is_file():
        return f"no {CHECKSUMS} (the save did not finish)"
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, not a mapping of file to [size, crc32]")
        files = {str(k): (int(v[0]), int(v[1])) for k, v in files.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as e:
        return f"{CHECKSUMS} unreadable ({e})"
    outside = next((f for f in files if Path(f).is_absolute() or ".." in Path(f).parts), None)
    if outside is not None:
        return f"{CHECKSUMS} names {outside!r}, outside the step directory"
    for item in items:
        if not (step_dir / item).is_dir():
            return f"item {item!r} missing"
        if not any(f.startswith(item + "/") for f in files):
            return f"item {item!r} not in {CHECKSUMS}"
    if "meta" in items and step_dir.name.isdigit():  # a step directory renamed, copied or linked to another's name
        try:
            saved_step = json.loads((step_dir / "meta" / "metadata").read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            saved_step = None  # the checksums below name the damaged file
        if saved_step is not None and saved_step != int(step_dir.name):
            return f"meta/metadata says step {saved_step!r}: the directory holds another step's checkpoint"
    if not whole:
        files = {f: v for f, v in files.items() if f.split("/", 1)[0] in items}
    gone = [f for f in files if not (step_dir / f).is_file()]
    if gone:
        more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
        return f"missing file{'s' if len(gone) > 1 else ''} {', '.join(gone[:3])}{more}"
    for f in sorted(files)[part::parts]:
        size, crc = files[f]
        have = (step_dir / f).stat().st_size
        if have != size:
            return f"{f}: {have} bytes, {size} when saved"
        if crc32(step_dir / f) != crc:
            return f"{f}: checksum mismatch (its bytes changed after the save)"
    return None


def saved_config(step_dir):
    """The resolved Config saved with a checkpoint: a trainer step directory's `config` item, or a
    state directory's config.yml (`ling2.checkpoint.state`). Raises CheckpointError when there is none
    or it does not load under today's schema."""
    step_dir = Path(step_dir)
    if (step_dir / CONFIG_NAME).is_file():
        return read_config(step_dir / CONFIG_NAME)
    path = step_dir / CONFIG_ITEM / "metadata"
    if not path.is_file():
        raise CheckpointError(f"{step_dir}: no saved config (neither {CONFIG_ITEM}/metadata nor {CONFIG_NAME})")
    try:
        return load_config(without_removed(json.loads(path.read_text())))
    except (json.JSONDecodeError, ConfigError) as e:
        raise CheckpointError(f"{path}: saved config does not load: {e}") from None


def config_changes(saved, cfg) -> dict:
    """{field: (saved value, new value)} of every field that differs between two configs."""
    a, b = saved.model_dump(mode="json"), cfg.model_dump(mode="json")
    return {k: (a.get(k), b[k]) for k in b if a.get(k) != b[k]}


def check_resume_config(saved, cfg, saved_global_batch: Optional[int] = None,
                        global_batch: Optional[int] = None) -> list[str]:
    """Compares the config a checkpoint was saved with to the one resuming it.

    Raises ResumeConfigError with a diff of every refused change (`resume_class` "fixed": model,
    data, tokens, batch shape; also a different global batch, e.g. from a new device count).
    Returns warning lines for the allowed changes that alter training ("warn": optimizer,
    schedule, steps, loss weights, compute dtype)."""
    changes = config_changes(saved, cfg)
    fixed = {k: v for k, v in changes.items() if resume_class(k) == RESUME_FIXED}
    lines = [f"  {k}: {a!r} -> {b!r}" for k, (a, b) in sorted(fixed.items())]
    if saved_global_batch is not None and global_batch is not None and saved_global_batch != global_batch:
        lines.append(f"  global batch (sequences per step): {saved_global_batch} -> {global_batch}")
    if lines:
        raise ResumeConfigError(
            "the config changes what the checkpoint was trained as (model, data or batch shape); resume with the "
            "saved values, or start a new run_dir with load_parameters_path set to this checkpoint:\n"
            + "\n".join(lines))
    return [f"warning: resuming with {k} changed: {a!r} -> {b!r}" for k, (a, b) in sorted(changes.items())
            if resume_class(k) == RESUME_WARN]


def _all_processes(flags: list[bool]) -> list[bool]:
    """Element-wise OR of `flags` over all processes (every process gets the same answer)."""
    if jax.process_count() == 1 or not flags:
        return flags
    from jax.experimental import multihost_utils
    got = multihost_utils.process_allgather(np.asarray(flags, np.int32))
    return [bool(x) for x in np.asarray(got).reshape(jax.process_count(), -1).any(axis=0)]


def _no_space(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        text = str(e)
        if "No space left on device" in text or "os_error_code='28'" in text or "ENOSPC" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


class _OrbaxErrorsRaisedByUs(logging.Filter):
    """Orbax logs a failed save's traceback before it raises; we raise it once, as a CheckpointError."""

    def filter(self, record):
        return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname.replace(os.sep, "/"))


_ORBAX_FILTER = _OrbaxErrorsRaisedByUs()


def _step_path_class(root: Path):
    """orbax's atomic-rename temporary path, for the step directories under `root`: `checksums.json` is
    written into the finished directory before the rename that publishes it. (orbax uses the class for
    the items' directories inside a step too; those are left to orbax.)"""

    class _StepPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
        def _step(self) -> Optional[str]:
            final = Path(str(self.get_final()))
            return final.name if final.parent == root else None

        async def create(self):
            path = await super().create()
            if (step := self._step()) is not None:
                _phase("created", step)
            return path

        async def finalize(self):
            step = self._step()
            if step is None:
                return await super().finalize()
            _phase("written", step)
            final = self.get_final()
            sealed = root / (Path(str(self.get())).name + SEALED)
            if sealed.exists():
                shutil.rmtree(sealed)  # left by a crashed save of the same step
            self._final_path = type(final)(sealed)  # orbax's finalize ends renaming its directory to this
            try:
                await super().finalize()
            finally:
                self._final_path = final
            _phase("sealed", step)
            write_checksums(sealed)
            _phase("checksummed", step)
            os.rename(sealed, root / step)
            _phase("published", step)

    return _StepPath


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
        self.cfg = cfg
        self.period = cfg.checkpoint_period
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_checkpoints_to_keep,
            enable_async_checkpointing=False,  # our thread runs the whole save
            create=False,
            cleanup_tmp_directories=True,  # what crashed saves left
            temporary_path_class=_step_path_class(self.directory),
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                active_processes=set(range(jax.process_count()))),
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler(), CONFIG_ITEM: ocp.JsonCheckpointHandler()})
        logging.getLogger("absl").addFilter(_ORBAX_FILTER)
        save_noise.install()
        self._pool = ThreadPoolExecutor(1, "checkpoint") if cfg.async_checkpointing else None
        self._pending = None  # (step, Future) of the save in flight
        self._last = self.manager.latest_step()
        self._verified = set()

    def latest_step(self):
        """The newest step directory orbax knows (verified or not; `resume_step` picks a good one)."""
        return self.manager.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """The published step directories, oldest first (a save in flight is not among them: `wait` first)."""
        return published_steps(self.directory)

    def resume_step(self, log: Callable[[str], None] = print, data: bool = True) -> Optional[int]:
        """The newest step that verifies (see the module doc), or None when there is no checkpoint.

        Newer steps that do not verify are logged with the reason and moved aside to
        `{step}.rejected`. Raises CheckpointError when checkpoints exist but none verifies.
        `data`: whether the run restores a data iterator (the `data` item is then required)."""
        items = ITEMS + (("data",) if data else ())
        steps = sorted(self.manager.all_steps(), reverse=True)
        rank, parts = jax.process_index(), jax.process_count()
        reasons = [verify(self.step_dir(s), items, rank, parts) for s in steps]
        bad = _all_processes([r is not None for r in reasons])
        good = next((s for s, b in zip(steps, bad) if not b), None)
        rejected = [(s, r or "a file failed verification on another process")
                    for s, r, b in zip(steps, reasons, bad) if b and (good is None or s > good)]
        if good is None and rejected:
            raise CheckpointError(f"{self.directory}: no usable checkpoint; move or delete these to start the run "
                                  "from scratch:\n" + "\n".join(f"  {s}: {r}" for s, r in rejected))
        for s, r in rejected:
            log(f"warning: checkpoint {self.step_dir(s)} is unusable ({r}); moved to {s}{REJECTED}, "
                f"resuming from step {good}")
        if rejected:
            if jax.process_index() == 0:
                for s, _ in rejected:
                    dst = self.directory / f"{s}{REJECTED}"
                    n = 1
                    while dst.exists():
                        n += 1
                        dst = self.directory / f"{s}{REJECTED}.{n}"
                    os.replace(self.step_dir(s), dst)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils
                multihost_utils.sync_global_devices("ling2_checkpoint_rejected")
            self.manager.reload()
            self._last = self.manager.latest_step()
        if good is not None:
            self._verified.add(good)
        return good

    def check_resume_config(self, step: int, cfg, global_batch: Optional[int] = None) -> list[str]:
        """`check_resume_config` of this step's saved config (and global batch) against `cfg`."""
        d = self.step_dir(step)
        try:
            meta = json.loads((d / "meta" / "metadata").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{d / 'meta' / 'metadata'}: unreadable ({e})") from None
        return check_resume_config(saved_config(d), cfg, meta.get("global_batch"), global_batch)

    def due(self, step: int) -> bool:
        """Whether `save` would write `step` without force (a period step after the last saved)."""
        return step % self.period == 0 and (self._last is None or step > self._last)

    def save(self, step: int, state, data_iter, meta: dict, force: bool = False) -> bool:
        """Saves every `checkpoint_period`-th step (any step with force), never one at or before the last
        saved. Async: returns once `state` and the data position are copied."""
        self.poll()
        if self._last is not None and step <= self._last:
            return False
        if not (force or step % self.period == 0):
            return False
        self.wait()
        if self._pool is not None:
            state = snapshot(state, None if jax.default_backend() == "cpu" else "pinned_host")
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta),
                CONFIG_ITEM: ocp.args.JsonSave(self.cfg.model_dump(mode="json"))}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(_DataState(data_iter))
        args = ocp.args.Composite(**args)
        self._last = step
        if self._pool is None:
            try:
                self._commit(step, args)
            except Exception as e:
                raise self._save_error(step, e) from None
        else:
            self._pending = step, self._pool.submit(self._commit, step, args)
        return True

    def _commit(self, step: int, args) -> None:
        _phase("begin", step)
        self.manager.save(step, args=args, force=True)
        _phase("done", step)

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        """One line for a failed save (orbax's own messages run to pages); its partial files are removed."""
        if jax.process_index() == 0:
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        where = self.step_dir(step)
        if _no_space(e):
            return CheckpointError(f"{where}: disk full (no space left on device) while saving the checkpoint; "
                                   f"the newest complete checkpoint in {self.directory} is kept. Free space or use "
                                   "another --run_dir.")
        first = next((line for line in str(e).splitlines() if line.strip()), "")[:500]
        return CheckpointError(f"{where}: saving the checkpoint failed: {type(e).__name__}: {first}")

    def check_shapes(self, step: int, target) -> None:
        """Raises CheckpointError listing every parameter whose saved shape differs from `target`'s."""
        saved = self.manager.item_metadata(step)["state"]
        if saved is None:
            raise CheckpointError(f"{self.step_dir(step)}: the state item is missing")
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
            raise CheckpointError(f"{self.step_dir(step)}: checkpoint does not match the model:\n" + "\n".join(bad))

    def restore(self, step: int, target, data_iter):
        """Restores into `target` (a pytree of arrays or ShapeDtypeStructs with shardings) and `data_iter`,
        after verifying the step's files (unless `resume_step` just did)."""
        if step not in self._verified:
            items = ITEMS + (("data",) if data_iter is not None else ())
            reason = verify(self.step_dir(step), items, jax.process_index(), jax.process_count())
            if _all_processes([reason is not None])[0]:
                raise CheckpointError(f"{self.step_dir(step)}: checkpoint is unusable: "
                                      f"{reason or 'a file failed verification on another process'}")
            self._verified.add(step)
        self.check_shapes(step, target)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        args = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return out["state"], out["meta"]

    def poll(self):
        """Raises a finished background save's error (a CheckpointError naming its step and cause); returns at once
        while the save is still running or when it succeeded."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self):
        """Blocks until the save in flight is on disk; its error is raised here as a CheckpointError."""
        if self._pending is None:
            return
        (step, future), self._pending = self._pending, None
        try:
            future.result()
        except Exception as e:
            raise self._save_error(step, e) from None

    def close(self):
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self.manager.close()
