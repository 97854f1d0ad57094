"""Tokenize a JSON-lines corpus into Megatron `.bin`/`.idx` files.

  bazel run //tools:preprocess_data -- --input x.jsonl --json-keys text \\
      --tokenizer tokenizer.json --output-prefix out [--append-eod] [--split-sentences] \\
      [--workers N]

Writes `{prefix}_{key}_{document|sentence}.bin/.idx` per key, like Megatron-LM's tool. Each
JSON line is a document; with --split-sentences every sentence is its own sequence (a
regex splitter on . ! ? followed by space and a capital, skipping common abbreviations;
Megatron uses NLTK punkt, which is not a Ling2 dependency). --append-eod adds the EOD id
to the last sequence of a non-empty document. Empty sentences are dropped. Input streams
line by line (`.gz` too) in blocks, so memory is bounded by two blocks plus the index
arrays. The progress bar shows tokens/s.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Iterator, Optional

import numpy as np
import tqdm
from tokenizers import Tokenizer

from ling2.data import indexed

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_ABBREV = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|St|Sr|Jr|Prof|Rev|Capt|Col|Gen|Lt|Mt|vs|etc|"
                     r"e\.g|i\.e)|\b[A-Z])\.$")
_EOD_NAMES = ("<eod>", "<|endoftext|>", "</s>", "<eos>", "[EOS]")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` (without the whitespace between them)."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        if _ABBREV.search(text, 0, m.start()):
            continue
        end = m.start() + len(m.group(0).rstrip())
        out.append(text[start:end])
        start = m.end()
    out.append(text[start:])
    return [s for s in (t.strip() for t in out) if s]


def find_eod_id(tok: Tokenizer) -> Optional[int]:
    for name in _EOD_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


class Encoder:
    """Per-process tokenizer; encodes one JSON line into ({key: ids}, {key: lengths})."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        Encoder.tokenizer = Tokenizer.from_file(self.args.tokenizer)

    def encode(self, line: str):
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            return None, str(e), len(line)
        ids, lens = {}, {}
        for key in self.args.json_keys:
            if key not in data:
                return None, f"missing key {key!r}", len(line)
            text = data[key]
            parts = split_sentences(text) if self.args.split_sentences else [text]
            doc, sl = [], []
            for enc in Encoder.tokenizer.encode_batch(parts, add_special_tokens=False):
                if enc.ids:
                    doc.extend(enc.ids)
                    sl.append(len(enc.ids))
            if doc and self.args.append_eod:
                doc.append(self.args.eod_id)
                sl[-1] += 1
            ids[key], lens[key] = doc, sl
        return ids, lens, len(line)


def _lines(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


def _encoded(lines: Iterator[str], encoder: "Encoder", pool, block: int = 4096):
    """Encoded lines in order; at most two blocks of lines are in memory at once."""
    if pool is None:
        yield from map(encoder.encode, lines)
        return
    pending, buf = None, []
    for line in lines:
        buf.append(line)
        if len(buf) == block:
            job = pool.map_async(encoder.encode, buf, chunksize=32)
            if pending is not None:
                yield from pending.get()
            pending, buf = job, []
    last = pool.map_async(encoder.encode, buf, chunksize=32) if buf else None
    for job in (pending, last):
        if job is not None:
            yield from job.get()


def output_prefix(prefix: str, key: str, split_sentences: bool) -> str:
    return f"{prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def run(args) -> dict:
    """Tokenizes `args.input`; returns {key: output prefix}."""
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"{args.input}: no such input file")
    tok = Tokenizer.from_file(args.tokenizer)
    if args.eod_id is None:
        args.eod_id = find_eod_id(tok)
    if args.append_eod and args.eod_id is None:
        raise ValueError(f"{args.tokenizer}: no EOD token ({', '.join(_EOD_NAMES)}); "
                         "pass --eod-id")
    dtype = indexed.optimal_dtype(tok.get_vocab_size())
    prefixes = {k: output_prefix(args.output_prefix, k, args.split_sentences)
                for k in args.json_keys}
    builders = {k: indexed.IndexedDatasetBuilder(indexed.bin_path(p), dtype=dtype)
                for k, p in prefixes.items()}
    encoder = Encoder(args)
    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers, encoder.initializer)
    else:
        encoder.initializer()
    docs = _encoded(_lines(args.input), encoder, pool)
    n_tokens, t0 = 0, time.time()
    bar = tqdm.tqdm(unit="tok", unit_scale=True, disable=args.quiet, desc="tokens")
    try:
        for i, (ids, lens, _) in enumerate(docs):
            if ids is None:
                raise ValueError(f"{args.input}: JSON line {i + 1}: {lens}")
            for k in args.json_keys:
                builders[k].add_document(np.asarray(ids[k], dtype=np.int64), lens[k])
                n_tokens += len(ids[k])
                bar.update(len(ids[k]))
            bar.set_postfix(docs=i + 1, refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    for k, p in prefixes.items():
        builders[k].finalize(indexed.idx_path(p))
    if not args.quiet:
        dt = max(time.time() - t0, 1e-9)
        print(f"{n_tokens} tokens in {dt:.1f}s ({n_tokens / dt:,.0f} tokens/s) -> "
              + ", ".join(prefixes.values()), file=sys.stderr)
    return prefixes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSON lines (optionally .gz)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer", required=True, help="HF tokenizers tokenizer.json")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--eod-id", type=int, default=None,
                   help="default: the tokenizer's " + "/".join(_EOD_NAMES))
    p.add_argument("--split-sentences", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
