"""`//ling2/train:compile` as a user runs it (tpu venv, CPU host): the verdict line, exit codes and
JSON of a plan that fits and one that does not, and named errors (exit 2, no traceback) for bad
input. Reference for the verdict: the chip's HBM from Cloud TPU's v5e page (16 GiB) and XLA's
memory analysis as the JSON records it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from ling2.train import compile as compile_lib

MICRO = ["model_name=ling2-micro", "max_target_length=64"]


def cli(*args, timeout=600):
    if "TEST_SRCDIR" in os.environ:
        cmd = [str(Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "ling2/train/compile")]
    else:
        cmd = [sys.executable, str(Path(__file__).with_name("compile.py"))]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True, timeout=timeout)


def last_line(r):
    return r.stdout.strip().splitlines()[-1]


def test_plan_that_fits(tmp_path):
    out = tmp_path / "plan.json"
    r = cli("--topology=v5e-4", f"--out={out}", "--", *MICRO)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.fullmatch(r"v5e-4: (\d+\.\d\d) GiB of 16\.00 GiB per chip \(fits\)", last_line(r))
    assert m, last_line(r)
    p = json.loads(out.read_text())
    assert p["fits"] and p["chips"] == 4 and p["mesh"]["fsdp"] == 4
    assert float(m.group(1)) == pytest.approx(p["total_bytes"] / 2**30, abs=0.006)
    assert p["sum_bytes"] == p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"] + \
        p["generated_code_bytes"]
    # XLA's peak holds at least the arguments and at most the parts' sum; the total is that peak plus the code.
    assert p["argument_bytes"] <= p["xla_peak_bytes"] <= p["sum_bytes"]
    assert p["total_bytes"] == p["xla_peak_bytes"] + p["generated_code_bytes"]
    for row in ("parameters", "optimizer state", "batch", "temporaries", "outputs", "compile time",
                "FLOPs per chip per step, XLA", "FLOPs per chip per step, Ling2", "step time at peak", "MFU"):
        assert row in r.stdout, row
    # libtpu's probes of a TPU host this is not (metadata server, accelerator type, worker hostnames) stay quiet.
    for noise in ("host bounds", "worker hostname", "could not determine TPU", "E0000"):
        assert noise not in r.stdout + r.stderr, noise


def test_plan_that_does_not_fit(tmp_path):
    """A 2^20-token vocabulary at width 2048: embedding + head are 4.3G fp32 parameters, 16 GiB, and
    Adam's moments 32 GiB more, on one 16 GiB v5e chip."""
    out = tmp_path / "plan.json"
    r = cli("--topology=v5e-1", f"--out={out}", "--", *MICRO, "vocab_size=1048576", "base_emb_dim=2048",
            "loss_vocab_blocks=16")
    assert r.returncode == 1, r.stderr[-3000:]
    m = re.fullmatch(r"v5e-1: (\d+\.\d\d) GiB of 16\.00 GiB per chip \(does not fit, short by (\d+\.\d\d) GiB\)",
                     last_line(r))
    assert m, last_line(r)
    # XLA's "HLO temporaries" figure already holds the 48 GiB of arguments: counted once, not twice
    assert 48 < float(m.group(1)) < 96 and float(m.group(2)) == pytest.approx(float(m.group(1)) - 16, abs=0.011)
    assert not json.loads(out.read_text())["fits"]


@pytest.mark.parametrize("args,named", [
    (["--topology=v5p-7"], "unknown topology 'v5p-7'"),
    (["--topology=tpu9-8"], "unknown topology"),
    (["--topology=v5p-16", "--", *MICRO, "ici_fsdp_parallelism=3"], "ici_*_parallelism"),
    (["--topology=v5p-16", "--num_slices=2", "--", *MICRO, "dcn_fsdp_parallelism=4"], "dcn_*_parallelism"),
    (["--topology=v5p-16", "--", *MICRO, "per_device_batch_size=0.5"], "per_device_batch_size"),
    (["--topology=v5p-16", "--", *MICRO, "no_such_key=1"], "no_such_key"),
    (["--topology=v5p-16", "--", *MICRO, "remat_policy=some"], "remat_policy"),
    (["--", *MICRO], "--topology"),
    (["--topology=v5p-16", "--num_slices=0"], "--num_slices"),
    (["--topology=v5p-16", "--", *MICRO, "per_device_batch_size=100000000"], "past what JAX indexes (int32"),
])
def test_bad_input_is_a_named_error(args, named, capsys):
    """In-process (the binary's `main` after absl's flag parsing): no compile is reached."""
    flags.FLAGS.unparse_flags()
    argv = flags.FLAGS(["compile", *args])
    assert compile_lib.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and err.startswith("error:"), err


@pytest.mark.parametrize("args,named", [
    (["--topology=v5p-16", "--", *MICRO, "ici_fsdp_parallelism=3"], "error: PlanError: ici_*_parallelism"),
    (["--topology=v5p-16", "--num_slices=two"], "error: bad flag"),
])
def test_bad_input_exits_2_from_the_binary(args, named):
    r = cli(*args)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and named in r.stderr


def test_out_is_relative_to_the_users_directory_and_unwritable_is_named(tmp_path, monkeypatch, capsys):
    """`bazel run` starts the binary in its runfiles tree: a relative --out is the user's directory's
    (BUILD_WORKING_DIRECTORY). An --out that cannot be written exits 2 naming the flag, before the compile (no
    plan printed); a plan is written whole (no temporary left beside it)."""
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    flags.FLAGS.unparse_flags()
    assert compile_lib.main(flags.FLAGS(["compile", "--topology=v5e-4", "--out=plans/p.json", "--", *MICRO])) == 0
    assert json.loads((tmp_path / "plans" / "p.json").read_text())["chips"] == 4
    assert [p.name for p in (tmp_path / "plans").iterdir()] == ["p.json"]
    (tmp_path / "a_file").write_text("")
    capsys.readouterr()
    flags.FLAGS.unparse_flags()
    assert compile_lib.main(flags.FLAGS(["compile", "--topology=v5e-4", "--out=a_file/p.json", "--", *MICRO])) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: --out: ") and "a_file is not a directory" in err and out == "", (out, err)
