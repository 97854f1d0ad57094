"""A 2-process multi-host run (jax.distributed, gloo CPU collectives) on localhost completes, saving a
checkpoint every step from the background save thread (orbax barriers through the distributed client),
and a second 2-process run resumes from its last checkpoint. SIGTERM to one process stops both at the
same step, with one checkpoint of it."""

import re
import signal
import socket

from ling2.train.testing import e2e


def start_two_processes(tmp_path, *overrides):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [e2e.start(tmp_path, *overrides, "async_checkpointing=true", LING2_COORDINATOR=f"127.0.0.1:{port}",
                      LING2_NUM_PROCESSES="2", LING2_PROCESS_ID=str(i), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
            for i in range(2)]


def run_two_processes(tmp_path, steps):
    procs = start_two_processes(tmp_path, f"steps={steps}", "checkpoint_period=1", "max_checkpoints_to_keep=5")
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs


def test_two_process_multihost_run_completes_and_resumes(tmp_path):
    run_two_processes(tmp_path, 3)
    assert sorted(e2e.losses(tmp_path)) == [1, 2, 3]
    assert e2e.saved_steps(tmp_path) == [1, 2, 3]
    data_state = sorted(p.name for p in (tmp_path / "checkpoints" / "3" / "data").glob("*.json"))
    assert data_state == ["process_0-of-2.json", "process_1-of-2.json"]
    run_two_processes(tmp_path, 4)  # resumes at step 3 (restored state, both processes' data positions)
    assert e2e.saved_steps(tmp_path) == [1, 2, 3, 4] and sorted(e2e.losses(tmp_path)) == [1, 2, 3, 4]


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    procs = start_two_processes(tmp_path, "steps=100000", "checkpoint_period=100000")
    try:
        e2e.wait_for(lambda: e2e.logged(tmp_path) >= 1, procs[0], 600)
        procs[1].send_signal(signal.SIGTERM)  # process 0 gets no signal
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    stops = [re.findall(r"saving a checkpoint at step (\d+) and exiting", out) for out in outs]
    assert len(stops[0]) == len(stops[1]) == 1 and stops[0] == stops[1], outs
    step = int(stops[0][0])
    assert step >= 1 and e2e.saved_steps(tmp_path) == [step]
    assert max(e2e.losses(tmp_path)) == step  # neither process trained past the agreed step
