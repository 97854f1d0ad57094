"""Macros for ling2 packages: one library per package, its binaries, and one pytest target per test file."""

def ling2_py_library(name, srcs = None, deps = [], **kwargs):
    """The library of a ling2 package: `srcs` (default: every module but tests) plus __init__.py,
    depending on the top-level ling2 package. Other arguments go to py_library."""
    if srcs == None:
        srcs = native.glob(["*.py"], exclude = ["*_test.py", "__init__.py"])
    native.py_library(name = name, srcs = ["__init__.py"] + srcs, deps = deps + ["//:ling2_pkg"], **kwargs)

def ling2_py_binary(name, deps, data = [], **kwargs):
    """The py_binary `name` of module `name`.py."""
    native.py_binary(name = name, srcs = [name + ".py"], deps = deps, data = data, python_version = "PY3", **kwargs)

def ling2_native_library(name, srcs, **kwargs):
    """A small C kernel as a shared library `name` (e.g. "libling2_x.so"), for a py_library's
    `data`, loaded with ctypes through `ling2.native.load`."""
    native.cc_binary(name = name, srcs = srcs, copts = ["-O3"], linkshared = True, **kwargs)

_PLATFORMS = ("cpu", "tpu", "cuda", "ling3")

def ling2_py_tests(deps, srcs = None, data = [], size = "medium", sizes = {}, devices = {}, tags = {},
                   platforms = {}, shards = {}, **kwargs):
    """One `ling2_py_test` per test file (default: every *_test.py of the package), named after it (a file in
    a subfolder of the same Bazel package by its path with `_` for `/`: sub/x_test.py is `sub_x_test`).

    `sizes`, `devices`, `tags`, `platforms` and `shards` (Bazel's shard_count: each shard runs a
    contiguous slice of the file's tests) map a test name to its own value; `size` is everyone
    else's. A file `*_tpu_compile_test.py` / `*_cuda_compile_test.py` is a test of that platform's
    venv; `platforms` names others (e.g. "ling3": the test-only transformers 5.x venv)."""
    for src in (srcs if srcs != None else native.glob(["*_test.py"])):
        name = src[:-len(".py")].replace("/", "_")
        platform = platforms.get(name, "cpu")
        for p in _PLATFORMS:
            if name == "%s_compile_test" % p or name.endswith("_%s_compile_test" % p):
                platform = p
        ling2_py_test(name = name, srcs = [src], deps = deps, data = data, size = sizes.get(name, size),
                      devices = devices.get(name, 0), tags = tags.get(name, []), platform = platform,
                      **dict(kwargs, **({"shard_count": shards[name]} if name in shards else {})))

def ling2_py_test(name, srcs, deps = [], data = [], devices = 0, env = {}, args = [], size = "small",
                  platform = "cpu", tags = [], **kwargs):
    """A pytest-driven py_test.

    Args:
      name: target name.
      srcs: the test file(s); pytest runs exactly these.
      deps: py_library deps under test.
      data: runtime files.
      devices: if > 0, fake that many XLA CPU devices (for sharding tests).
      env: extra environment.
      args: extra pytest arguments.
      size: Bazel test size.
      platform: the venv the test needs: "cpu" (the default suite), or "tpu" / "cuda" / "ling3"
        (tagged so, run only by `bazel test --config=tpu|cuda|ling3`; see .bazelrc).
      tags: extra tags.
      **kwargs: passed to py_test.
    """
    if platform not in _PLATFORMS:
        fail("ling2_py_test %s: platform = %r, expected one of %s" % (name, platform, _PLATFORMS))
    test_env = {"JAX_PLATFORMS": "cpu"}
    test_env.update(env)
    if devices:
        test_env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=%d" % devices
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs] + args,
        deps = deps,
        data = data + [lock for lock in ["//:requirements_lock_%s.txt" % platform] if lock not in data],
        env = test_env,
        size = size,
        tags = tags + ([] if platform == "cpu" else [platform]),
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def ling2_bench(deps, **kwargs):
    """A benchmark package's `bench` binary (bench.py), with the shared report helpers."""
    native.py_binary(name = "bench", srcs = ["bench.py"], deps = deps + ["//tools/bench:report"],
                     python_version = "PY3", **kwargs)
