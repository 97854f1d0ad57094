"""A failed save prints one error: the late tensorstore callbacks into orbax's closed event loop and
asyncio's unretrieved orbax tasks are dropped, every other unraisable error passes on."""

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

from ling2.checkpoint import save_noise


def _unraisable(e: BaseException, obj=None):
    return types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__, err_msg=None,
                                 object=obj)


def _closed_loop_error() -> RuntimeError:
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
        return e
    raise AssertionError("a closed loop accepted a callback")


def test_only_late_loop_callbacks_are_dropped(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    save_noise.install()
    save_noise.install()  # once
    late = _closed_loop_error()
    try:
        raise RuntimeError("Event loop is closed")  # the same words, raised elsewhere
    except RuntimeError as e:
        elsewhere = e
    others = [_unraisable(elsewhere), _unraisable(late, obj=object()), _unraisable(ValueError("x"))]
    for u in [_unraisable(late)] + others:
        sys.unraisablehook(u)
    assert seen == others


def test_only_asyncio_errors_of_orbax_are_dropped(caplog):
    save_noise.install()
    ns = {}
    exec(compile("def write():\n    raise ValueError('RESOURCE_EXHAUSTED')\n", "/venv/orbax/checkpoint/x.py", "exec"), ns)
    try:
        ns["write"]()
    except ValueError as e:
        orbax_error = (type(e), e, e.__traceback__)
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.WARNING):
        log.error("Task exception was never retrieved\nfuture: <Task coro=<f() defined at /venv/orbax/a.py:1>>")
        log.error("_GatheringFuture exception was never retrieved", exc_info=orbax_error)
        log.error("Task exception was never retrieved\nfuture: <Task coro=<g() defined at /app/mine.py:1>>")
        log.warning("slow callback in /venv/orbax/a.py")
    assert [r.getMessage().split(" defined")[0] for r in caplog.records] == [
        "Task exception was never retrieved\nfuture: <Task coro=<g()", "slow callback in /venv/orbax/a.py"]
    with warnings.catch_warnings(record=True) as seen:
        save_noise.install()
        warnings.warn("coroutine 'async_serialize_from_host.<locals>.write_fragment' was never awaited",
                      RuntimeWarning)
        warnings.warn("something else", RuntimeWarning)
    assert [str(w.message) for w in seen] == ["something else"]


def test_disk_full_during_a_save_prints_one_line(tmp_path):
    """A real full disk (a 200 KiB tmpfs) under a save of 40 arrays, sync and async, in a process of its own
    (pytest replaces sys.unraisablehook): stderr is the one CheckpointError line. Before, tensorstore's
    writes failing after orbax's event loop had closed printed dozens of `Event loop is closed` tracebacks."""
    small = tmp_path / "small"
    small.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)],
                                 capture_output=True).returncode == 0
    except OSError:
        mounted = False
    if not mounted:
        pytest.skip("needs a tmpfs mount (root)")
    script = textwrap.dedent("""
        import sys
        import time

        import jax
        from ling2.checkpoint.manager import CheckpointError, Checkpointer
        from ling2.config import load_config

        for async_save in (False, True):
            cfg = load_config(model_name="ling2-micro", async_checkpointing=async_save, checkpoint_period=2)
            ck = Checkpointer(f"{sys.argv[1]}/ck{int(async_save)}", cfg)
            state = {f"w{i}": jax.random.normal(jax.random.key(i), (100, 100)) for i in range(40)}
            try:
                ck.save(2, state, None, {}, force=True)
                ck.close()
            except CheckpointError as e:
                print(f"error: {e}", file=sys.stderr)
            time.sleep(1)  # tensorstore's other writes fail and report after the error is raised
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", script, str(small)], env=env, capture_output=True, text=True,
                           timeout=300)
    finally:
        subprocess.run(["umount", str(small)])
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr[-3000:]
    for n, line in enumerate(lines):
        assert line.startswith("error: ") and f"ck{n}/2: disk full (no space left on device)" in line, line
