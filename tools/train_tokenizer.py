"""Train a byte-level BPE `tokenizer.json` (HF tokenizers) from JSON-lines text.

  bazel run //tools:train_tokenizer -- --input corpus.jsonl --output tokenizer.json \\
      [--vocab-size 8192] [--json-key text]

Special tokens come first, so with the defaults <pad>=0, <bos>=1, <eod>=2 (Ling2's config
defaults pad_id/bos_id/eod_id). Each non-blank line is a JSON object with a string at
--json-key. Bad input (a missing file; a line that is not UTF-8, not JSON, not an object, or
lacks the key) is one `error:` line on stderr naming the file and line, and exit status 2.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ling2.config import cli
from ling2.config.paths import replaced
from ling2.data.errors import DataError
from ling2.data.jsonl import json_type, lines

SPECIAL = ["<pad>", "<bos>", "<eod>"]
MAX_VOCAB = 1 << 24  # the trainer sizes tables by vocab_size up front: 2^24 is ~1 GB, far past any real vocabulary


class InputError(ValueError):
    """Bad input (file, line or flag); the message names it. main() prints it as one `error:`
    line and exits 2."""


def texts(path: str, key: str) -> Iterator[str]:
    """The `key` string of every JSON-object line of `path` (`.gz` too); blank lines skipped."""
    for n, line in enumerate(lines(path), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: line {n}: {e}") from None
        if not isinstance(data, dict):
            raise InputError(f"{path}: line {n}: expected a JSON object, got {json_type(data)}")
        if key not in data:
            raise InputError(f"{path}: line {n}: missing key {key!r}")
        if not isinstance(data[key], str):
            raise InputError(f"{path}: line {n}: key {key!r}: expected a string, got {json_type(data[key])}")
        try:
            data[key].encode("utf-8")
        except UnicodeEncodeError as e:  # a valid JSON escape that tokenizers rejects
            raise InputError(f"{path}: line {n}: key {key!r}: unpaired surrogate at character {e.start} "
                             "(not valid Unicode)") from None
        yield data[key]


def train(inputs: list[str], vocab_size: int = 8192, key: str = "text",
          min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    chars = [0]

    def counted():
        for p in inputs:
            for t in texts(p, key):
                chars[0] += len(t)
                yield t

    tok.train_from_iterator(counted(), trainer=trainer)
    if not chars[0]:
        raise InputError(f"{', '.join(inputs)}: no text under key {key!r}; a tokenizer trained on nothing has "
                         "no merges (every byte its own token)")
    return tok


def save(tok: Tokenizer, output: str) -> None:
    """Writes `tok` to `output` whole or not at all (`paths.replaced`: a failed or killed write, a full disk,
    leaves the file that was there, never a cut-short tokenizer.json); InputError naming --output when the
    write fails."""
    try:
        with replaced(output) as f:
            f.write(tok.to_str(pretty=True))  # what Tokenizer.save writes
    except OSError as e:
        raise InputError(f"--output {output}: cannot write: {e.strerror or e}") from None


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--json-key", default="text")
    p.add_argument("--min-frequency", type=int, default=2)
    a = p.parse_args(argv)
    try:
        least = 256 + len(SPECIAL)  # the byte alphabet and the special tokens
        if a.vocab_size < least:
            raise InputError(f"--vocab-size {a.vocab_size}: must be at least {least} (256 bytes + {SPECIAL})")
        if a.vocab_size > MAX_VOCAB:
            raise InputError(f"--vocab-size {a.vocab_size}: must be at most {MAX_VOCAB}")
        if a.min_frequency < 1:
            raise InputError(f"--min-frequency {a.min_frequency}: must be at least 1")
        out = os.path.dirname(os.path.abspath(a.output))
        if os.path.isdir(a.output) or not os.path.isdir(out) or not os.access(out, os.W_OK):
            raise InputError(f"--output {a.output}: not a writable file path")
        for path in a.input:
            if os.path.isfile(path) and os.path.exists(a.output) and os.path.samefile(path, a.output):
                raise InputError(f"--output {a.output}: is the input {path}; writing it would destroy the corpus")
            if not os.path.isfile(path):
                raise InputError(f"{path}: {'is a directory, not an' if os.path.isdir(path) else 'no such'} input file")
        tok = train(a.input, a.vocab_size, a.json_key, a.min_frequency)
        save(tok, a.output)
    except (InputError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.output}: vocab {tok.get_vocab_size()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
