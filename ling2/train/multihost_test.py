"""A 2-process multi-host run (jax.distributed, gloo CPU collectives) on localhost completes, saving a
checkpoint every step from the background save thread (orbax barriers through the distributed client),
and a second 2-process run resumes from its last checkpoint. SIGTERM to one process stops both at the
same step, with one checkpoint of it. One sequence split over a context axis spanning both processes (each
reads its own token range of the same rows) trains as one process holding all 8 devices, through a kill -9
and a resume."""

import re
import signal
import socket

import numpy as np

from ling2.checkpoint.manager import saved_config
from ling2.checkpoint.state import flat, load_state
from ling2.train.testing import e2e


def start_two_processes(tmp_path, *overrides, devices: int = 1):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
    return [e2e.start(tmp_path, *overrides, "async_checkpointing=true", LING2_COORDINATOR=f"127.0.0.1:{port}",
                      LING2_NUM_PROCESSES="2", LING2_PROCESS_ID=str(i), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                      **flags)
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


CONTEXT = e2e.CONTEXT_8


def test_context_group_across_two_processes_equals_one_process_through_a_kill(tmp_path):
    one = tmp_path / "one"
    p = e2e.start(one, *CONTEXT, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = p.communicate(timeout=900)[0]
    assert p.returncode == 0, out

    two = tmp_path / "two"
    procs = start_two_processes(two, *CONTEXT, devices=4)
    try:
        e2e.wait_for(lambda: 2 in e2e.saved_steps(two), procs[0], 900)
    finally:
        for q in procs:
            q.kill()  # kill -9: no save, no goodbye
            q.communicate()
    assert max(e2e.saved_steps(two)) < 8  # killed mid-run
    procs = start_two_processes(two, *CONTEXT, devices=4)
    outs = [q.communicate(timeout=900)[0] for q in procs]
    assert [q.returncode for q in procs] == [0, 0], outs
    assert any("resumed from" in o for o in outs), outs

    want, got = e2e.losses(one), e2e.losses(two)
    steps = list(range(1, 9))
    assert sorted(want) == steps and sorted(got) == steps
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=2e-5)
    cfg = saved_config(one / "checkpoints" / "8")
    a, b = (flat(load_state(d / "checkpoints" / "8", cfg)) for d in (one, two))
    assert sorted(a) == sorted(b)
    for path in a:  # float32 sums reordered across processes, through 8 Adam steps: per leaf, relative in norm
        x, y = np.asarray(a[path], np.float64), np.asarray(b[path], np.float64)
        assert np.linalg.norm(y - x) <= 1e-5 * max(np.linalg.norm(x), 1e-30), path
