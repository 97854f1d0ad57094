"""JSON-lines corpora (plain or .gz), read one line at a time so that a bad byte is named by its line: the
input of tools/preprocess_data.py and tools/train_tokenizer.py."""

import gzip
import zlib
from typing import Iterator

from ling2.data.errors import DataError

_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
          bool: "a boolean", type(None): "null"}


def json_type(value) -> str:
    """What a parsed JSON value is, in words ("an object", "a string", "null", ...)."""
    return _TYPES[type(value)]


def lines(path: str) -> Iterator[str]:
    """Every line of `path` (blank ones too, so that callers count file lines), decoded as UTF-8; DataError
    naming the file and line for bytes that are not UTF-8, and for a truncated or corrupt .gz."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        f = opener(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open: {e.strerror or e}") from None
    n = 0
    try:
        with f:
            for n, raw in enumerate(f, 1):
                yield raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: line {n}: not UTF-8: byte offset {e.start} in the line is "
                        f"{raw[e.start:e.start + 1]!r}") from None
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(f"{path}: unreadable after line {n}: {e}") from None
