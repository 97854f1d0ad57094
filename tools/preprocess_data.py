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

Outputs are written to temporary files beside the targets and renamed into place only on
success, so a failed run leaves an existing dataset at the prefix untouched; a run removes the
temporaries of its outputs that a killed run (whose pid is gone) left. Bad input (a
missing or malformed file, line or flag; an input with no tokens) is one `error:` line on
stderr naming the file and line, and exit status 2.
"""

from __future__ import annotations

import contextlib
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

from ling2.config import cli
from ling2.data import indexed
from ling2.data.errors import DataError
from ling2.data.jsonl import json_type, lines

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
    """Per-process tokenizer; encodes one JSON line into ({key: ids}, {key: lengths}, bytes).

    A bad line comes back as (None, message, bytes) rather than raising, so that the parent
    names its line number also when the encoding ran in a worker; a blank line (no document)
    as (None, None, bytes).
    """

    def __init__(self, args):
        self.args = args
        self.parent = os.getpid()

    def initializer(self):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        Encoder.tokenizer = Tokenizer.from_file(self.args.tokenizer)

    def worker_initializer(self):
        """A pool worker's: as `initializer`, and the worker is killed with its parent, so that a parent killed
        (kill -9) mid-run leaves no worker tokenizing on, or dying later with a BrokenPipe traceback on the
        terminal."""
        if sys.platform.startswith("linux"):
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != self.parent:  # the parent died before prctl
                os._exit(1)
        self.initializer()

    def encode(self, line: str):
        if not line.strip():
            return None, None, len(line)
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            return None, str(e), len(line)
        if not isinstance(data, dict):
            return None, f"expected a JSON object, got {json_type(data)}", len(line)
        ids, lens = {}, {}
        for key in self.args.json_keys:
            if key not in data:
                return None, f"missing key {key!r}", len(line)
            text = data[key]
            if not isinstance(text, str):
                what = json_type(text)
                return None, f"key {key!r}: expected a string, got {what}", len(line)
            parts = split_sentences(text) if self.args.split_sentences else [text]
            try:
                encodings = Encoder.tokenizer.encode_batch(parts, add_special_tokens=False)
            except TypeError:
                try:  # tokenizers rejects lone surrogates (valid JSON escapes) with a TypeError
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    return None, (f"key {key!r}: unpaired surrogate at character {e.start} "
                                  "(not valid Unicode)"), len(line)
                raise
            doc, sl = [], []
            for enc in encodings:
                if enc.ids:
                    doc.extend(enc.ids)
                    sl.append(len(enc.ids))
            if doc and self.args.append_eod:
                doc.append(self.args.eod_id)
                sl[-1] += 1
            ids[key], lens[key] = doc, sl
        return ids, lens, len(line)


def _encoded(raw: Iterator[str], encoder: "Encoder", pool, block: int = 4096):
    """Encoded lines in order; at most two blocks of lines are in memory at once."""
    if pool is None:
        yield from map(encoder.encode, raw)
        return
    pending, buf = None, []
    for line in raw:
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


def _not_a_file(path: str, what: str) -> str:
    """How `path` fails to be `what` ("an input file"): a directory is not a missing file."""
    return f"is a directory, not {what}" if os.path.isdir(path) else f"no such {what.split(' ', 1)[1]}"


def _load_tokenizer(path: str) -> Tokenizer:
    if not os.path.isfile(path):
        raise DataError(f"{path}: {_not_a_file(path, 'a tokenizer file')}")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception for unreadable or bad JSON
        raise DataError(f"{path}: not a tokenizers tokenizer.json: {e}") from None


def _tmp(path: str) -> str:
    return f"{path}.{os.getpid()}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no pid reaches (kept)
        pass
    return True


def _remove_stale_temporaries(prefixes) -> None:
    """Removes the temporaries (`_tmp`) of these outputs that a run killed outright (kill -9, the OOM killer) left
    behind: those whose pid names no live process on this host. A live run's are kept, also another user's."""
    names = {os.path.basename(path) for p in prefixes for path in (indexed.bin_path(p), indexed.idx_path(p))}
    out_dir = os.path.dirname(next(iter(prefixes))) or "."
    with contextlib.suppress(OSError):
        for name in os.listdir(out_dir):
            m = re.fullmatch(r"(.+)\.([1-9][0-9]*)\.tmp", name)
            if m and m.group(1) in names and not _alive(int(m.group(2))):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(out_dir, name))


@contextlib.contextmanager
def _writing(path: str):
    """An OSError while writing `path` (its temporary file) as a DataError naming `path`: a full disk
    (ENOSPC), a quota, an I/O error."""
    try:
        yield
    except OSError as e:
        raise DataError(f"{path}: cannot write: {e.strerror or e}") from None


def _publish(prefixes) -> None:
    """Puts each finished pair in place of the old one: both files are first synced to disk, and the old
    `.idx` is removed before the `.bin` is replaced, so that a kill or crash between the renames leaves a
    `.bin` without an `.idx` (refused by the reader), never the new `.bin` beside the old `.idx` (which
    the reader could take for a whole dataset when the sizes agree)."""
    for p in prefixes:
        for path in (indexed.bin_path(p), indexed.idx_path(p)):
            with _writing(path):
                fd = os.open(_tmp(path), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    for p in prefixes:
        bin_file, idx_file = indexed.bin_path(p), indexed.idx_path(p)
        with _writing(idx_file):
            if os.path.lexists(idx_file):
                os.remove(idx_file)
            os.replace(_tmp(bin_file), bin_file)
            os.replace(_tmp(idx_file), idx_file)
    for d in {os.path.dirname(p) or "." for p in prefixes}:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_MIN_WORKER_LIMIT = 64


def max_workers() -> tuple[int, int]:
    """(CPUs this process may run on, the most --workers accepted): 4 per CPU, and at least 64, so that a
    command line copied from a bigger node still runs on a small one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return cpus, max(_MIN_WORKER_LIMIT, 4 * cpus)


def _check_flags(args) -> None:
    """Flags that would otherwise run with a silently different meaning: a repeated key (each
    document written twice), a prefix naming a directory (hidden `_key_document` files in it),
    a worker count below 1; and one past `max_workers` (a typo such as 10**6 forking that many)."""
    seen = set()
    for k in args.json_keys:
        if k in seen:
            raise DataError(f"--json-keys: {k!r} given twice")
        seen.add(k)
    if not os.path.basename(args.output_prefix):
        raise DataError(f"--output-prefix {args.output_prefix}: ends in a directory separator; "
                        "it is a file-name prefix (e.g. DIR/corpus)")
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be at least 1")
    cpus, limit = max_workers()
    if args.workers > limit:
        raise DataError(f"--workers {args.workers}: at most {limit} (4 per CPU of the {cpus} this process may "
                        f"use, but at least {_MIN_WORKER_LIMIT}); tokenizing is CPU-bound, so more processes only "
                        "compete for the CPUs")


def run(args) -> dict:
    """Tokenizes `args.input`; returns {key: output prefix}. Bad input raises DataError."""
    _check_flags(args)
    if not os.path.isfile(args.input):
        raise DataError(f"{args.input}: {_not_a_file(args.input, 'an input file')}")
    tok = _load_tokenizer(args.tokenizer)
    vocab = tok.get_vocab_size()
    if args.eod_id is None:
        args.eod_id = find_eod_id(tok)
    elif not 0 <= args.eod_id < vocab:
        raise DataError(f"--eod-id {args.eod_id}: outside the vocabulary [0, {vocab}) of "
                        f"{args.tokenizer}")
    if args.append_eod and args.eod_id is None:
        raise DataError(f"{args.tokenizer}: no EOD token ({', '.join(_EOD_NAMES)}); "
                        "pass --eod-id")
    out_dir = os.path.dirname(args.output_prefix) or "."
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix {args.output_prefix}: no such directory {out_dir}")
    dtype = indexed.optimal_dtype(vocab)
    prefixes = {k: output_prefix(args.output_prefix, k, args.split_sentences)
                for k in args.json_keys}
    _remove_stale_temporaries(prefixes.values())
    builders, t0 = {}, time.time()
    try:
        for k, p in prefixes.items():
            try:
                builders[k] = indexed.IndexedDatasetBuilder(_tmp(indexed.bin_path(p)), dtype=dtype)
            except OSError as e:
                raise DataError(f"{indexed.bin_path(p)}: cannot write: {e.strerror or e}") from None
        n_tokens = _tokenize(args, builders, prefixes)
        for k, p in prefixes.items():
            with _writing(indexed.idx_path(p)):
                builders[k].finalize(_tmp(indexed.idx_path(p)))
        _publish(prefixes.values())
    except BaseException:
        for b in builders.values():
            b.discard()
        raise
    if not args.quiet:
        dt = max(time.time() - t0, 1e-9)
        print(f"{n_tokens} tokens in {dt:.1f}s ({n_tokens / dt:,.0f} tokens/s) -> "
              + ", ".join(prefixes.values()), file=sys.stderr)
    return prefixes


def _tokenize(args, builders: dict, prefixes: dict) -> int:
    """Feeds every document of `args.input` to `builders` ({key: builder}); the token count. A failed
    write is a DataError naming the `.bin` of `prefixes` ({key: output prefix})."""
    encoder = Encoder(args)
    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers, encoder.worker_initializer)
    else:
        encoder.initializer()
    docs = _encoded(lines(args.input), encoder, pool)
    tokens, n_docs = dict.fromkeys(builders, 0), 0
    bar = tqdm.tqdm(unit="tok", unit_scale=True, disable=args.quiet, desc="tokens")
    try:
        for line, (ids, lens, _) in enumerate(docs, 1):
            if ids is None:
                if lens is None:
                    continue
                raise DataError(f"{args.input}: JSON line {line}: {lens}")
            for k in args.json_keys:
                with _writing(indexed.bin_path(prefixes[k])):
                    builders[k].add_document(np.asarray(ids[k], dtype=np.int64), lens[k])
                tokens[k] += len(ids[k])
                bar.update(len(ids[k]))
            n_docs += 1
            bar.set_postfix(docs=n_docs, refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    for k, n in tokens.items():
        if n == 0:
            raise DataError(f"{args.input}: no tokens for key {k!r} (documents: {n_docs}); "
                            "an empty dataset cannot be trained on")
    return sum(tokens.values())


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSON lines (optionally .gz)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer", required=True, help="HF tokenizers tokenizer.json")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--eod-id", type=int, default=None,
                   help="default: the tokenizer's " + "/".join(_EOD_NAMES))
    p.add_argument("--split-sentences", action="store_true")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizing processes; about one per CPU is fastest. Refused above 4 per CPU this "
                        "process may use (64 where there are fewer than 16): tokenizing is CPU-bound, so more "
                        "processes only compete for the CPUs, each holding its own tokenizer")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
