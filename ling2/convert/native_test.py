"""The native block writer (ling2/checkpoint/safetensors.c) against the numpy path: the same bytes, and the layouts
checked with the safetensors package as the independent reader."""

import filecmp
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from ling2.checkpoint import safetensors_io
from ling2.checkpoint.safetensors_io import PlannedWriter, ShardedReader, ShardedWriter
from ling2.config import load_config
from ling2.convert import convert
from ling2.convert.testing.hf_fixtures import write_random_hf


def test_native_kernel_is_loaded_under_bazel(tmp_path):
    """Bazel puts libling2_safetensors.so beside safetensors_io.py; there, the native path must be the one used."""
    if "TEST_SRCDIR" in os.environ:
        assert safetensors_io.native() is not None
        assert PlannedWriter(tmp_path, []).lib is not None


def _numpy_only(monkeypatch):
    monkeypatch.setattr(safetensors_io, "native", lambda: None)


def _same_files(a, b, suffix=""):
    names = sorted(n for n in os.listdir(a) if n.endswith(suffix))
    assert names and names == sorted(n for n in os.listdir(b) if n.endswith(suffix))
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.parametrize("scan", [False, True])
def test_native_and_numpy_conversions_write_identical_files(tmp_path, monkeypatch, scan):
    if safetensors_io.native() is None:
        pytest.fail(f"{safetensors_io.LIB} not built: `bazel build //ling2/checkpoint:{safetensors_io.LIB}`")
    cfg = load_config(model_name="ling2-tiny")
    write_random_hf(tmp_path / "hf", cfg)
    for tag in ("native", "numpy"):
        if tag == "numpy":
            _numpy_only(monkeypatch)
        convert.convert_hf_to_ling2(tmp_path / "hf", tmp_path / tag / "l2", scan_layers=scan, progress=False)
        convert.convert_ling2_to_hf(tmp_path / tag / "l2", tmp_path / tag / "hf2", shard_bytes=1 << 20,
                                    progress=False)
    _same_files(tmp_path / "native" / "l2" / "state", tmp_path / "numpy" / "l2" / "state")
    _same_files(tmp_path / "native" / "hf2", tmp_path / "numpy" / "hf2")
    _same_files(tmp_path / "hf", tmp_path / "native" / "hf2", ".safetensors")  # and equal the input's shards


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jax.numpy.bfloat16, np.int8, np.float64])
def test_native_writer_blocks_of_every_kind(tmp_path, monkeypatch, dtype):
    """Transposed blocks of ragged sizes (not multiples of the 8 x 8 tiles), a transposed block wider than the
    staging buffer's rows (split between the threads), contiguous blocks bigger than the buffer, a cast (numpy
    fallback), each in runs and alone; read back with the safetensors package and compared with numpy's
    transpose."""
    if safetensors_io.native() is None:
        pytest.fail(f"{safetensors_io.LIB} not built")
    monkeypatch.setattr(safetensors_io, "SPLIT", 64 << 10)
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    x = {"t": (rng.standard_normal((5, 37, 21)) * 50).astype(dt),  # 5 blocks, each written from [21, 37]
         "wide": (rng.standard_normal((3, 40000)) * 50).astype(dt),  # rows of 40000 > NATIVE_CHUNK / TILE bytes
         "big": (rng.standard_normal((2, safetensors_io.NATIVE_CHUNK // dt.itemsize + 3)) * 50).astype(dt),
         "row": (rng.standard_normal(13) * 50).astype(dt)}
    specs = [(n, a.shape, dt) for n, a in x.items()] + [("cast", (37, 21), np.float32)]
    out = {}
    for tag, native in (("native", True), ("numpy", False)):
        w = PlannedWriter(tmp_path / tag, specs, shard_bytes=1 << 20, use_native=native)
        for g in (0, 1, 2, 4, 3):
            w.add("t", np.ascontiguousarray(x["t"][g].T).T, (g,))
        w.add("wide", np.ascontiguousarray(x["wide"].T).T)
        for g in (1, 0):
            w.add("big", x["big"][g], (g,))
        w.add("row", x["row"])
        w.add("cast", np.ascontiguousarray(x["t"][0].astype(np.float16).T).T)
        index = w.close()
        out[tag] = {}
        for f in sorted(set(index["weight_map"].values())):
            out[tag].update(safetensors.numpy.load_file(tmp_path / tag / f))
        for n, a in x.items():
            np.testing.assert_array_equal(out[tag][n], a)
        np.testing.assert_array_equal(out[tag]["cast"], x["t"][0].astype(np.float16).astype(np.float32))
    _same_files(tmp_path / "native", tmp_path / "numpy")


def test_native_writer_drops_mapped_pages_and_views_still_read_right(tmp_path, monkeypatch):
    """Blocks that are views of a ShardedReader mapping (the kernel reads them with pread, copy_file_range, or
    through their pages, which it maps and drops) are written right, and the views read the file's values
    afterwards; arrays in memory are never dropped."""
    if safetensors_io.native() is None:
        pytest.fail(f"{safetensors_io.LIB} not built")
    monkeypatch.setattr(safetensors_io, "SPLIT", 1 << 20)  # wbig in strips read through their pages
    rng = np.random.default_rng(2)
    tensors = {f"w{i}": rng.standard_normal((300 + i, 70)).astype(np.float32) for i in range(4)}  # read with pread
    tensors["wbig"] = rng.standard_normal((1100, 1001)).astype(np.float32)  # > SOURCE_CHUNK: read through its pages
    tensors["big"] = rng.standard_normal((3, 400_000)).astype(np.float32)  # > the kernel's 4 MB window
    w = ShardedWriter(tmp_path / "src", shard_bytes=1 << 30)
    for n, a in tensors.items():
        w.add(n, a)
    w.close()
    r = ShardedReader(tmp_path / "src")
    r.map_pages = False
    views = {n: r.read(n, copy=False) for n in tensors}
    assert all(safetensors_io._source(v) is not None and safetensors_io._source(v.T) for v in views.values())
    assert safetensors_io._source(np.array(views["w0"])) is None
    mem = rng.standard_normal((64, 64)).astype(np.float32)
    keep = mem.copy()
    specs = [(n, a.shape[::-1] if n != "big" else a.shape, a.dtype) for n, a in tensors.items()] + [
        ("mem", mem.shape, mem.dtype)]
    pw = PlannedWriter(tmp_path / "dst", specs, use_native=True)
    for n, v in views.items():
        pw.add(n, v.T if n != "big" else v)
    pw.add("mem", mem.T.copy().T)
    index = pw.close()
    got = safetensors.numpy.load_file(tmp_path / "dst" / index["weight_map"]["w0"])
    for n, a in tensors.items():
        np.testing.assert_array_equal(got[n], a.T if n != "big" else a)
        np.testing.assert_array_equal(views[n], a)
    np.testing.assert_array_equal(mem, keep)


def test_a_shard_that_cannot_be_sized_leaves_no_files(tmp_path, monkeypatch):
    """PlannedWriter sizes every shard up front; when the file system refuses one (a full disk, a file-size limit),
    the error goes on and no shard, whole or empty, is left in the directory, nor an open descriptor."""
    real, calls = os.ftruncate, []

    def refuse_second(fd, size):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd, size)

    monkeypatch.setattr(os, "ftruncate", refuse_second)
    specs = [(f"t{i}", (64,), np.float32) for i in range(3)]
    with pytest.raises(OSError, match="No space left"):
        PlannedWriter(tmp_path / "out", specs, shard_bytes=256)
    assert list((tmp_path / "out").iterdir()) == []
    for fd in calls:
        with pytest.raises(OSError):
            os.fstat(fd)
