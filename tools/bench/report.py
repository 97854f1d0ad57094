"""What the benchmarks report, one way: XLA's planned device memory, round-robin timing, the
host's facts, and where and how a results JSON is written."""

import datetime
import json
import os
import platform
import time

from ling2.config.paths import replaced, user_path


def planned_bytes(mem) -> int:
    """Arguments + outputs + temporaries - aliased (donated) bytes of `compiled.memory_analysis()`."""
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)


def time_round_robin(fns, repeats: int) -> list[float]:
    """Median seconds per case; cases alternate so load from other processes hits all alike."""
    import jax
    import numpy as np

    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def median_seconds(fn, args, repeats: int, slow_seconds: float = 2.0) -> float:
    """Median seconds of `repeats` runs of a compiled fn(*args) after a warm-up run; a warm-up slower than
    slow_seconds is the answer (one sample for very slow cases)."""
    import jax
    import numpy as np

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    if first > slow_seconds:
        return first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def queued_seconds(f, args, calls: int = 10, batches: int = 3) -> float:
    """Seconds per call of f(*args) on an accelerator, device-bound: after a warm-up, `calls` calls are queued
    back to back and synchronised once (median of `batches` such batches), so host dispatch hides behind the
    device's work instead of adding to it."""
    import jax
    import numpy as np

    jax.block_until_ready(f(*args))
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        r = None
        for _ in range(calls):
            r = f(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / calls)
    return float(np.median(out))


def timed_rates(f, args, flops: float, rate: float, calls: int = 10) -> dict:
    """{seconds, tflops, of_matmul_rate} of f(*args) (`queued_seconds`) doing `flops`, against `rate` (FLOP/s, e.g.
    `matmul_rate`'s): a GPU benchmark row's timing."""
    seconds = queued_seconds(f, args, calls)
    return {"seconds": seconds, "tflops": flops / seconds / 1e12, "of_matmul_rate": flops / seconds / rate}


def matmul_rate(n: int = 8192, dtype="bfloat16", calls: int = 10) -> float:
    """Measured FLOP/s of an [n, n] x [n, n] matmul in `dtype` (device-bound, `queued_seconds`): the rate
    the GPU benchmarks state their kernels against."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
    f = jax.jit(lambda a, b: a @ b).lower(a, a).compile()
    return 2 * n**3 / queued_seconds(f, (a, a), calls)


def host_facts() -> dict:
    """Date, host, cores, load and JAX's device: what a result needs to be compared later."""
    import jax

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "jax": jax.__version__,
            "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}


def results_path(out: str, package: str, name: str) -> str:
    """`out` (relative to where the user ran bazel), else `name` in tools/bench/<package> of the
    workspace under `bazel run`, else `name` in the working directory."""
    if out:
        return str(user_path(out))
    ws = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    return os.path.join(ws, "tools", "bench", package, name) if ws else name


def write_results(result: dict, out: str, package: str, name: str) -> str:
    """Writes `result` as JSON to `results_path(out, package, name)` whole or not at all (`paths.replaced`: a
    bench killed while writing leaves the previous results), says where, returns the path."""
    path = results_path(out, package, name)
    with replaced(path) as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path
