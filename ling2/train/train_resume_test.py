"""The trainer binary: kill -9 then resume reproduces the losses (and metrics.jsonl holds each step once);
SIGTERM saves and exits 0, or --preempted_exit_code."""

import json
import re
import signal
import subprocess

from ling2.train.metrics import read_metrics
from ling2.train.testing import e2e


def test_kill9_then_resume_reproduces_uninterrupted_losses(tmp_path):
    common = ["steps=40", "checkpoint_period=4", "async_checkpointing=true"]  # saves overlap later steps
    ref = e2e.start(tmp_path / "ref", *common)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out
    assert "checkpoints:" in out and "metrics:" in out
    want = e2e.losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, 41))

    run = tmp_path / "killed"
    p = e2e.start(run, *common)
    e2e.wait_for(lambda: any(s >= 8 for s in e2e.saved_steps(run)), p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(e2e.losses(run))
    assert killed_at < 40, "the run finished before it was killed"
    p = e2e.start(run, *common)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "resumed from" in out
    got = e2e.losses(run)
    assert sorted(got) == list(range(1, 41))
    assert got == want  # bit-identical per-step losses
    raw = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert raw == list(range(1, 41))  # the killed run's records past its checkpoint were dropped, not repeated
    # goodput: the steps the killed run had logged past the restored checkpoint are charged as lost work
    restored = int(re.search(r"resumed from .* \(step (\d+)\)", out).group(1))
    first = read_metrics(run / "metrics.jsonl")[restored]  # the resumed run's first record
    assert first.get("goodput/lost_steps", 0) == killed_at - restored
    assert (first["goodput/lost_s"] > 0) == (killed_at > restored)
    assert "goodput: " in out


def test_sigterm_saves_and_exits_zero(tmp_path):
    p = e2e.start(tmp_path, "steps=100000", "checkpoint_period=1000")
    e2e.wait_for(lambda: e2e.logged(tmp_path) >= 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "received SIGTERM" in out
    saved = e2e.saved_steps(tmp_path)
    assert saved and saved[-1] >= 2 and saved[-1] < 1000


def test_preempted_exit_code_tells_a_signal_stop_from_the_end(tmp_path):
    """--preempted_exit_code (tools/launch sets 75): a SIGTERM stop saves and exits with it, so a launcher
    requeues; a run that reaches its last step still exits 0."""
    def start(run_dir, *overrides):
        return subprocess.Popen(e2e.binary() + [f"--run_dir={run_dir}", "--notensorboard", "--preempted_exit_code=75",
                                                "--", *e2e.MICRO, *overrides],
                                env=e2e.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    p = start(tmp_path / "stopped", "steps=100000", "checkpoint_period=1000")
    e2e.wait_for(lambda: e2e.logged(tmp_path / "stopped") >= 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 75, out
    assert e2e.saved_steps(tmp_path / "stopped")[-1] >= 2
    p = start(tmp_path / "done", "steps=2")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and e2e.saved_steps(tmp_path / "done") == [2], out


def test_grain_workers_end_with_the_trainer(tmp_path):
    """With grain_worker_count > 0 the read-ahead runs in processes of the trainer's own; they end with it, whether
    it finishes or is killed (-9: nothing of it runs), so its stdout reaches its end. Killed, they used to outlive it
    for good, holding the pipe open: a caller waiting for its output hung."""
    workers = ["grain_worker_count=1", "eval_interval=2", "eval_steps=1"]
    p = e2e.start(tmp_path / "done", "steps=3", *workers)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    p = e2e.start(tmp_path / "killed", "steps=100000", *workers)
    e2e.wait_for(lambda: e2e.logged(tmp_path / "killed") >= 2, p)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)  # EOF: no worker holds the pipe
