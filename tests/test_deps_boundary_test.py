"""Import boundaries of the code that ships (non-test files):
- test and reference packages are never imported; allowed importers are `*_test.py`, `conftest.py`,
  files under a `testing/` folder or `tests/`, and the pytest runner of the test macro (`tools/bazel/`);
- a ling2 package imports only packages below it: config < {data, kernels} < layers < checkpoint
  < {convert, train} < infer (packages on one level do not import each other).
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


LEVEL = {"config": 0, "data": 1, "kernels": 1, "layers": 2, "checkpoint": 3, "convert": 4, "train": 4, "infer": 5}


def _modules(path: Path) -> set:
    """Every absolute module name `path` imports (`from a.b import c` gives a.b and a.b.c)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _imports(path: Path) -> set:
    return {m.split(".")[0] for m in _modules(path)}


def _ling2_packages(path: Path) -> set:
    """The ling2 packages (ling2.<pkg>) `path` imports."""
    return {m.split(".")[1] for m in _modules(path) if m.startswith("ling2.") and m.count(".") >= 1} & set(LEVEL)


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


def test_packages_import_only_lower_packages():
    root = _root()
    bad = {}
    for pkg, level in LEVEL.items():
        for p in (root / "ling2" / pkg).rglob("*.py"):
            rel = p.relative_to(root)
            if _is_test_file(rel):
                continue
            up = sorted(q for q in _ling2_packages(p) if q != pkg and LEVEL[q] >= level)
            if up:
                bad[str(rel)] = up
    assert bad == {}, f"ling2 packages importing packages at or above their level: {bad}"


def test_layer_checker_catches_a_violation(tmp_path):
    f = tmp_path / "lib.py"
    f.write_text("from ling2.config import load_config\nfrom ling2 import convert\nimport ling2.train.loop\n")
    assert _ling2_packages(f) == {"config", "convert", "train"}


def test_checker_catches_a_violation(tmp_path):
    f = tmp_path / "lib.py"
    f.write_text("import os\nfrom torch import nn\nimport transformers.models\n")
    assert _imports(f) & TEST_ONLY == {"torch", "transformers"}
