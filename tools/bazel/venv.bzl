"""Builds a Python venv from a hash-pinned lock file and exposes it as a py_runtime_pair.

One repository per platform (WORKSPACE: ling2_venv, ling2_venv_tpu, ling2_venv_cuda). The
toolchain() declarations that point at them live in //tools/bazel, so toolchain resolution
fetches only the venv of the platform it picks. Bazel re-runs this rule when the lock file
changes. Set LING2_PYTHON to pick the base interpreter (default: python3 on PATH).
"""

_BUILD = """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "pair",
    py3_runtime = ":py3",
)

exports_files(["python"])
"""

def _run(ctx, args, what):
    res = ctx.execute(args, timeout = 3600, quiet = True)
    if res.return_code != 0:
        fail("%s failed (exit %d):\n%s\n%s" % (what, res.return_code, res.stdout, res.stderr))

def _python_venv_impl(ctx):
    base = ctx.os.environ.get("LING2_PYTHON", "python3")
    base_path = ctx.which(base) if not base.startswith("/") else ctx.path(base)
    if base_path == None:
        fail("python_venv: no '%s' on PATH; install Python 3.11 or set LING2_PYTHON" % base)
    lock = ctx.path(ctx.attr.requirements)
    venv = ctx.path("venv")
    _run(ctx, [base_path, "-m", "venv", venv], "creating the venv")
    py = ctx.path("venv/bin/python3")
    ctx.report_progress("pip install --require-hashes -r %s" % lock.basename)
    _run(ctx, [py, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
               "--require-hashes", "-r", lock], "pip install of " + str(lock))
    ctx.symlink(py, "python")
    ctx.file("BUILD.bazel", _BUILD.format(python = str(py)))

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {"requirements": attr.label(mandatory = True, allow_single_file = True)},
    environ = ["LING2_PYTHON"],
)
