"""Quiets what a failed orbax save prints besides its error, which the Checkpointer raises once as a
CheckpointError naming the step (for a full disk, a small model's save printed about 80 tracebacks).

When one write of a save fails, orbax's asyncio event loop ends with that error while tensorstore is
still finishing (and failing) the save's other writes. Each of them then reports to the closed loop:
`RuntimeError: Event loop is closed`, raised in `loop.call_soon_threadsafe` under tensorstore's C++
callback, reaches `sys.unraisablehook`, which prints its traceback. The write tasks that failed beside
the first are logged by asyncio as "Task exception was never retrieved". Nothing awaits these results
any more, so they are dropped; every other unraisable error and log record passes on unchanged.
"""

import logging
import os
import sys
import traceback
import warnings


def late_loop_callback(unraisable) -> bool:
    """Whether an unraisable error (`sys.UnraisableHookArgs`) is a callback into a closed asyncio loop."""
    e = unraisable.exc_value
    if unraisable.object is not None or not isinstance(e, RuntimeError) or str(e) != "Event loop is closed":
        return False
    return any(f.name == "call_soon_threadsafe" and f.filename.replace(os.sep, "/").endswith("asyncio/base_events.py")
               for f in traceback.extract_tb(unraisable.exc_traceback))


class _UnretrievedOrbaxTasks(logging.Filter):
    """Drops asyncio's error records about orbax's tasks and futures (their errors are the save's, raised
    once): the record names orbax (its code, or a path of its temporary step directory) or the error's
    traceback runs through orbax's code."""

    def filter(self, record):
        if record.levelno < logging.ERROR:
            return True
        where = [record.getMessage()]
        if record.exc_info and record.exc_info[2] is not None:
            where += [f.filename for f in traceback.extract_tb(record.exc_info[2])]
        return not any("orbax" in w for w in where)


_TASKS = _UnretrievedOrbaxTasks()


def install() -> None:
    """Filters this noise for the rest of the process (it can arrive after the save has returned its
    error); calling it again changes nothing. Also ignored: the RuntimeWarning for a coroutine never
    awaited, which the garbage collector reports for write coroutines orbax created but never started
    (Ling2 itself awaits nothing; its only coroutines are ones orbax runs)."""
    logging.getLogger("asyncio").addFilter(_TASKS)
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_loop_callbacks", False):
        return

    def hook(unraisable):
        if not late_loop_callback(unraisable):
            previous(unraisable)

    hook.drops_late_loop_callbacks = True
    sys.unraisablehook = hook
