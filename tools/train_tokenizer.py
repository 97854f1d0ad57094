"""Train a byte-level BPE `tokenizer.json` (HF tokenizers) from JSON-lines text.

  bazel run //tools:train_tokenizer -- --input corpus.jsonl --output tokenizer.json \\
      [--vocab-size 8192] [--json-key text]

Special tokens come first, so with the defaults <pad>=0, <bos>=1, <eod>=2 (Ling2's config
defaults pad_id/bos_id/eod_id).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<pad>", "<bos>", "<eod>"]


def texts(path: str, key: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)[key]
                except (json.JSONDecodeError, KeyError) as e:
                    raise ValueError(f"{path}: line {n}: {e!r}") from None


def train(inputs: list[str], vocab_size: int = 8192, key: str = "text",
          min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((t for p in inputs for t in texts(p, key)), trainer=trainer)
    return tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--json-key", default="text")
    p.add_argument("--min-frequency", type=int, default=2)
    a = p.parse_args(argv)
    for path in a.input:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such input file")
    tok = train(a.input, a.vocab_size, a.json_key, a.min_frequency)
    tok.save(a.output)
    print(f"{a.output}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
