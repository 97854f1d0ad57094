"""Runs pytest on the test files named on the command line (used by ling2_py_test).

Under Bazel test sharding (shard_count) each shard runs one contiguous slice of the collected tests, in
collection order, so tests that share an expensive cached setup can be kept on one shard."""

import os
import pathlib
import sys

import pytest


class ShardSlice:
    """Keeps the index-th of `total` contiguous slices of the collected tests."""

    def __init__(self, index: int, total: int):
        self.index, self.total = index, total

    def pytest_collection_modifyitems(self, config, items):
        size = -(-len(items) // self.total)
        keep = items[self.index * size:(self.index + 1) * size]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


if __name__ == "__main__":
    args = ["-p", "no:cacheprovider", "-q", "--color=no", "-rfEs"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    plugins = []
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total > 1:
        pathlib.Path(os.environ["TEST_SHARD_STATUS_FILE"]).touch()
        plugins.append(ShardSlice(int(os.environ["TEST_SHARD_INDEX"]), total))
    code = pytest.main(args + sys.argv[1:], plugins=plugins)
    sys.exit(0 if total > 1 and code == pytest.ExitCode.NO_TESTS_COLLECTED else code)
