"""What every Ling2 command line shares: a bad flag is bad input (`error: bad flag: ...` on stderr, exit 2), where
absl's own parser exits 1 with a usage dump; a result printed to a stdout that cannot take it is one named error."""

import argparse
import os
import sys

from absl import flags


def parse_flags(argv):
    """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`; returns the arguments left over."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: bad flag: {e}", file=sys.stderr)
        sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the commands that use it, with its errors as bad input like every other: one `error:` line
    naming the flag, exit 2 (argparse's own prints the usage first)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def print_out(text: str) -> None:
    """print(text) to stdout and flush it. A write the OS refuses (stdout redirected to a full disk) raises
    OSError, with stdout pointed at /dev/null first: what the failed write left buffered would otherwise fail
    again at exit, where Python prints a second message and exits 120."""
    try:
        print(text)
        sys.stdout.flush()
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        raise
