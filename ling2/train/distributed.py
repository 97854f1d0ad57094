"""Multi-host start-up: `jax.distributed.initialize` from flags, the environment, or the cluster itself."""

import glob
import os

import jax


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Starts multi-host JAX when a coordinator address is given (flag, or LING2_COORDINATOR), or when
    LING2_DISTRIBUTED=auto asks JAX to read the cluster (SLURM's srun tasks, a Cloud TPU slice, Open MPI,
    Kubernetes): what tools/launch's SLURM script and JobSet set.

    LING2_NUM_PROCESSES and LING2_PROCESS_ID fill the other two when their flags are unset.
    """
    coordinator = coordinator or os.environ.get("LING2_COORDINATOR")
    if not coordinator:
        if os.environ.get("LING2_DISTRIBUTED") != "auto":
            return False
        jax.distributed.initialize(local_device_ids=slurm_local_device_ids(os.environ))
        return True
    if num_processes is None:
        num_processes = int(os.environ.get("LING2_NUM_PROCESSES", "1"))
    if process_id is None:
        process_id = int(os.environ.get("LING2_PROCESS_ID", "0"))
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


def slurm_local_device_ids(env) -> list | None:
    """The GPUs a SLURM task owns when it is the only task on its host: all of the host's (SLURM_GPUS_ON_NODE,
    else the /dev/nvidiaN count). JAX's SLURM detection assumes one task per GPU and would give such a task GPU
    number SLURM_LOCALID alone. None (JAX's own choice) for several tasks per host, no GPUs, or no SLURM."""
    if "SLURM_LOCALID" not in env:
        return None
    per_host = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    if per_host.split("(")[0] != "1":
        return None
    gpus = int(env.get("SLURM_GPUS_ON_NODE") or len(glob.glob("/dev/nvidia[0-9]*")))
    return list(range(gpus)) or None
