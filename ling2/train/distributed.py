"""Multi-host start-up: `jax.distributed.initialize` from flags, the environment, or the cluster itself."""

import glob
import os

import jax

from ling2.train.errors import TrainingError


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
        try:
            jax.distributed.initialize(local_device_ids=slurm_local_device_ids(os.environ))
        except ValueError as e:  # no cluster JAX can read
            raise TrainingError(f"LING2_DISTRIBUTED=auto: {e}") from None
        return True
    num_processes = _count("--num_processes", num_processes, "LING2_NUM_PROCESSES", "1")
    process_id = _count("--process_id", process_id, "LING2_PROCESS_ID", "0")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise TrainingError(f"--num_processes={num_processes} and --process_id={process_id} (or LING2_NUM_PROCESSES, "
                            "LING2_PROCESS_ID): need num_processes >= 1 and 0 <= process_id < num_processes")
    if ":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit():
        raise TrainingError(f"--coordinator_address (or LING2_COORDINATOR) {coordinator!r}: want host:port")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


def _count(flag: str, value: int | None, env: str, default: str) -> int:
    """A flag's value, else its environment variable's (an integer: else a TrainingError naming it)."""
    if value is not None:
        return value
    raw = os.environ.get(env, default)
    try:
        return int(raw)
    except ValueError:
        raise TrainingError(f"{env}={raw!r} (for {flag}): not an integer") from None


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
