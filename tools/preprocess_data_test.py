"""preprocess_data and train_tokenizer: outputs checked against direct tokenization with the
HF tokenizer (the reference), Megatron's naming and EOD rules, and the bundled sample data."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

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
    with pytest.raises(FileNotFoundError, match="missing.jsonl: no such input file"):
        pre.run(args)


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
