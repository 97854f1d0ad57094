"""Which GPUs a SLURM task takes under LING2_DISTRIBUTED=auto: JAX's SLURM detection gives each task the one GPU
numbered by its SLURM_LOCALID (one task per GPU); a task alone on its host must take all of the host's."""

import pytest

from ling2.train import distributed
from ling2.train.errors import TrainingError


def test_one_task_per_host_takes_every_gpu_slurm_gave_the_host():
    env = {"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x16)", "SLURM_GPUS_ON_NODE": "8"}
    assert distributed.slurm_local_device_ids(env) == list(range(8))
    env = {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "4"}
    assert distributed.slurm_local_device_ids(env) == [0, 1, 2, 3]


def test_several_tasks_per_host_or_no_slurm_leave_jax_its_choice():
    assert distributed.slurm_local_device_ids({"SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
                                               "SLURM_GPUS_ON_NODE": "8"}) is None
    assert distributed.slurm_local_device_ids({"SLURM_GPUS_ON_NODE": "8"}) is None


def test_no_coordinator_and_no_auto_is_one_process(monkeypatch):
    for k in ("LING2_COORDINATOR", "LING2_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.maybe_initialize() is False


@pytest.mark.parametrize("args, env, message", [
    (("h:1", 2, 5), {}, r"--num_processes=2 and --process_id=5 .*need num_processes >= 1 and 0 <= process_id"),
    (("h:1", 0, 0), {}, r"--num_processes=0 and --process_id=0"),
    (("h:1", 2, -1), {}, r"--process_id=-1"),
    (("h:1", None, 0), {"LING2_NUM_PROCESSES": "two"}, r"LING2_NUM_PROCESSES='two' \(for --num_processes\): not an integer"),
    (("h:1", 2, None), {"LING2_PROCESS_ID": ""}, r"LING2_PROCESS_ID='' \(for --process_id\): not an integer"),
    (("localhost", 2, 0), {}, r"--coordinator_address \(or LING2_COORDINATOR\) 'localhost': want host:port"),
    ((None, None, None), {"LING2_COORDINATOR": "h:port"}, r"'h:port': want host:port"),
])
def test_bad_process_flags_and_environment_are_named_before_jax_starts(monkeypatch, args, env, message):
    for k in ("LING2_COORDINATOR", "LING2_NUM_PROCESSES", "LING2_PROCESS_ID", "LING2_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: pytest.fail(f"initialize({kw})"))
    with pytest.raises(TrainingError, match=message):
        distributed.maybe_initialize(*args)
