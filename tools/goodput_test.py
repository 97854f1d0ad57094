"""tools/goodput: totals over a run's records (hand-made here, with a resumed run's later records), the
table, and a named error for a directory without metrics."""

import json

from absl import flags

from tools import goodput

KINDS = ("compile", "step", "data_wait", "checkpoint", "restore", "eval", "lost")


def _rec(n, **s):
    return {"step": n, "loss": 1.0, **{f"goodput/{k}_s": float(s.get(k, 0.0)) for k in KINDS},
            **({"goodput/lost_steps": float(s["lost_steps"])} if "lost_steps" in s else {})}


def _main(capsys, *argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["goodput", *argv])
    rc = goodput.main(["goodput"])
    return rc, capsys.readouterr()


def test_totals_across_a_restart(tmp_path, capsys):
    rows = [_rec(1, compile=10, step=1), _rec(2, step=2, data_wait=0.5), _rec(3, step=2, checkpoint=1),
            # the resumed run (from step 2) rewrites step 3: the cut-short run's record of step 3 is gone
            _rec(3, compile=8, restore=2, lost=3, lost_steps=1, step=2), _rec(4, step=2, eval=1.5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out = _main(capsys, f"--run_dir={tmp_path}", "--json")
    assert rc == 0, out.err
    s = json.loads(out.out)
    # steps 1, 2, resumed 3, 4: 11 + 2.5 + 15 + 3.5 = 32 s; train steps 1 + 2 + 2 + 2 = 7 s
    assert s["total"] == 32.0 and s["step"] == 7.0 and s["compile"] == 18.0 and s["lost"] == 3.0
    assert s["lost_steps"] == 1 and s["goodput"] == 7.0 / 32.0
    rc, out = _main(capsys, f"--run_dir={tmp_path}")
    assert rc == 0 and "goodput" in out.out and "21.9 %" in out.out


def test_missing_metrics_is_named(tmp_path, capsys):
    rc, out = _main(capsys, f"--run_dir={tmp_path}")
    assert rc == 2 and f"{tmp_path}/metrics.jsonl" in out.err


def test_non_utf8_metrics_is_named(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_bytes(json.dumps(_rec(1, step=1)).encode() + b'\n{"step": 2, "x": "caf\xe9"}\n')
    rc, out = _main(capsys, f"--run_dir={tmp_path}")
    off = len(json.dumps(_rec(1, step=1))) + 1 + len('{"step": 2, "x": "caf')
    assert rc == 2 and out.err == f"error: {tmp_path}/metrics.jsonl:2: not UTF-8 (byte b'\\xe9' at offset {off})\n"


def test_a_goodput_value_that_is_not_seconds_is_named(tmp_path, capsys):
    """A goodput field that is not a finite number >= 0: exit 2 naming the file, step and field, never a
    traceback or totals built from it."""
    for value, what in (('"abc"', "a string"), ("[1]", "an array"), ("null", "null"), ("true", "a boolean"),
                        ("-3.0", "-3.0"), ('"nan"', "nan"), ('"inf"', "inf")):
        line = json.dumps(_rec(2, step=1))[:-1] + f', "goodput/eval_s": {value}}}'
        (tmp_path / "metrics.jsonl").write_text(json.dumps(_rec(1, step=1)) + "\n" + line + "\n")
        rc, out = _main(capsys, f"--run_dir={tmp_path}", "--json")
        assert rc == 2 and out.out == "", (value, out)
        assert out.err == (f"error: {tmp_path}/metrics.jsonl: step 2: goodput/eval_s is {what}, "
                           "not a finite number >= 0\n"), (value, out.err)


def test_stdout_on_a_full_disk_is_one_error_line(tmp_path):
    """The totals go to stdout: redirected to a full disk (/dev/full), exit 2 with one `error:` line naming
    stdout, not a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "metrics.jsonl").write_text(json.dumps(_rec(1, step=1)) + "\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    tool = Path(goodput.__file__)
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, str(tool), f"--run_dir={tmp_path}"], env=env, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr == "error: stdout: cannot write: No space left on device\n", r.stderr
