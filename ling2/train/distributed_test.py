"""Which GPUs a SLURM task takes under LING2_DISTRIBUTED=auto: JAX's SLURM detection gives each task the one GPU
numbered by its SLURM_LOCALID (one task per GPU); a task alone on its host must take all of the host's."""

from ling2.train import distributed


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
