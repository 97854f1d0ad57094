"""The backend dispatch of the chunked kernels (GLA, KDA): "auto" and the Pallas interpret default are
decided for the platform a computation is lowered for (`jax.lax.platform_dependent`), not from the
host's devices, so a CPU host compiling for a TPU or a GPU builds the kernels that platform runs."""

import functools

import jax


def backend_kernels(chunked, pallas_tpu, pallas_gpu):
    """kernels(backend, interpret) -> (forward, backward) of an op's backend modules, for `run_kernel`."""

    def kernels(backend, interpret):
        if backend == "chunked":
            return chunked.forward, chunked.backward
        mod = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[backend]
        return (functools.partial(mod.forward, interpret=interpret),
                functools.partial(mod.backward, interpret=interpret))

    return kernels


def run_kernel(kernels, resolve, acc_dtype, which, backend, interpret, scale, C, *args):
    """Kernel `which` (0 forward, 1 backward) of `backend` on array arguments.

    kernels(backend, interpret) -> (forward, backward), each called as f(*args, scale, C);
    resolve(platform) -> the backend "auto" runs as on that platform ("cpu", "tpu", "cuda");
    acc_dtype(q dtype) -> the accumulation dtype. interpret None: interpreted when lowered for CPU.
    Outputs are cast to what every backend agrees on: the forward's o in q's (args[0]) dtype,
    everything else in the accumulation dtype, so the platform branches have one type.
    """

    def branch(b, interp):
        kernel = kernels(b, interp)[which]

        def run(*a):
            out = kernel(*a, scale, C)
            acc = acc_dtype(a[0].dtype)
            if which == 0:
                return out[0].astype(a[0].dtype), out[1].astype(acc)
            return tuple(x.astype(acc) for x in out)

        return run

    if backend == "auto":
        per = {p: branch(resolve(p), bool(interpret)) for p in ("tpu", "cuda")}
        return jax.lax.platform_dependent(*args, default=branch(resolve("cpu"), False), **per)
    if backend in ("pallas_tpu", "pallas_gpu") and interpret is None:
        return jax.lax.platform_dependent(*args, cpu=branch(backend, True), default=branch(backend, False))
    return branch(backend, bool(interpret))(*args)
