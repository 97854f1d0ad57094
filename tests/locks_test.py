"""The platform locks agree: a package two locks share has one version, every pin is hashed,
and each lock pins what its platform needs. A small parser of the lock files; no network."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]  # the workspace (or its runfiles tree: the files are data deps)
PLATFORMS = ("cpu", "tpu", "cuda")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(path):
    """{normalised name: version} of a hash-pinned lock; ValueError on an unpinned or unhashed entry."""
    pins, name, hashes = {}, None, 0
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith(" "):
            if "--hash=sha256:" in line:
                hashes += 1
            continue
        if name is not None and not hashes:
            raise ValueError(f"{path}: {name} has no --hash")
        m = _PIN.match(line)
        if not m:
            raise ValueError(f"{path}:{n}: not a '==' pin: {line!r}")
        name, hashes = _norm(m.group(1)), int("--hash=sha256:" in line)
        if name in pins:
            raise ValueError(f"{path}:{n}: {name} pinned twice")
        pins[name] = m.group(3)
    if name is not None and not hashes:
        raise ValueError(f"{path}: {name} has no --hash")
    return pins


def parse_in(path):
    """Names required by a requirements .in file, following -r includes."""
    names = set()
    for line in Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            names |= parse_in(Path(path).parent / line[2:].strip())
        elif line:
            names.add(_norm(re.match(r"[A-Za-z0-9._-]+", line).group(0)))
    return names


def disagreements(locks):
    """[(package, {platform: version})] for packages whose versions differ between locks."""
    out = []
    for name in sorted(set().union(*locks.values())):
        versions = {p: pins[name] for p, pins in locks.items() if name in pins}
        if len(set(versions.values())) > 1:
            out.append((name, versions))
    return out


@pytest.fixture(scope="module")
def locks():
    return {p: parse_lock(ROOT / f"requirements_lock_{p}.txt") for p in PLATFORMS}


def test_shared_packages_have_one_version(locks):
    assert disagreements(locks) == []
    shared = set(locks["cpu"]) & set(locks["tpu"]) & set(locks["cuda"])
    assert {"jax", "jaxlib", "flax", "numpy", "pytest"} <= shared


def test_every_requirement_is_locked(locks):
    common = parse_in(ROOT / "requirements.in")
    for p in PLATFORMS:
        missing = parse_in(ROOT / f"requirements-{p}.in") - set(locks[p])
        assert missing == set(), f"requirements-{p}.in names packages missing from its lock: {missing}"
        assert common <= set(locks[p])


def test_each_lock_pins_its_platform(locks):
    for p in PLATFORMS:
        assert locks[p]["jax"] == locks[p]["jaxlib"] == "0.10.2"
    assert "libtpu" in locks["tpu"] and "libtpu" not in locks["cpu"] and "libtpu" not in locks["cuda"]
    assert locks["cuda"]["jax-cuda12-plugin"] == locks["cuda"]["jax-cuda12-pjrt"] == "0.10.2"
    assert not any(n.startswith("jax-cuda") or n.startswith("nvidia-") for n in locks["cpu"] | locks["tpu"])
    assert locks["cpu"]["torch"].endswith("+cpu") and "torch" not in locks["tpu"] and "torch" not in locks["cuda"]


def test_parser_catches_bad_locks(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Foo_Bar==1.0 \\\n    --hash=sha256:00\n    # via x\nbaz==2.0 \\\n    --hash=sha256:11\n")
    b.write_text("foo-bar==1.1 \\\n    --hash=sha256:22\n")
    locks = {"a": parse_lock(a), "b": parse_lock(b)}
    assert locks["a"] == {"foo-bar": "1.0", "baz": "2.0"}
    assert disagreements(locks) == [("foo-bar", {"a": "1.0", "b": "1.1"})]
    b.write_text("foo-bar>=1.1 \\\n    --hash=sha256:22\n")
    with pytest.raises(ValueError, match="not a '==' pin"):
        parse_lock(b)
    b.write_text("foo-bar==1.1\nbaz==2.0 \\\n    --hash=sha256:22\n")
    with pytest.raises(ValueError, match="foo-bar has no --hash"):
        parse_lock(b)


def test_ling3_test_lock_is_the_cpu_stack_with_transformers_5(locks):
    """The test-only Ling 3 venv (requirements_lock_ling3.txt) differs from the cpu lock only in
    transformers 5.x and the hub packages it needs newer (lock_requirements.sh's LING3_OWN)."""
    ling3 = parse_lock(ROOT / "requirements_lock_ling3.txt")
    own = {"transformers", "huggingface-hub", "tokenizers"}
    differ = {n for n in set(ling3) & set(locks["cpu"]) if ling3[n] != locks["cpu"][n]}
    assert differ == own
    assert ling3["transformers"].startswith("5.23.") and locks["cpu"]["transformers"].startswith("4.")
    assert ling3["jax"] == ling3["jaxlib"] == "0.10.2" and ling3["torch"].endswith("+cpu")
    assert parse_in(ROOT / "requirements-ling3.in") <= set(ling3)
