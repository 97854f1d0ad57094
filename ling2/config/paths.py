"""Paths given by a user on the command line of a `bazel run` binary."""

import os
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
