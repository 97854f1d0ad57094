"""The generate and evaluate binaries, run as a user runs them (subprocesses): their JSON equals the
Python API's on the same checkpoint, and bad input exits 2 with a message naming it."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from ling2.checkpoint.manager import Checkpointer
from ling2.checkpoint.safetensors_io import INDEX_NAME
from ling2.config import load_config
from ling2.convert import convert
from ling2.convert.testing.hf_fixtures import mtp_names, write_random_hf
from ling2.checkpoint.state import save_state
from ling2.infer.evaluation import evaluate
from ling2.infer.generation import generate
from ling2.infer.load import find_file, load_model
from ling2.infer.testing.models import LING3_MICRO, MICRO
from ling2.layers.model import Ling2Model
from ling2.train.state import trainable_filter
from ling2.layers.spec import ModelSpec

DATA = "data/sample/sample_text_document"
TOKENIZER = "data/sample/tokenizer.json"


def run(module, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", f"ling2.infer.{module}", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A trainer run (config recorded in its step) and a Hugging Face directory of one micro model."""
    tmp = tmp_path_factory.mktemp("cli")
    cfg = load_config(MICRO, dataset_type="mmap", data_path=DATA, tokenizer_path=TOKENIZER, data_split="90,10,0",
                      max_target_length=32, per_device_batch_size=2, steps=10, eval_interval=5, eval_steps=2,
                      async_checkpointing=False)
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(5))
    _, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    zero = np.zeros((), np.int32)
    ckpt = Checkpointer(tmp / "run" / "checkpoints", cfg)
    ckpt.save(10, dict(step=zero, params=params, rest=rest, opt_state={}, skipped=zero, skipped_total=zero), None,
              {"step": 10}, force=True)
    ckpt.close()
    save_state(tmp / "state", nnx.to_pure_dict(nnx.state(model)), cfg)
    convert.convert_ling2_to_hf(tmp / "state", tmp / "hf", progress=False)
    return tmp


def test_generate_json_equals_the_api_on_a_trainer_run(ckpts):
    r = run("generate", f"--ckpt={ckpts / 'run'}", "--prompt_ids=5,6,7,8", "--prompt_ids=9", "--max_new_tokens=6",
            "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    loaded = load_model(ckpts / "run")
    want = generate(loaded.model, [[5, 6, 7, 8], [9]], 6, stop_ids=loaded.stop_ids)
    assert got == {"ids": want.ids}
    assert len(want.ids[1]) == 6 or want.ids[1][-1] in loaded.stop_ids


def test_generate_text_prompts_speculative_on_a_hf_checkpoint(ckpts):
    prompts = ckpts / "prompts.txt"
    prompts.write_text('It is a truth universally acknowledged\n{"ids": [100, 200, 300]}\n')
    r = run("generate", f"--ckpt={ckpts / 'hf'}", f"--tokenizer={TOKENIZER}", f"--prompts_file={prompts}",
            "--max_new_tokens=5", "--speculative_mtp", "--json")
    assert r.returncode == 0, r.stderr
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(find_file(TOKENIZER))).encode("It is a truth universally acknowledged",
                                                                 add_special_tokens=False).ids
    loaded = load_model(ckpts / "hf")
    want = generate(loaded.model, [ids, [100, 200, 300]], 5, stop_ids=loaded.stop_ids)
    assert json.loads(r.stdout) == {"ids": want.ids}
    assert "acceptance_per_depth" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--ckpt={tmp}/nope", "--prompt_ids=1", "--max_new_tokens=2"], "no such directory"),
    (["--ckpt={tmp}/run", "--prompt_ids=1,99999", "--max_new_tokens=2"], "token id 99999 at offset 1 is outside"),
    (["--ckpt={tmp}/run", "--prompt_ids=,", "--max_new_tokens=2"], "empty prompt"),
    (["--ckpt={tmp}/run", "--prompt_ids=1,x", "--max_new_tokens=2"], "'x' is not an integer"),
    (["--ckpt={tmp}/run", "--max_new_tokens=2"], "no prompt"),
    (["--ckpt={tmp}/run", "--prompt_ids=1"], "--max_new_tokens=None"),
    (["--ckpt={tmp}/hf", "--prompt=hello", "--max_new_tokens=2"], "need a tokenizer"),
    (["--ckpt={tmp}/run", "--prompt_ids=1", "--max_new_tokens=2", "--temperature=-1"], "--temperature=-1"),
    (["--ckpt={tmp}/run", "--prompt_ids=1", "--max_new_tokens=2", "ici_context_parallelism=4"],
     "ici_context_parallelism=4: context parallelism is for training"),
    (["--ckpt={tmp}/run", "--prompt_ids=1", "--max_new_tokens=abc"], "error: bad flag: flag --max_new_tokens=abc"),
    (["--ckpt={tmp}/run", "--prompt_ids=1", "--max_new_tokens=2", "--top_k=-1"], "--top_k=-1: must be >= 0"),
    (["--ckpt={tmp}/run", "--prompt_ids=1", "--no_such_flag=1"], "error: bad flag: Unknown command line flag"),
    (["--ckpt={tmp}/run", "--prompt_ids=1,2", "--max_new_tokens=1023"],
     "--max_new_tokens=1023: the longest prompt (2 tokens) plus the new tokens (1025) exceed the model's "
     "max_position_embeddings=1024"),
    (["--ckpt={tmp}/run", "--prompt_ids=1", "--max_new_tokens=99999999999"], "--max_new_tokens=99999999999: "),
])
def test_generate_bad_input_exits_2(ckpts, args, message):
    r = run("generate", *[a.format(tmp=ckpts) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_evaluate_bad_flag_exits_2(ckpts):
    r = run("evaluate", f"--ckpt={ckpts}/run", "--max_batches=abc")
    assert r.returncode == 2 and "error: bad flag: flag --max_batches=abc" in r.stderr, (r.stdout, r.stderr)


def test_evaluate_refuses_more_batches_than_memory_holds(ckpts):
    r = run("evaluate", f"--ckpt={ckpts}/run", f"--data_path={DATA}", "--max_batches=99999999999")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: --max_batches=99999999999: ") and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("out,message", [
    ("{tmp}", "is a directory"),
    ("{tmp}/prompts.txt/y.json", "prompts.txt is not a directory"),
    ("/proc/x/y.json", "cannot write in /proc"),
])
def test_evaluate_refuses_an_unusable_out_before_evaluating(ckpts, out, message):
    (ckpts / "prompts.txt").touch()
    out = out.format(tmp=ckpts)
    r = run("evaluate", f"--ckpt={ckpts}/run", f"--data_path={DATA}", f"--out={out}")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"error: --out={out}: ") and message in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and not r.stdout, (r.stdout, r.stderr)


@pytest.fixture(scope="module")
def hf_shards(tmp_path_factory):
    """A random ling2-micro HF directory in four shards, to damage copies of."""
    path = tmp_path_factory.mktemp("shards") / "hf"
    write_random_hf(path, load_config(MICRO))
    return path


def _shard_header(shard):
    n = struct.unpack("<Q", shard.read_bytes()[:8])[0]
    return n, json.loads(shard.read_bytes()[8:8 + n])


def _nan_weight(hf):
    shard = sorted(hf.glob("*.safetensors"))[0]
    n, header = _shard_header(shard)
    name = next(k for k, v in header.items() if k != "__metadata__")
    with open(shard, "r+b") as f:
        f.seek(8 + n + header[name]["data_offsets"][0])
        f.write(b"\xff" * 4)  # NaN in float32, bfloat16 and float16
    return name


DAMAGE = {
    "truncated_shard": (lambda hf: os.truncate(sorted(hf.glob("*.safetensors"))[0],
                                               os.path.getsize(sorted(hf.glob("*.safetensors"))[0]) - 100),
                        "is cut short"),
    "missing_shard": (lambda hf: sorted(hf.glob("*.safetensors"))[-1].unlink(), "which does not exist"),
    "bad_header": (lambda hf: sorted(hf.glob("*.safetensors"))[1].write_bytes(struct.pack("<Q", 9) + b"{not json"),
                   "malformed safetensors header"),
    "malformed_index": (lambda hf: (hf / INDEX_NAME).write_text('{"weight_map": ['), "malformed index"),
    "nan_weight": (_nan_weight, "NaN or Inf value"),
    "generation_config": (lambda hf: (hf / "generation_config.json").write_text('{"eos_token_id": [2, null]}'),
                          "generation_config.json: eos_token_id must be"),
}


@pytest.mark.parametrize("module,damage", [("generate", d) for d in DAMAGE] + [("evaluate", "truncated_shard")])
def test_a_damaged_hf_directory_exits_2_naming_the_file(hf_shards, tmp_path, module, damage):
    hf = tmp_path / "hf"
    shutil.copytree(hf_shards, hf)
    make, message = DAMAGE[damage]
    make(hf)
    args = ["--prompt_ids=5,6", "--max_new_tokens=2"] if module == "generate" else [f"--data_path={DATA}"]
    r = run(module, f"--ckpt={hf}", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and f" {hf}/" in r.stderr and message in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_generate_on_a_hf_ling3_saved_without_mtp(tmp_path):
    """A Ling 3 directory as transformers saves it (MTP declared in config.json, no MTP tensors): generate
    runs without MTP after a one-line note; --speculative_mtp exits 2 naming the missing MTP weights."""
    cfg = load_config(LING3_MICRO)
    write_random_hf(tmp_path / "hf", cfg, "bailing_hybrid", drop=mtp_names(cfg, "bailing_hybrid"))
    args = [f"--ckpt={tmp_path / 'hf'}", "--prompt_ids=5,6,7", "--max_new_tokens=3", "--json"]
    r = run("generate", *args)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["ids"][0]) == 3
    notes = [line for line in r.stderr.splitlines() if "MTP" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ") and "loading without MTP" in notes[0], r.stderr
    r = run("generate", *args, "--speculative_mtp")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error: --speculative_mtp: " in r.stderr and "has no MTP weights" in r.stderr


def test_evaluate_json_equals_the_api(ckpts):
    out = ckpts / "eval.json"
    r = run("evaluate", f"--ckpt={ckpts / 'run'}", f"--data_path={DATA}", "--max_batches=2", f"--out={out}")
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    loaded = load_model(ckpts / "run")
    want = evaluate(loaded.model, loaded.cfg, DATA, find_file, "valid", 2)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["tokens"] == want["tokens"]
    assert r.stdout.splitlines()[0].split()[-1] == "ppl" and f"{want['loss']:.4f}" in r.stdout
    r = run("evaluate", f"--ckpt={ckpts / 'run'}", "--data_path=/nonexistent/prefix")
    assert r.returncode == 2 and "/nonexistent/prefix" in r.stderr


def test_prompts_file_not_utf8_names_the_line_and_offset(ckpts, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"\xef\xbb\xbfhello\n\xff\xfe bad\n")
    r = run("generate", f"--ckpt={ckpts}/run", f"--prompts_file={f}", "--max_new_tokens=2")
    assert r.returncode == 2 and r.stderr == f"error: {f}:2: not UTF-8 (byte 0xff at offset 9)\n", r.stderr


def test_prompts_file_with_a_byte_order_mark_reads_its_json_line(ckpts, tmp_path):
    """The HF directory has no tokenizer, so a JSON line misread as text would exit 2."""
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"ids": [5, 6, 7]}\n')
    r = run("generate", f"--ckpt={ckpts}/hf", f"--prompts_file={f}", "--max_new_tokens=1", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["ids"][0]) == 1


def test_prompts_file_ids_must_be_integers(ckpts, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"ids": [1, 2]}\n{"ids": ["a", 3]}\n')
    r = run("generate", f"--ckpt={ckpts}/run", f"--prompts_file={f}", "--max_new_tokens=2")
    assert r.returncode == 2 and f"{f}:2: \"ids\" must be integers, got 'a'" in r.stderr, r.stderr


def test_max_new_tokens_follows_the_trainers_position_rule():
    """The trainer bounds sequences by max_position_embeddings only without RoPE scaling; generate does the
    same: 1024 positions refuse 2 + 1023 tokens with rope_type default and allow them with YaRN, and a count
    past int32 is refused with either."""
    import types

    from ling2.infer.generate import check_length
    from ling2.infer.load import InferError

    cfg = lambda rope: types.SimpleNamespace(rope_type=rope, max_position_embeddings=1024)  # noqa: E731
    check_length([[1, 2]], 1022, cfg("default"))
    with pytest.raises(InferError, match="exceed the model's max_position_embeddings=1024; lower --max_new_tokens to "
                                         "at most 1022"):
        check_length([[1, 2]], 1023, cfg("default"))
    check_length([[1, 2]], 1023, cfg("yarn"))
    with pytest.raises(InferError, match=r"exceed 2147483647 \(int32\)"):
        check_length([[1, 2]], 2**31, cfg("yarn"))


def test_evaluate_out_a_failed_write_keeps_the_previous_file(tmp_path):
    """A result the file system refuses to hold whole (a full disk; here RLIMIT_FSIZE) is an InferError
    naming --out; the file already at --out stays byte for byte and no temporary file is left."""
    out = tmp_path / "eval.json"
    out.write_text('{"loss": 1.0}\n')
    code = ("import resource, signal, sys\n"
            "from pathlib import Path\n"
            "from ling2.infer.evaluate import write_out\n"
            "from ling2.infer.load import InferError\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "try:\n"
            f"    write_out(Path({str(out)!r}), '{{\"loss\": 2.0, \"pad\": \"' + 'x' * 10000 + '\"}}\\n')\n"
            "except InferError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == f"--out={out}: cannot write: File too large\n", (r.stdout, r.stderr)
    assert out.read_text() == '{"loss": 1.0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


@pytest.mark.parametrize("module,args", [("generate", ["--prompt_ids=1,2", "--max_new_tokens=2", "--json"]),
                                         ("evaluate", [f"--data_path={DATA}", "--max_batches=1"])])
def test_stdout_on_a_full_disk_is_one_error_line(ckpts, module, args):
    """stdout redirected to a full disk (/dev/full: every write fails with ENOSPC): exit 2 and one `error:` line
    naming stdout, not a traceback or Python's exit-time message with status 120."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("XLA_FLAGS", None)
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", f"ling2.infer.{module}", f"--ckpt={ckpts}/run", *args], env=env,
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=1800)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == "error: stdout (<stdout>): cannot write: No space left on device", r.stderr
    assert "Traceback" not in r.stderr


def test_prompts_file_lines_end_only_at_newlines(ckpts, tmp_path):
    """A text prompt holding a form feed or U+2028 (a line separator to str.splitlines, text to a prompts file) is
    one prompt; CRLF ends a line as LF does; a later line's error names its number counted by newlines."""
    from tokenizers import Tokenizer

    text = "It is a truth\u2028universally\x0cacknowledged"
    f = tmp_path / "prompts.txt"
    f.write_bytes(f"{text}\r\n{{\"ids\": [5, 6]}}\r\n".encode())
    r = run("generate", f"--ckpt={ckpts}/run", f"--prompts_file={f}", "--max_new_tokens=3", "--json")
    assert r.returncode == 0, r.stderr
    loaded = load_model(ckpts / "run")
    ids = Tokenizer.from_file(TOKENIZER).encode(text, add_special_tokens=False).ids
    assert json.loads(r.stdout) == {"ids": generate(loaded.model, [ids, [5, 6]], 3, stop_ids=loaded.stop_ids).ids}
    f.write_text(f"{text}\n{{\"ids\": [1.5]}}\n")
    r = run("generate", f"--ckpt={ckpts}/run", f"--prompts_file={f}", "--max_new_tokens=3")
    assert r.returncode == 2 and r.stderr == f"error: {f}:2: \"ids\" must be integers, got 1.5\n", r.stderr


def test_evaluate_a_token_id_outside_the_vocabulary_is_one_error_line(ckpts, tmp_path):
    """A token id past the model's vocabulary, found as its batch is read: exit 2 and one `error:` line naming the
    .bin, the sequence, the offset and the id (the data package's message), not a traceback."""
    from ling2.data import indexed

    vocab = load_config(MICRO).vocab_size
    rng = np.random.default_rng(0)
    docs = [[list(rng.integers(0, vocab, 300))] for _ in range(40)]
    docs[30][0][5] = vocab + 7
    indexed.write_dataset(str(tmp_path / "oov"), docs, dtype=np.uint16 if vocab + 7 < 65536 else np.int32)
    r = run("evaluate", f"--ckpt={ckpts}/run", f"--data_path={tmp_path / 'oov'}", "--split=train",
            "--max_batches=100", "data_split=100,0,0")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    last = r.stderr.splitlines()[-1]
    assert last.startswith("error: data (train split, ") and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"oov.bin: token id {vocab + 7} at sequence 30 (document 30), token offset 5" in last, last


def test_evaluate_out_that_is_no_regular_file_is_written_to_not_replaced(tmp_path):
    """--out naming a FIFO (or /dev/null): the text goes into it and it stays what it was; the temporary file
    and rename that keep a regular file whole would put a regular file in its place. (A subprocess: importing
    evaluate here would define its flags a second time beside generate's.)"""
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    code = ("from pathlib import Path\n"
            "from ling2.infer.evaluate import write_out\n"
            f"write_out(Path({str(fifo)!r}), '{{\"loss\": 1.0}}\\n')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert os.read(fd, 1 << 16) == b'{"loss": 1.0}\n'
    finally:
        os.close(fd)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
