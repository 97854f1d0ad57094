"""kill -9 at every phase of a checkpoint save (`ling2.checkpoint.manager.SAVE_PHASES`): a step whose commit
completed is never lost, a step whose commit did not complete is never visible, and every resume continues
the uninterrupted run bit for bit.

The processes kill themselves ($LING2_CHECKPOINT_KILL=phase:step), so each kill lands exactly at its phase
and the test knows which steps committed: every save before the killed one, and the killed one from
"published" on. Many kills: a small checkpointed loop (`testing/crash.py`, the trainer's Checkpointer calls)
in forked children, checked against its own uninterrupted trajectory; every phase once: the trainer binary,
checked against an uninterrupted run's per-step losses.
"""

import json
import signal
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from ling2.checkpoint.manager import ITEMS, SAVE_PHASES, verify
from ling2.train.testing import crash, e2e

COMMITTED_FROM = SAVE_PHASES.index("published")
ROUNDS = 8  # of every phase: 56 kills


def visible_steps(checkpoints: Path) -> set:
    return {int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()}


def check_committed(checkpoints: Path, committed: set, where: str) -> None:
    """Exactly the committed steps are visible, and each verifies (every file as it was saved)."""
    assert visible_steps(checkpoints) == committed, (where, sorted(checkpoints.iterdir()))
    for s in sorted(committed):
        assert verify(checkpoints / str(s), ITEMS + ("data",)) is None, (where, s)


def next_kill(committed: set, phase: str, ahead: int):
    """(the step this run resumes from, the step whose save is killed, the steps committed after the kill)."""
    resume = max(committed, default=0)
    step = resume + ahead
    after = committed | set(range(resume + 1, step)) | ({step} if SAVE_PHASES.index(phase) >= COMMITTED_FROM else set())
    return resume, step, after


def test_kill9_at_every_save_phase_keeps_every_committed_step(tmp_path):
    """Eight rounds of a kill at each phase, each run resuming from what the last one left; the first kill
    after a publish leaves a single step, which must resume rather than be refused. Each committed step
    is restored once, when it first appears, and matches the uninterrupted trajectory."""
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    want = crash.trajectory(2 * ROUNDS * len(SAVE_PHASES) + 3)
    committed, restored, kills = set(), set(), 0
    reader = ocp.StandardCheckpointer()
    with crash.ForkServer() as forks:
        for rnd in range(ROUNDS):
            for phase in SAVE_PHASES:
                resume, step, after = next_kill(committed, phase, 1 + rnd % 2)
                where = f"kill at {phase}:{step}"
                (run / crash.RESULT).unlink(missing_ok=True)
                assert forks.run(run, step + 1, (phase, step)) == -signal.SIGKILL, where
                kills += 1
                got = json.loads((run / crash.RESULT).read_text())
                assert got == {"resumed": resume, "log": []}, where  # the newest committed step, none refused
                committed = after
                check_committed(checkpoints, committed, where)
                for s in sorted(committed - restored):
                    back = reader.restore(checkpoints / str(s) / "state")
                    np.testing.assert_array_equal(np.asarray(back["w"]), want[s], err_msg=f"{where}: step {s}")
                    assert int(back["step"]) == s
                    restored.add(s)
        assert kills >= 50 and committed == set(range(1, max(committed) + 1)) and len(committed) > 2 * ROUNDS
        last = max(committed) + 3
        assert forks.run(run, last) == 0
    reader.close()
    assert json.loads((run / crash.RESULT).read_text()) == {"resumed": max(committed), "log": []}
    np.testing.assert_array_equal(np.load(run / "final.npy"), want[last])
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(str(s) for s in range(1, last + 1))  # no leftovers


def test_trainer_killed_at_every_save_phase_resumes_bit_exact(tmp_path):
    """The trainer binary (async saves, one every step) killed once at each phase, each run resuming from the
    newest committed step; the last run finishes with the uninterrupted run's losses and one metrics record
    per step."""
    common = ["steps=12", "checkpoint_period=1", "max_checkpoints_to_keep=100", "async_checkpointing=true"]
    ref = e2e.start(tmp_path / "ref", *common)
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    committed = set()
    for phase in SAVE_PHASES:
        resume, step, after = next_kill(committed, phase, 2)
        p = e2e.start(run, *common, LING2_CHECKPOINT_KILL=f"{phase}:{step}", PYTHONUNBUFFERED="1")  # SIGKILL drops buffers
        out, _ = p.communicate(timeout=300)
        where = f"kill at {phase}:{step}"
        assert p.returncode == -signal.SIGKILL, f"{where}\n{out}"
        if resume:
            assert f"resumed from {checkpoints / str(resume)} (step {resume})" in out, f"{where}\n{out}"
        assert "unusable" not in out, f"{where}\n{out}"
        committed = after
        check_committed(checkpoints, committed, where)
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    want = e2e.losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, 13))
    p = e2e.start(run, *common)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert f"resumed from {checkpoints / str(max(committed))} (step {max(committed)})" in out, out
    assert e2e.losses(run) == want  # bit-identical per-step losses
    raw = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert raw == list(range(1, 13))
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(str(s) for s in range(1, 13))
