"""Crash tests of checkpoint saves: a small checkpointed loop that makes the trainer's Checkpointer calls
(resume_step, restore, save every step, close) on a tiny state, run in child processes that SIGKILL
themselves at a named phase of a save (`$LING2_CHECKPOINT_KILL`, `ling2.checkpoint.manager.SAVE_PHASES`).

The children are forked from a server process that has imported JAX, orbax and grain once (and started
no JAX backend, so forking it is safe): a child costs a fraction of a second rather than the few seconds
of a fresh interpreter, which is what makes dozens of kills affordable in one test. The server talks over
its stdin and stdout (no sockets: a test's temporary directory can be too long for a socket path).
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ling2.checkpoint.manager import KILL_ENV, Checkpointer
from ling2.checkpoint.testing.iterators import Counter
from ling2.config import load_config

RESULT = "resumed.json"


def cfg():
    return load_config(model_name="ling2-micro", async_checkpointing=True, checkpoint_period=1,
                       max_checkpoints_to_keep=1000)


def initial():
    return {"w": jax.random.normal(jax.random.key(0), (64, 64)), "step": jnp.int32(0)}


@jax.jit
def _update(state, batch):
    return {"w": jnp.sin(state["w"] * 1.5 + batch * 0.01), "step": state["step"] + 1}


def step_fn():
    """The update, donating its state like the trainer's step (a save must hold its own copy)."""
    return jax.jit(_update, donate_argnums=0)


def trajectory(steps: int) -> list:
    """The uninterrupted run's `w` after each step, [0..steps]: the reference every resume must match bit for bit."""
    s, out = initial(), []
    out.append(np.asarray(s["w"]))
    for n in range(1, steps + 1):
        s = _update(s, n)
        out.append(np.asarray(s["w"]))
    return out


def run(run_dir, steps: int, kill=None) -> None:
    """Trains `steps` steps in `run_dir`, resuming from its newest good checkpoint and saving every step.

    Writes {"resumed": step or 0, "log": [lines]} to `run_dir/resumed.json` once resumed, and the final
    `w` to `run_dir/final.npy`. kill: (phase, step), the point of a save where the process kills itself."""
    if kill is not None:
        os.environ[KILL_ENV] = f"{kill[0]}:{kill[1]}"
    run_dir = Path(run_dir)
    log = []
    ck = Checkpointer(run_dir / "checkpoints", cfg())
    it, state = Counter(), initial()
    start = ck.resume_step(log.append) or 0
    if start:
        state, meta = ck.restore(start, state, it)
        assert meta["step"] == start == it.n, (meta, start, it.n)
    (run_dir / RESULT).write_text(json.dumps({"resumed": start, "log": log}))
    update = step_fn()
    for step in range(start + 1, steps + 1):
        state = update(state, next(it))
        ck.save(step, state, it, {"step": step})
    ck.close()
    np.save(run_dir / "final.npy", np.asarray(state["w"]))


def serve() -> None:
    """The fork server's loop: a request per stdin line, JSON [run_dir, steps, kill]; forks a child that runs
    `run` and answers two lines, the child's pid and then its exit code (negative: the signal that ended it)."""
    for line in sys.stdin:
        run_dir, steps, kill = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)  # the child's output goes to stderr, not into the replies
            code = 0
            try:
                run(run_dir, steps, kill)
            except BaseException:  # noqa: BLE001 - reported as exit code 1, with its traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)


class ForkServer:
    """`run(run_dir, steps, kill)` in a child forked from a server process (see the module doc)."""

    def __init__(self):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen([sys.executable, "-c", f"import {__name__} as m; m.serve()"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _line(self, deadline: float) -> str:
        fd, out = self.proc.stdout.fileno(), b""
        while not out.endswith(b"\n"):
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            byte = os.read(fd, 1)
            if not byte:
                raise AssertionError(f"the fork server exited ({self.proc.wait()})")
            out += byte
        return out.decode()

    def run(self, run_dir, steps: int, kill=None, timeout: float = 120) -> int:
        """The child's exit code: 0 when it finished, -9 when it killed itself at `kill` (phase, step)."""
        self.proc.stdin.write((json.dumps([str(run_dir), steps, kill]) + "\n").encode())
        deadline = time.monotonic() + timeout
        pid = int(self._line(deadline))
        try:
            return int(self._line(deadline))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the child saving to {run_dir} (kill at {kill}) ran past {timeout}s") from None

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
