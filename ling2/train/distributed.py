"""Multi-host start-up: `jax.distributed.initialize` from flags or the environment."""

import os

import jax


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Starts multi-host JAX when a coordinator address is given (flag, or LING2_COORDINATOR).

    LING2_NUM_PROCESSES and LING2_PROCESS_ID fill the other two when their flags are unset.
    """
    coordinator = coordinator or os.environ.get("LING2_COORDINATOR")
    if not coordinator:
        return False
    if num_processes is None:
        num_processes = int(os.environ.get("LING2_NUM_PROCESSES", "1"))
    if process_id is None:
        process_id = int(os.environ.get("LING2_PROCESS_ID", "0"))
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True
