"""Runs pytest on the test files named on the command line (used by ling2_py_test)."""

import os
import sys

import pytest

if __name__ == "__main__":
    args = ["-p", "no:cacheprovider", "-q", "--color=no", "-rfEs"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    sys.exit(pytest.main(args + sys.argv[1:]))
