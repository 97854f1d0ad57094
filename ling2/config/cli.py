"""What every Ling2 command line shares: a bad flag is bad input (`error: bad flag: ...` on stderr, exit 2), where
absl's own parser exits 1 with a usage dump."""

import sys

from absl import flags


def parse_flags(argv):
    """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`; returns the arguments left over."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: bad flag: {e}", file=sys.stderr)
        sys.exit(2)
