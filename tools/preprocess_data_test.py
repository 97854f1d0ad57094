"""preprocess_data and train_tokenizer: outputs checked against direct tokenization with the
HF tokenizer (the reference), Megatron's naming and EOD rules, and the bundled sample data."""

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ling2.data.errors import DataError
from ling2.data.indexed import IndexedDataset

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parent / "data" / "sample"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_ling2_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


pre = _load("preprocess_data")
train_tok = _load("train_tokenizer")
TOK = str(SAMPLE / "tokenizer.json")
DOCS = [{"text": "It is a truth. Universally acknowledged! A single man?", "t2": "x"},
        {"text": "", "t2": "Second key."},
        {"text": "Mr. Bennet said \"Yes.\" Then he left.", "t2": ""}]


def _run(tmp_path, *flags, docs=DOCS, keys=("text",)):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(d) + "\n" for d in docs))
    args = pre.parse_args(["--input", str(inp), "--tokenizer", TOK, "--output-prefix",
                           str(tmp_path / "out"), "--quiet", "--json-keys", *keys, *flags])
    return pre.run(args)


def test_documents_with_eod(tmp_path):
    out = _run(tmp_path, "--append-eod", keys=("text", "t2"))
    assert out == {"text": str(tmp_path / "out_text_document"),
                   "t2": str(tmp_path / "out_t2_document")}
    tok = Tokenizer.from_file(TOK)
    ds = IndexedDataset(out["text"])
    assert ds.dtype == np.uint16 and ds.num_documents == 3
    assert ds.document_indices.tolist() == [0, 1, 1, 2]  # the empty text is an empty document
    for seq, d in zip((0, 1), (DOCS[0], DOCS[2])):
        want = tok.encode(d["text"], add_special_tokens=False).ids + [2]  # <eod> = 2
        assert ds.get(seq).tolist() == want
    t2 = IndexedDataset(out["t2"])
    assert t2.document_indices.tolist() == [0, 1, 2, 2]


def test_sentences(tmp_path):
    out = _run(tmp_path, "--split-sentences", "--append-eod")
    ds = IndexedDataset(out["text"])
    assert out["text"].endswith("out_text_sentence")
    assert pre.split_sentences(DOCS[0]["text"]) == [
        "It is a truth.", "Universally acknowledged!", "A single man?"]
    tok = Tokenizer.from_file(TOK)
    sents = pre.split_sentences(DOCS[2]["text"])
    assert sents == ["Mr. Bennet said \"Yes.\"", "Then he left."]
    assert ds.document_indices.tolist() == [0, 3, 3, 5]
    assert ds.get(3).tolist() == tok.encode(sents[0], add_special_tokens=False).ids
    assert ds.get(4).tolist() == tok.encode(sents[1], add_special_tokens=False).ids + [2]


def test_workers_give_identical_bytes(tmp_path):
    docs = [{"text": f"Line {i}. " * (i % 7)} for i in range(300)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _run(tmp_path / "a", "--append-eod", docs=docs)["text"]
    two = _run(tmp_path / "b", "--append-eod", "--workers", "2", docs=docs)["text"]
    for ext in (".bin", ".idx"):
        assert Path(one + ext).read_bytes() == Path(two + ext).read_bytes()


def test_blocks_keep_order(tmp_path):
    docs = [{"text": f"Line {i}."} for i in range(50)]
    out = _run(tmp_path, "--workers", "2", docs=docs)["text"]
    pre_blocks = list(pre._encoded(iter([json.dumps(d) for d in docs]), _FakeEncoder(), _Pool(), 7))
    assert [x[0] for x in pre_blocks] == list(range(50))
    assert IndexedDataset(out).num_documents == 50


class _FakeEncoder:
    def encode(self, line):
        return int(json.loads(line)["text"].split()[1][:-1]), None, 0


class _Pool:
    """Runs map_async inline (checks the two-block ordering logic without processes)."""

    def map_async(self, fn, items, chunksize):
        res = [fn(x) for x in items]
        return type("J", (), {"get": lambda self: res})()


def test_bad_json_line_is_reported(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n{not json}\n')
    args = pre.parse_args(["--input", str(tmp_path / "in.jsonl"), "--tokenizer", TOK,
                           "--output-prefix", str(tmp_path / "o"), "--quiet"])
    with pytest.raises(ValueError, match=r"in\.jsonl: JSON line 2"):
        pre.run(args)
    args.input = str(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="missing.jsonl: no such input file"):
        pre.run(args)


def _lines_of(n, bad=None):
    """n JSON lines of distinct text; `bad` replaces the last one."""
    lines = [json.dumps({"text": f"Line {i} of {n}: {i * 7919 % 1000} pounds."}) for i in range(n)]
    if bad is not None:
        lines[-1] = bad
    return "".join(x + "\n" for x in lines).encode()


def _truncated_gz():
    data = gzip.compress(_lines_of(3000))
    return data[:len(data) // 2]


def _flipped_gz():
    data = bytearray(gzip.compress(_lines_of(3000)))
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


# (input name, input bytes, flags, regex the one-line error must match); the tokenizer is
# TOK unless a flag names another; {d} is the input directory.
BAD_INPUTS = {
    "no_input": ("missing.jsonl", None, [], r"{d}/missing\.jsonl: no such input file$"),
    "input_is_dir": (".", None, [], r"{d}: is a directory, not an input file$"),
    "tokenizer_is_dir": ("in.jsonl", _lines_of(2), ["--tokenizer", "{d}"],
        r"{d}: is a directory, not a tokenizer file$"),
    "no_tokenizer": ("in.jsonl", _lines_of(2), ["--tokenizer", "{d}/nope.json"],
        r"{d}/nope\.json: no such tokenizer file$"),
    "bad_tokenizer": ("in.jsonl", _lines_of(2), ["--tokenizer", "{d}/bad_tok.json"],
        r"{d}/bad_tok\.json: not a tokenizers tokenizer\.json: key must be a "
        r"string at line 1 column 2$"),
    "text_number": ("in.jsonl", b'{"text": "hello"}\n{"text": 5}\n', [],
        r"in\.jsonl: JSON line 2: key 'text': expected a string, got a number$"),
    "text_null": ("in.jsonl", b'{"text": null}\n', [],
        r"in\.jsonl: JSON line 1: key 'text': expected a string, got null$"),
    "missing_key": ("in.jsonl", b'{"body": "hello"}\n', [],
        r"in\.jsonl: JSON line 1: missing key 'text'$"),
    "list_line": ("in.jsonl", b"[1,2,3]\n", [],
        r"in\.jsonl: JSON line 1: expected a JSON object, got an array$"),
    "string_line": ("in.jsonl", b'{"text": "ok"}\n"just a string"\n', [],
        r"in\.jsonl: JSON line 2: expected a JSON object, got a string$"),
    "null_line": ("in.jsonl", b'{"text": "ok"}\nnull\n', [],
        r"in\.jsonl: JSON line 2: expected a JSON object, got null$"),
    "bad_json": ("in.jsonl", b'{"text": "ok"}\n\n{"text": "broken\n', [],
        r"in\.jsonl: JSON line 3: Invalid control character"),  # the blank line counts
    "bad_json_late": ("in.jsonl", _lines_of(5000, bad="{not json"), [],
        r"in\.jsonl: JSON line 5000: Expecting property name"),
    "not_utf8": ("in.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', [],
        r"in\.jsonl: line 2: not UTF-8: byte offset 13 in the line is b'\\xe9'$"),
    "lone_surrogate": ("in.jsonl", b'{"text": "a\\ud800b"}\n', [],
        r"in\.jsonl: JSON line 1: key 'text': unpaired surrogate at character 1"),
    "truncated_gz": ("in.jsonl.gz", _truncated_gz(), [],
        r"in\.jsonl\.gz: unreadable after line [1-9]\d*: Compressed file ended"),
    "corrupt_gz": ("in.jsonl.gz", _flipped_gz(), [], r"in\.jsonl\.gz: "),
    "not_gz": ("in.jsonl.gz", _lines_of(2), [],
        r"in\.jsonl\.gz: unreadable after line 0: Not a gzipped file"),
    "eod_too_big": ("in.jsonl", _lines_of(2), ["--append-eod", "--eod-id", "70000"],
        r"--eod-id 70000: outside the vocabulary \[0, 8192\) of \S*tokenizer\.json"),
    "eod_negative": ("in.jsonl", _lines_of(2), ["--eod-id", "-1"],
        r"--eod-id -1: outside the vocabulary"),
    "no_out_dir": ("in.jsonl", _lines_of(2), ["--output-prefix", "{d}/nodir/out"],
        r"--output-prefix {d}/nodir/out: no such directory {d}/nodir$"),
    "dup_keys": ("in.jsonl", _lines_of(2), ["--json-keys", "text", "text"],
        r"^error: --json-keys: 'text' given twice$"),
    "prefix_is_dir": ("in.jsonl", _lines_of(2), ["--output-prefix", "{d}/"],
        r"^error: --output-prefix {d}/: ends in a directory separator; it is a file-name "),
    "workers_zero": ("in.jsonl", _lines_of(2), ["--workers", "0"],
        r"^error: --workers 0: must be at least 1$"),
    "workers_negative": ("in.jsonl", _lines_of(2), ["--workers", "-3"],
        r"^error: --workers -3: must be at least 1$"),
    "empty_file": ("in.jsonl", b"", [],
        r"in\.jsonl: no tokens for key 'text' \(documents: 0\); an empty "),
    "blank_lines": ("in.jsonl", b"\n  \n\n", [],
        r"in\.jsonl: no tokens for key 'text' \(documents: 0\)"),
    "empty_texts": ("in.jsonl", b'{"text": ""}\n{"text": ""}\n', ["--append-eod"],
        r"in\.jsonl: no tokens for key 'text' \(documents: 2\)"),
    "one_key_empty": ("in.jsonl", b'{"text": "Hi.", "t2": ""}\n', ["--json-keys", "text", "t2"],
        r"in\.jsonl: no tokens for key 't2' \(documents: 1\)"),
}


def _main(inp, out, *flags):
    """The tool's exit status on argv; later flags override the defaults."""
    argv = ["--input", str(inp), "--tokenizer", TOK, "--output-prefix", str(out / "out"),
            "--quiet", *flags]
    return pre.main(argv)


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_error_line(tmp_path, capsys, case, workers):
    """Exit 2 and one `error:` line naming the file (and line) at fault; no output files."""
    name, data, flags, want = BAD_INPUTS[case]
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    (d / "bad_tok.json").write_text("{not a tokenizer\n")
    if data is not None:
        (d / name).write_bytes(data)
    flags = [f.format(d=d) for f in flags]
    assert _main(d / name, out, "--workers", workers, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(want.format(d=re.escape(str(d))), err.rstrip("\n")), err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("cpus,limit", [(2, 64), (40, 160)])
def test_workers_past_the_limit_are_refused_before_any_process_starts(tmp_path, capsys, monkeypatch, cpus, limit):
    """--workers above 4 per CPU this process may use (and above 64) exits 2 naming the flag and the limit, before
    a worker is forked or a file written; the limit itself is accepted."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(pre.multiprocessing, "get_context", lambda *a: pytest.fail("a worker pool was started"))
    (tmp_path / "in.jsonl").write_bytes(_lines_of(2))
    (tmp_path / "out").mkdir()
    for n in (limit + 1, 10**6):
        assert _main(tmp_path / "in.jsonl", tmp_path / "out", "--workers", str(n)) == 2
        assert capsys.readouterr().err == (
            f"error: --workers {n}: at most {limit} (4 per CPU of the {cpus} this process may use, but at least 64); "
            "tokenizing is CPU-bound, so more processes only compete for the CPUs\n")
    assert list((tmp_path / "out").iterdir()) == []
    pre._check_flags(pre.parse_args(["--input", "x", "--tokenizer", TOK, "--output-prefix", "o",
                                     "--workers", str(limit)]))


def test_a_run_removes_the_temporaries_that_killed_runs_left(tmp_path):
    """Temporaries `{output}.{pid}.tmp` that runs killed outright left (their pids gone) are removed by the next
    run writing the same outputs; a live process's (this test's own pid) and other outputs' are kept."""
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    (d / "in.jsonl").write_bytes(_lines_of(20))
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # every pid is below pid_max
    stale = [f"out_text_document.{ext}.{pid}.tmp" for ext in ("bin", "idx") for pid in (dead, dead + 1)]
    kept = [f"out_text_document.bin.{os.getpid()}.tmp", f"out_text_document.idx.{os.getpid()}.tmp",
            f"other_text_document.bin.{dead}.tmp", f"out_text_document.bin.{dead}.tmp.bak"]
    for name in stale + kept:
        (out / name).write_bytes(b"partial")
    r = _script("--input", str(d / "in.jsonl"), "--output-prefix", str(out / "out"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(kept + ["out_text_document.bin", "out_text_document.idx"])
    assert all((out / name).read_bytes() == b"partial" for name in kept)
    assert IndexedDataset(str(out / "out_text_document")).num_documents == 20


def _snapshot(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_failed_run_keeps_existing_dataset(tmp_path, capsys, workers):
    """A run failing after many documents leaves the dataset at its prefix byte-identical
    and no partial files; a later good run replaces it."""
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    (d / "old.jsonl").write_bytes(_lines_of(20))
    (d / "bad.jsonl").write_bytes(_lines_of(5000, bad='{"text": 5}'))
    (d / "new.jsonl").write_bytes(_lines_of(30))
    assert _main(d / "old.jsonl", out, "--append-eod") == 0
    before = _snapshot(out)
    assert sorted(before) == ["out_text_document.bin", "out_text_document.idx"]
    assert _main(d / "bad.jsonl", out, "--append-eod", "--workers", workers) == 2
    assert "bad.jsonl: JSON line 5000: key 'text'" in capsys.readouterr().err
    assert _snapshot(out) == before
    assert _main(d / "new.jsonl", out, "--append-eod", "--workers", workers) == 0
    assert sorted(_snapshot(out)) == sorted(before)
    assert IndexedDataset(str(out / "out_text_document")).num_documents == 30


def test_bug_is_a_traceback_and_leaves_no_files(tmp_path, monkeypatch):
    """An unexpected exception propagates (not an `error:` line) and still cleans up."""
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    (d / "in.jsonl").write_bytes(_lines_of(50))
    assert _main(d / "in.jsonl", out) == 0
    before = _snapshot(out)
    calls = []

    def add_document(self, tokens, lengths, modes=None):
        calls.append(1)
        if len(calls) == 40:
            raise RuntimeError("boom")
        return real(self, tokens, lengths, modes)

    real = pre.indexed.IndexedDatasetBuilder.add_document
    monkeypatch.setattr(pre.indexed.IndexedDatasetBuilder, "add_document", add_document)
    with pytest.raises(RuntimeError, match="boom"):
        _main(d / "in.jsonl", out)
    assert _snapshot(out) == before


def test_script_exit_status(tmp_path):
    """Run as a script with worker processes: exit 2 and the error line after the progress bar."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines_of(3, bad='{"text": [1]}'))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(HERE / "preprocess_data.py"), "--input", str(inp),
                        "--tokenizer", TOK, "--output-prefix", str(tmp_path / "o"), "--workers",
                        "2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (f"error: {inp}: JSON line 3: key 'text': expected a "
                                         "string, got an array")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_bundled_sample_is_reproducible(tmp_path):
    """data/sample's .bin/.idx equal a fresh preprocess of its corpus with its tokenizer."""
    args = pre.parse_args(["--input", str(SAMPLE / "austen.jsonl"), "--tokenizer", TOK,
                           "--output-prefix", str(tmp_path / "sample"), "--append-eod",
                           "--quiet"])
    out = pre.run(args)["text"]
    for ext in (".bin", ".idx"):
        assert Path(out + ext).read_bytes() == (SAMPLE / f"sample_text_document{ext}").read_bytes()
    tok = Tokenizer.from_file(TOK)
    assert tok.get_vocab_size() == 8192
    assert [tok.id_to_token(i) for i in range(3)] == ["<pad>", "<bos>", "<eod>"]


def test_train_tokenizer_small(tmp_path):
    inp = tmp_path / "c.jsonl"
    inp.write_text("".join(json.dumps({"text": "the cat sat on the mat " * 5}) + "\n"
                           for _ in range(20)))
    train_tok.main(["--input", str(inp), "--output", str(tmp_path / "t.json"),
                    "--vocab-size", "300"])
    tok = Tokenizer.from_file(str(tmp_path / "t.json"))
    assert tok.token_to_id("<eod>") == 2
    text = "the cat sat on the mat"
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(text).ids) < len(text)  # merges were learned


TOKENIZER_BAD_INPUTS = {
    "no_input": (None, r"{d}/in\.jsonl: no such input file$"),
    "input_is_dir": (b"dir", r"{d}/in\.jsonl: is a directory, not an input file$"),
    "empty_file": (b"", r"{d}/in\.jsonl: no text under key 'text'; a tokenizer trained on nothing has no merges"),
    "blank_lines": (b"\n \n\n", r"{d}/in\.jsonl: no text under key 'text'; "),
    "empty_texts": (b'{"text": ""}\n{"text": ""}\n', r"{d}/in\.jsonl: no text under key 'text'; "),
    "string_line": (b'{"text": "ok"}\n"just a string"\n',
        r"in\.jsonl: line 2: expected a JSON object, got a string$"),
    "text_number": (b'{"text": "ok"}\n\n{"text": 5}\n',
        r"in\.jsonl: line 3: key 'text': expected a string, got a number$"),
    "missing_key": (b'{"body": "ok"}\n', r"in\.jsonl: line 1: missing key 'text'$"),
    "bad_json": (b'{"text": "ok"}\n{not json\n', r"in\.jsonl: line 2: Expecting property name"),
    "not_utf8": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
        r"in\.jsonl: line 2: not UTF-8: byte offset 13 in the line is b'\\xe9'$"),
    "lone_surrogate": (b'{"text": "a\\ud800b"}\n',
        r"in\.jsonl: line 1: key 'text': unpaired surrogate at character 1"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_BAD_INPUTS))
def test_train_tokenizer_bad_input(tmp_path, capsys, case):
    """Exit 2 and one `error:` line naming the file and line; no tokenizer written."""
    data, want = TOKENIZER_BAD_INPUTS[case]
    if data == b"dir":
        (tmp_path / "in.jsonl").mkdir()
    elif data is not None:
        (tmp_path / "in.jsonl").write_bytes(data)
    rc = train_tok.main(["--input", str(tmp_path / "in.jsonl"), "--output",
                         str(tmp_path / "t.json"), "--vocab-size", "300"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(want.format(d=re.escape(str(tmp_path))), err.rstrip("\n")), err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("flags,want", [
    (["--vocab-size", "100"], r"--vocab-size 100: must be at least 259"),
    (["--vocab-size", "100000000000"], r"--vocab-size 100000000000: must be at most 16777216"),
    (["--output", "{d}/in.jsonl"], r"--output {d}/in\.jsonl: is the input {d}/in\.jsonl; writing it would destroy"),
    (["--min-frequency", "0"], r"--min-frequency 0: must be at least 1"),
    (["--output", "{d}"], r"--output {d}: not a writable file path"),
    (["--output", "{d}/no/t.json"], r"--output {d}/no/t\.json: not a writable file path"),
    (["--output", "/proc/t.json"], r"--output /proc/t\.json: (not a writable file path|cannot write: .*)$"),
], ids=["vocab", "vocab_huge", "output_is_input", "min_frequency", "output_dir", "output_no_dir",
        "output_unwritable"])
def test_train_tokenizer_bad_flags(tmp_path, capsys, flags, want):
    """Flags the trainer would fail on (or quietly ignore) after reading every input: exit 2 naming the flag,
    checked before training."""
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "t.json"), "--vocab-size", "300"]
    rc = train_tok.main(args + [f.format(d=tmp_path) for f in flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert re.search(want.format(d=re.escape(str(tmp_path))), err), err
    assert (tmp_path / "in.jsonl").read_text() == '{"text": "hello"}\n'


def _script(*argv, limit_bytes=None):
    """The tool run as a script; with `limit_bytes`, no file it writes may grow past that many bytes
    (RLIMIT_FSIZE: the kernel fails the write, as a full disk does)."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(HERE / "preprocess_data.py"), "--tokenizer", TOK, "--quiet",
                           *argv], capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=limit if limit_bytes else None)


@pytest.mark.parametrize("full", ["bin", "idx"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_failed_write_is_named_and_keeps_the_existing_dataset(tmp_path, workers, full):
    """A write the file system refuses (a full disk) is one `error:` line naming the `.bin` or `.idx` it hit, exit
    2; the dataset already at the prefix stays byte for byte and no temporary file is left."""
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    (d / "old.jsonl").write_bytes(_lines_of(20))
    if full == "bin":
        (d / "big.jsonl").write_bytes(_lines_of(20000))
    else:  # one token and the EOD a document: 4 bytes of .bin, 20 of .idx
        (d / "big.jsonl").write_text((json.dumps({"text": "the"}) + "\n") * 8000)
    r = _script("--input", str(d / "old.jsonl"), "--output-prefix", str(out / "out"), "--append-eod")
    assert r.returncode == 0, r.stderr
    before = _snapshot(out)
    r = _script("--input", str(d / "big.jsonl"), "--output-prefix", str(out / "out"), "--append-eod",
                "--workers", workers, limit_bytes=64 << 10)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"error: {out}/out_text_document.{full}: cannot write: File too large"]
    assert _snapshot(out) == before


def test_a_kill_between_the_renames_leaves_no_dataset_that_loads(tmp_path):
    """Killed after the new `.bin` replaced the old one but before its `.idx` did: the prefix holds no
    `.idx`, so the reader refuses it by name (rather than reading the new `.bin` through the old `.idx`,
    which agrees with it in size here); a rerun writes the whole dataset."""
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    texts = ("one two", "three four")  # 2 and 3 tokens: the same total either way round
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[::-1]))
    prefix = out / "out_text_document"
    r = _script("--input", str(d / "a.jsonl"), "--output-prefix", str(out / "out"))
    assert r.returncode == 0, r.stderr
    kill = (f"import os, runpy, sys; real = os.replace\n"
            f"def replace(a, b):\n"
            f"    real(a, b)\n"
            f"    if b.endswith('.bin'): os._exit(137)\n"
            f"os.replace = replace\n"
            f"sys.argv = ['preprocess_data', '--input', {str(d / 'b.jsonl')!r}, '--tokenizer', {TOK!r},\n"
            f"            '--output-prefix', {str(out / 'out')!r}, '--quiet']\n"
            f"runpy.run_path({str(HERE / 'preprocess_data.py')!r}, run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 137, r.stderr
    assert not Path(f"{prefix}.idx").exists()
    with pytest.raises(DataError, match=r"out_text_document\.idx: no such file"):
        IndexedDataset(str(prefix))
    r = _script("--input", str(d / "b.jsonl"), "--output-prefix", str(out / "out"))
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_file(TOK)
    ds = IndexedDataset(str(prefix))
    assert [list(ds[i]) for i in range(len(ds))] == [tok.encode(t, add_special_tokens=False).ids
                                                     for t in texts[::-1]]


def test_train_tokenizer_failed_write_keeps_the_existing_file(tmp_path):
    """A tokenizer.json the file system refuses to hold whole (a full disk; here RLIMIT_FSIZE) is one
    `error:` line naming --output, exit 2; the tokenizer already there stays byte for byte and no
    temporary file is left."""
    import resource
    import signal

    inp = tmp_path / "c.jsonl"
    inp.write_bytes(b"".join((SAMPLE / "austen.jsonl").read_bytes().splitlines(keepends=True)[:300]))
    out = tmp_path / "t.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(HERE / "train_tokenizer.py"), "--input", str(inp), "--output", str(out)]
    r = subprocess.run(cmd + ["--vocab-size", "300"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    before = out.read_bytes()
    limit = 2 * len(before)

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run(cmd + ["--vocab-size", "2000"], capture_output=True, text=True, env=env, timeout=300,
                       preexec_fn=small_disk)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(rf"error: --output {re.escape(str(out))}: cannot write: .*File too large.*\n", r.stderr), \
        r.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "t.json"]


def test_killing_the_parent_kills_its_workers_quietly(tmp_path):
    """kill -9 of a run with --workers: its worker processes die with it (none left tokenizing, none printing a
    BrokenPipe traceback when they next report), the dataset at the prefix is untouched and no `.idx` is made;
    the next run removes the temporary `.bin` it left."""
    import signal
    import time

    inp = tmp_path / "in.jsonl"
    inp.write_bytes(_lines_of(20) * 4000)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, str(HERE / "preprocess_data.py"), "--tokenizer", TOK, "--quiet", "--input",
                          str(inp), "--output-prefix", str(tmp_path / "o"), "--workers", "2"],
                         env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(f.stat().st_size for f in tmp_path.glob("o_text_document.bin.*.tmp")) and time.time() < deadline:
        time.sleep(0.05)
    workers = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
               .stdout.split()]
    assert p.poll() is None and len(workers) == 2, (p.poll(), workers)
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    time.sleep(1)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and
                open(f"/proc/{w}/stat").read().split()[2] != "Z"], workers
    assert "Traceback" not in err, err
    assert not list(tmp_path.glob("o_text_document.idx*"))
    assert [p.name for p in tmp_path.glob("o_text_document.*.tmp")] == [f"o_text_document.bin.{p.pid}.tmp"]
    (tmp_path / "small.jsonl").write_bytes(_lines_of(20))
    r = _script("--input", str(tmp_path / "small.jsonl"), "--output-prefix", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("o_*")) == ["o_text_document.bin", "o_text_document.idx"]


def test_train_tokenizer_output_that_is_no_regular_file_is_written_to_not_replaced(tmp_path):
    """--output naming a FIFO (or /dev/null): the tokenizer goes into it and it stays what it was, never
    replaced by a renamed regular file."""
    import stat

    inp = tmp_path / "c.jsonl"
    inp.write_text("".join(json.dumps({"text": "the cat sat on the mat " * 5}) + "\n" for _ in range(20)))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert train_tok.main(["--input", str(inp), "--output", str(fifo), "--vocab-size", "300"]) == 0
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    finally:
        os.close(fd)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert Tokenizer.from_str(data.decode()).token_to_id("<eod>") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "pipe"]
