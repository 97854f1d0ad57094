"""tools/launch on a real SLURM (Debian's slurm-wlm: munged, slurmctld and slurmd started on this host by the
test): a 2-task job, 4 CPU devices per task, one sequence split 8 ways over the context axis across both
tasks. `scancel --signal=TERM` preempts it: both tasks save at one step and exit 75, the batch script requeues
the job, and the second start resumes to the end. Its losses and final weights equal, bit for bit, those of the
same job run uninterrupted. Requests the cluster cannot hold are named errors, exit 2."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ling2.checkpoint.manager import saved_config
from ling2.checkpoint.state import flat, load_state
from ling2.train.testing import e2e
from tools.launch import slurm_localhost

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = e2e.CONTEXT_8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    conf = slurm_localhost.start(folder)
    try:
        yield dict(e2e.env(), SLURM_CONF=str(conf), PYTHONPATH=str(ROOT))
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=dict(os.environ, SLURM_CONF=str(conf)))
        slurm_localhost.stop(folder)


def launch(env, *args, **extra_env):
    return subprocess.run([sys.executable, "-m", "tools.launch.slurm", *args], cwd=ROOT, env=dict(env, **extra_env),
                          capture_output=True, text=True)


def submit(env, run_dir) -> str:
    trainer = e2e.env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                      LING2_TRAIN=f"{e2e.binary()[0]} --notensorboard")
    out = launch(dict(env, **trainer), "--nodes=1", "--tasks_per_host=2", f"--run_dir={run_dir}",
                 "--", *e2e.MICRO, *CONTEXT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def job(env, job_id) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(env, job_id, pred, timeout=900):
    t = time.time()
    while not pred(info := job(env, job_id)):
        if time.time() - t > timeout:
            raise AssertionError(f"job {job_id} timed out: {info}")
        time.sleep(0.5)
    return info


def finished(info) -> bool:
    return info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def test_preempted_job_is_requeued_and_resumes_bit_for_bit(cluster, tmp_path):
    whole, preempted = tmp_path / "whole", tmp_path / "preempted"
    job_id = submit(cluster, whole)
    info = wait_job(cluster, job_id, finished)
    log = (whole / f"slurm-{job_id}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), log

    job_id = submit(cluster, preempted)
    t = time.time()
    while 2 not in e2e.saved_steps(preempted):
        assert job(cluster, job_id).get("JobState") in ("PENDING", "RUNNING"), job(cluster, job_id)
        assert time.time() - t < 900
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=TERM", job_id], env=cluster, check=True)
    # a requeued job waits ~2 minutes before it may start again; the test waits only for the host to have
    # cleaned up after the first start (the job's old credential revoked), then lets it start
    wait_job(cluster, job_id, lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING")
    t = time.time()
    while subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=cluster, capture_output=True,
                         text=True).stdout.strip() != "idle":
        assert time.time() - t < 300
        time.sleep(0.5)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster, check=True)
    info = wait_job(cluster, job_id, finished)
    log = (preempted / f"slurm-{job_id}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    assert "preempted, checkpoint saved: requeueing" in log and "start 2," in log, log
    stops = re.findall(r"saving a checkpoint at step (\d+) and exiting", log)
    assert len(stops) == 2 and stops[0] == stops[1] and int(stops[0]) < 8, log  # both tasks, at one step
    assert f"(step {stops[0]})" in log and "resumed from" in log, log

    want, got = e2e.losses(whole), e2e.losses(preempted)
    assert sorted(want) == sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]
    cfg = saved_config(whole / "checkpoints" / "8")
    a, b = (flat(load_state(d / "checkpoints" / "8", cfg)) for d in (whole, preempted))
    assert sorted(a) == sorted(b)
    for path in a:
        np.testing.assert_array_equal(np.asarray(b[path]), np.asarray(a[path]), err_msg=str(path))


def test_more_tasks_than_hosts_is_a_named_error(cluster, tmp_path):
    # the submitter checks the partition before submitting
    out = launch(cluster, "--nodes=2", f"--run_dir={tmp_path}")
    assert out.returncode == 2 and "--nodes=2: more hosts than partition 'debug' has (1)" in out.stderr, out.stderr
    assert "--run_dir=rel" in launch(cluster, "--nodes=1", "--run_dir=rel").stderr
    # the batch script itself, submitted by hand with 2 tasks on its 1 host at one task per host
    sub = subprocess.run(["sbatch", "--parsable", "--ntasks=2", "--ntasks-per-node=2", f"--output={tmp_path}/o.txt",
                          str(ROOT / "tools/launch/slurm.sbatch")],
                         env=dict(cluster, LING2_RUN_DIR=str(tmp_path)), capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    info = wait_job(cluster, sub.stdout.strip().split(";")[0], finished, timeout=120)
    text = (tmp_path / "o.txt").read_text()
    assert info["ExitCode"] == "2:0" and "2 tasks on 1 host(s)" in text and "more tasks than hosts" in text, text
