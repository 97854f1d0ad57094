"""A sweep of bad input to the trainer and both converter CLIs: each is exit status 2 with one `error:` message
naming the file, field or path at fault, and never a traceback (exit 1 is kept for bugs).

The trainer runs as its binary in a subprocess; the converters' `main` runs in-process (it returns the
status the binary exits with), and once each as a binary.
"""

import json
import os
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ling2.checkpoint import state as ckpt_state
from ling2.config import load_config
from ling2.convert import hf_to_ling2, ling2_to_hf
from ling2.convert.testing.hf_fixtures import write_random_hf
from ling2.train.testing import e2e

MICRO = load_config(model_name="ling2-micro")


def trainer(run_dir, *args):
    r = subprocess.run(e2e.binary() + [f"--run_dir={run_dir}", "--notensorboard", *args], env=e2e.env(),
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout, r.stderr


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def state_dir(path: Path, cfg) -> Path:
    """A converter state directory of `cfg` with random weights."""
    rng = np.random.default_rng(0)
    leaves = ckpt_state.model_leaves(cfg)
    ckpt_state.save_state(path, ckpt_state.unflat({p: rng.standard_normal(v.shape).astype(v.dtype)
                                                   for p, v in leaves.items()}), cfg)
    return path


def truncate_largest(directory: Path) -> Path:
    f = max(directory.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[:-1000])
    return f


def overlap_two(directory: Path) -> None:
    """Points a tensor of a shard at the bytes of another of the same size: a header two tensors read alike."""
    for f in sorted(directory.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        seen = {}
        for name, h in header.items():
            size = h["data_offsets"][1] - h["data_offsets"][0] if name != "__metadata__" else 0
            if size and size in seen:
                h["data_offsets"] = list(header[seen[size]]["data_offsets"])
                text = json.dumps(header).encode()
                text += b" " * (-len(text) % 8)
                f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
                return
            seen[size] = name
    raise AssertionError("no two tensors of one size in a shard")


def rewrite_shard(directory: Path, edit) -> None:
    """Rewrites the first shard as edit(header, data) -> (header, data) returns it."""
    f = sorted(directory.glob("*.safetensors"))[0]
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + data)


def gap_before_last(header: dict, data: bytes):
    """8 bytes no tensor owns, before the last tensor's bytes (its offsets moved past them)."""
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b + 8, e + 8]
    return header, data[:b] + bytes(8) + data[b:]


def _trainer_cases(tmp: Path):
    """(name, args, run_dir, message regex) of bad trainer inputs; files are made here."""
    loop_a = write(tmp / "cfg" / "a.yml", "base_config: b.yml\nsteps: 3\n")
    write(tmp / "cfg" / "b.yml", "base_config: a.yml\n")
    broken_yaml = write(tmp / "cfg" / "broken.yml", "steps: [1, 2\n")
    a_file = write(tmp / "a_file", "not a directory")
    ckpt_file_run = tmp / "ckpt_file_run"
    write(ckpt_file_run / "checkpoints", "")
    empty_step_run = tmp / "empty_step_run"
    (empty_step_run / "checkpoints" / "5").mkdir(parents=True)
    truncated = state_dir(tmp / "truncated_state", MICRO)
    cut = truncate_largest(truncated / "state")
    other = state_dir(tmp / "other_state", load_config(model_name="ling2-micro", base_emb_dim=96))
    no_state = tmp / "no_state"
    no_state.mkdir()
    full_disk_run = tmp / "full_disk_run"
    full_disk_run.mkdir()
    (full_disk_run / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    run = tmp / "run"
    m = ["--", *e2e.MICRO]
    return [
        ("unknown key", [*m, "num_expertz=3"], run, r"unknown config key 'num_expertz'; did you mean num_experts"),
        ("bad value", [*m, "num_experts=abc"], run, r"num_experts \(from override\)"),
        ("not key=value", [*m, "steps"], run, r"expected key=value, got 'steps'"),
        ("missing --config", [f"--config={tmp / 'nope.yml'}", *m], run, rf"{tmp}/nope\.yml: config file not found"),
        ("base_config loop", [f"--config={loop_a}", *m], run, r"base_config loop: .*a\.yml -> .*b\.yml -> .*a\.yml"),
        ("malformed yaml", [f"--config={broken_yaml}", *m], run, r"broken\.yml: malformed YAML"),
        ("sequence too long", [*m, "max_target_length=2048"], run,
         r"max_target_length.*2048 exceeds max_position_embeddings=1024"),
        ("mesh too large", [*m, "ici_fsdp_parallelism=8"], run, r"ici_\*_parallelism: mesh .* needs 8 devices( per slice)?, have 1"),
        ("run_dir is a file", m, a_file, rf"run_dir: {a_file} exists and is not a directory"),
        ("checkpoints is a file", m, ckpt_file_run, r"run_dir: .*ckpt_file_run/checkpoints exists and is not a dir"),
        ("run_dir unwritable", m, Path("/proc/ling2_run"), r"run_dir: /proc/ling2_run cannot be created"),
        ("unusable checkpoint", m, empty_step_run, r"no usable checkpoint(.|\n)*5: empty directory"),
        ("metrics on a full disk", [*m, "steps=2"], full_disk_run,
         r"full_disk_run/metrics\.jsonl: writing the record of step 1 failed: disk full"),
        ("load path missing", [*m, f"load_parameters_path={tmp / 'gone'}"], run,
         rf"load_parameters_path: {tmp}/gone is not a directory"),
        ("load path without state", [*m, f"load_parameters_path={no_state}"], run, r"no_state holds neither"),
        ("load path truncated", [*m, f"load_parameters_path={truncated}"], run, rf"{cut.name}: tensor .* cut short"),
        ("load path other shapes", [*m, f"load_parameters_path={other}"], run,
         r"decoder/embed/embedding: checkpoint \(8192, 96\) vs model \(8192, 64\)"),
        ("bad flag value", ["--max_consecutive_skips=abc", *m], run, r"bad flag: .*max_consecutive_skips"),
        ("flag out of range", ["--max_consecutive_skips=0", *m], run, r"--max_consecutive_skips must be >= 1"),
        ("empty --run_dir", ["--run_dir=", *m], run, r"bad flag: --run_dir is empty"),
        ("exit code past a byte", ["--preempted_exit_code=256", *m], run,
         r"--preempted_exit_code must be in \[0, 255\], got 256"),
        ("process id past the count", ["--coordinator_address=localhost:1", "--num_processes=2", "--process_id=2", *m],
         run, r"bad flag: --num_processes=2 and --process_id=2"),
        ("unknown flag", ["--no_such_flag=1", *m], run, r"bad flag: .*no_such_flag"),
    ]


def test_trainer_bad_inputs_exit_2_with_a_named_message(tmp_path):
    failures = []
    for name, args, run_dir, message in _trainer_cases(tmp_path):
        code, out, err = trainer(run_dir, *args)
        if code != 2 or not re.search(message, err) or "Traceback" in err + out or "error" not in err:
            failures.append(f"{name}: exit {code}\n{err[-2000:]}")
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    write_random_hf(d, MICRO)
    return d


def _copy_hf(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _hf_cases(tmp: Path):
    """(name, make(dir) -> extra argv, message regex) of bad HF input for hf_to_ling2."""
    def config(edit):
        def make(d):
            cfg = json.loads((d / "config.json").read_text())
            out = edit(cfg)
            (d / "config.json").write_text(out if isinstance(out, str) else json.dumps(out))
            return []
        return make

    def tensors(edit):
        def make(d):
            from ling2.checkpoint.safetensors_io import ShardedReader, ShardedWriter
            r = ShardedReader(d)
            ts = {n: r.read(n) for n in r.names()}
            for f in list(d.glob("*.safetensors*")):
                f.unlink()
            ts = edit(ts)
            w = ShardedWriter(d, shard_bytes=1 << 20)
            for n, a in ts.items():
                w.add(n, a)
            w.close()
            return []
        return make

    def files(edit):
        def make(d):
            edit(d)
            return []
        return make

    first_layer = "model.layers.0.attention.g_proj.weight"
    return [
        ("no config.json", files(lambda d: (d / "config.json").unlink()), r"config\.json: not found"),
        ("config.json not JSON", config(lambda c: "{not json"), r"config\.json: malformed JSON"),
        ("config.json a list", config(lambda c: "[1, 2]"), r"config\.json: top level must be a JSON object"),
        ("hidden_size not a number", config(lambda c: {**c, "hidden_size": "big"}),
         r"hidden_size must be a positive integer, got 'big'"),
        ("layer_group_size 0", config(lambda c: {**c, "layer_group_size": 0}),
         r"layer_group_size \(Ling2 inhomogeneous_layer_cycle_interval\): must be >= 1"),
        ("unsupported rope", config(lambda c: {**c, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
         r"rope_scaling\.rope_type 'linear' is not supported"),
        ("unsupported activation", config(lambda c: {**c, "hidden_act": "gelu"}), r"hidden_act 'gelu'"),
        ("pad id outside the vocabulary", config(lambda c: {**c, "pad_token_id": 10 ** 6}), r"pad_token_id"),
        ("missing tensor", tensors(lambda t: {n: a for n, a in t.items() if n != first_layer}),
         rf"missing: {re.escape(first_layer)} expected"),
        ("mis-shaped tensor", tensors(lambda t: {**t, first_layer: t[first_layer][:3]}),
         rf"mis-shaped: {re.escape(first_layer)} checkpoint \(3, 64\)"),
        ("truncated shard", files(truncate_largest), r"\.safetensors: tensor .* is cut short"),
        ("overlapping tensors", files(overlap_two), r"\.safetensors: tensors \S+ and \S+ overlap: bytes \[\d+, \d+\)"),
        ("a gap in the data", files(lambda d: rewrite_shard(d, gap_before_last)),
         r"\.safetensors: bytes \[\d+, \d+\) of the data belong to no tensor"),
        ("bytes after the data", files(lambda d: rewrite_shard(d, lambda h, data: (h, data + bytes(64)))),
         r"\.safetensors: 64 bytes after the last tensor's end"),
        ("__metadata__ not a map",
         files(lambda d: rewrite_shard(d, lambda h, data: ({**h, "__metadata__": [1]}, data))),
         r"\.safetensors: malformed safetensors header: __metadata__ must map strings to strings"),
        ("malformed header", files(lambda d: sorted(d.glob("*.safetensors"))[0].write_bytes(b"\x10" + b"\0" * 7 + b"{x")),
         r"malformed safetensors header"),
        ("index names a missing shard", files(lambda d: sorted(d.glob("*.safetensors"))[0].unlink()),
         r"names shard model-00001-of-\d+\.safetensors, which does not exist"),
        ("no weights", files(lambda d: [f.unlink() for f in d.glob("*.safetensors*")]),
         r"neither model\.safetensors\.index\.json nor model\.safetensors"),
        ("unknown --dtype", lambda d: ["--dtype", "fp8"], r"--dtype: unknown 'fp8'"),
        ("--out is a file", lambda d: ["--out", str(write(tmp / "out_file", "x"))], r"out_file"),
        ("--hf_dir missing", lambda d: ["--hf_dir", str(tmp / "nowhere")], r"nowhere: not a directory"),
    ]


def test_hf_to_ling2_bad_inputs_exit_2_with_a_named_message(tmp_path, hf_dir, capsys):
    failures = []
    for i, (name, make, message) in enumerate(_hf_cases(tmp_path)):
        d = _copy_hf(hf_dir, tmp_path / f"hf{i}")
        extra = make(d)
        flags = {"--hf_dir": str(d), "--out": str(tmp_path / f"out{i}"), **dict(zip(extra[::2], extra[1::2]))}
        code = hf_to_ling2.main([x for kv in flags.items() for x in kv] + ["--no_progress"])
        err = capsys.readouterr().err
        if code != 2 or not re.search(message, err) or not err.startswith("error: "):
            failures.append(f"{name}: exit {code}\n{err[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_ling2_to_hf_bad_inputs_exit_2_with_a_named_message(tmp_path, capsys):
    good = state_dir(tmp_path / "good", MICRO)
    truncated = state_dir(tmp_path / "truncated", MICRO)
    cut = truncate_largest(truncated / "state")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    bad_yaml = write(tmp_path / "bad.yml", "steps: [1\n")
    cases = [
        ("--ckpt missing", ["--ckpt", str(tmp_path / "gone")], r"gone: not a directory"),
        ("no saved config", ["--ckpt", str(no_config)], r"no_config: no saved config"),
        ("truncated state", ["--ckpt", str(truncated)], rf"{cut.name}: tensor .* cut short"),
        ("malformed --config", ["--ckpt", str(good), "--config", str(bad_yaml)], r"bad\.yml: malformed YAML"),
        ("hybrid as deepseek_v3", ["--ckpt", str(good), "--layout", "deepseek_v3"], r"every layer must be MLA"),
        ("unknown --dtype", ["--ckpt", str(good), "--dtype", "int3"], r"--dtype: unknown 'int3'"),
    ]
    failures = []
    for i, (name, args, message) in enumerate(cases):
        code = ling2_to_hf.main([*args, "--out", str(tmp_path / f"out{i}"), "--no_progress"])
        err = capsys.readouterr().err
        if code != 2 or not re.search(message, err) or not err.startswith("error: "):
            failures.append(f"{name}: exit {code}\n{err[-2000:]}")
    for name, argv in [("bad --shard_gb", ["--ckpt", str(good), "--out", str(tmp_path / "o"), "--shard_gb", "0"]),
                       ("bad --layout", ["--ckpt", str(good), "--out", str(tmp_path / "o"), "--layout", "gpt"])]:
        with pytest.raises(SystemExit) as e:
            ling2_to_hf.main(argv)
        if e.value.code != 2:
            failures.append(f"{name}: exit {e.value.code}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("cli", ["hf_to_ling2", "ling2_to_hf"])
def test_converter_binaries_exit_2_without_traceback(tmp_path, cli):
    binary = Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "ling2" / "convert" / cli
    flag = "--hf_dir" if cli == "hf_to_ling2" else "--ckpt"
    r = subprocess.run([str(binary), flag, str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                       env=e2e.env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "missing: not a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ")
