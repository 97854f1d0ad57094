"""Test and reference packages are never imported by code that ships (non-test targets).

Allowed importers: `*_test.py`, `conftest.py`, files under a `testing/` folder or `tests/`,
and the pytest runner of the test macro (`tools/bazel/`).
"""

import ast
import os
from pathlib import Path

TEST_ONLY = {"pytest", "hypothesis", "torch", "transformers", "fla", "einops"}


def _root() -> Path:
    """The source tree: this file's runfile is a symlink into it (read-only in the sandbox)."""
    return Path(os.path.realpath(__file__)).parents[1]


def _is_test_file(rel: Path) -> bool:
    return (rel.name.endswith("_test.py") or rel.name == "conftest.py" or "testing" in rel.parts
            or rel.parts[0] == "tests" or rel.parts[:2] == ("tools", "bazel"))


def _imports(path: Path) -> set:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_non_test_code_imports_no_test_packages():
    root = _root()
    files = [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] in ("ling2", "tools", "tests")]
    assert any(p.name == "loader.py" for p in files), "source files not found in runfiles"
    bad = {}
    for p in files:
        rel = p.relative_to(root)
        if _is_test_file(rel):
            continue
        hits = _imports(p) & TEST_ONLY
        if hits:
            bad[str(rel)] = sorted(hits)
    assert bad == {}, f"non-test code imports test-only packages: {bad}"


def test_checker_catches_a_violation(tmp_path):
    f = tmp_path / "lib.py"
    f.write_text("import os\nfrom torch import nn\nimport transformers.models\n")
    assert _imports(f) & TEST_ONLY == {"torch", "transformers"}
