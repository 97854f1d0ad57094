"""Paths given by a user on the command line of a `bazel run` binary, and how a command writes the file one
names: checked before the work that makes it, then replaced whole or not at all."""

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def user_path(p) -> Path:
    """Absolute paths as they are; relative ones against the directory `bazel run` was called
    from (BUILD_WORKING_DIRECTORY), else the current directory."""
    path = Path(p)
    if path.is_absolute():
        return path
    return Path(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())) / path


REPO = Path(os.path.abspath(__file__)).parents[2]  # the repository (the runfiles tree under Bazel)


def find_file(p) -> Path:
    """A user path if it exists, else the same path inside the repository (bundled files)."""
    up = user_path(p)
    return up if up.exists() or Path(p).is_absolute() else REPO / p


def check_writable(path) -> None:
    """ValueError saying why a file could not be written at `path`, found before a long run makes its
    contents: `path` is a directory, an existing file that is not writable, or the nearest existing directory
    above it is no directory or takes no new file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{path}: not writable")
    above = next(p for p in path.parents if p.exists())
    if not above.is_dir():
        raise ValueError(f"{path}: {above} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=above):
            pass
    except OSError as e:
        raise ValueError(f"{path}: cannot write in {above}: {e.strerror or e}") from None


@contextlib.contextmanager
def replaced(path, mode: str = "w"):
    """A file to write `path` through (its directories made): a temporary beside it, synced and renamed over
    `path` when the block ends, removed if it raises, so that a reader, a kill or a full disk finds the previous
    file or the new one whole, never one cut short. A `path` that exists and is no regular file (/dev/null, a
    FIFO) is written in place instead of being replaced. OSError when the file system refuses."""
    path = Path(path)
    encoding = None if "b" in mode else "utf-8"
    if path.exists() and not path.is_file():
        with open(path, mode, encoding=encoding) as f:
            yield f
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_failure(e: OSError) -> str:
    """Why a write failed, in the words an `error:` line gives it: a full disk named as such, else the system's."""
    return "disk full (no space left on device)" if e.errno == errno.ENOSPC else (e.strerror or str(e))
