"""Blending: parity with Megatron-LM fixtures (2 and 3 datasets), a naive greedy reference,
Megatron's prebuilt index files, data_path parsing and bad input."""

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ling2.data import blend as B
from ling2.data.errors import DataError
from ling2.data.gpt_index import SPLITS
from ling2.data.indexed import write_dataset

FIX = Path(__file__).resolve().parent / "testdata" / "megatron"
META = json.loads((FIX / "cases.json").read_text())
BLENDS = {c["name"]: c for c in META["blend_cases"]}


def _build(c, **kw):
    path = " ".join(f"{w} {FIX / p}" for w, p in zip(c["weights"], c["datasets"]))
    return B.build_splits(path, c["split"], c["seq_length"], c["sizes"], c["seed"], **kw)


def _check(c, out):
    for split, sp in c["splits"].items():
        b = out[SPLITS.index(split)]
        assert len(b) == sp["length"] == sp["size"]
        for k in ("dataset_index", "dataset_sample_index"):
            np.testing.assert_array_equal(getattr(b, k), np.load(FIX / f"{sp['case']}-{k}.npy"))
        for comp, d in zip(sp["components"], b.datasets):
            assert d.num_samples == comp["num_samples"] and len(d) == comp["length"]
            for k in ("document_index", "sample_index", "shuffle_index"):
                np.testing.assert_array_equal(getattr(d, k),
                                              np.load(FIX / f"{comp['case']}-{k}.npy"))
        want = np.load(FIX / f"{sp['case']}-tokens.npy")  # Megatron's tokens = text[:-1]
        np.testing.assert_array_equal(np.stack([b[i][:-1] for i in range(len(b))]), want)
        order = np.random.default_rng(0).permutation(len(b))
        np.testing.assert_array_equal(b.samples(order)[:, :-1], want[order])


@pytest.mark.parametrize("name", sorted(BLENDS))
def test_megatron_parity(name):
    _check(BLENDS[name], _build(BLENDS[name]))


def test_loads_megatron_prebuilt_blend(tmp_path):
    c = BLENDS["blend2"]
    shutil.copytree(FIX / "megatron_cache_blend2", tmp_path / "m")
    out = _build(c, index_dir=str(tmp_path / "m"))
    assert out[0].source == "megatron" and all(d.source == "megatron" for d in out[0].datasets)
    _check(c, out)


def test_cache_round_trip(tmp_path):
    c = BLENDS["blend3"]
    first = _build(c, cache_dir=str(tmp_path))[0]
    again = _build(c, cache_dir=str(tmp_path))[0]
    assert (first.source, again.source) == ("built", "cache")
    assert sorted(p.name.split("-", 1)[1] for p in tmp_path.glob("*Blended*")) == [
        "BlendedDataset-train-dataset_index.npy", "BlendedDataset-train-dataset_sample_index.npy",
        "BlendedDataset-train-description.txt"]
    np.testing.assert_array_equal(first.dataset_index, again.dataset_index)


def test_damaged_cached_blend_is_rebuilt_with_one_warning(tmp_path, caplog):
    """A truncated cached blend index is rebuilt after one warning line naming it (numpy's "mmap length is
    greater than file size", naming no file, before)."""
    c = BLENDS["blend3"]
    first = _build(c, cache_dir=str(tmp_path))[0]
    (f,) = tmp_path.glob("*-BlendedDataset-train-dataset_index.npy")
    os.truncate(f, os.path.getsize(f) // 2)
    caplog.clear()
    again = _build(c, cache_dir=str(tmp_path))[0]
    assert again.source == "built" and all(d.source == "cache" for d in again.datasets)
    (rec,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert f.name in rec.getMessage() and "rebuilding" in rec.getMessage()
    np.testing.assert_array_equal(first.dataset_index, again.dataset_index)
    assert _build(c, cache_dir=str(tmp_path))[0].source == "cache"


def test_damaged_prebuilt_blend_is_a_named_error(tmp_path):
    """Megatron's prebuilt blend indices (blend_index_dir), one truncated: a DataError naming the file."""
    c = BLENDS["blend2"]
    shutil.copytree(FIX / "megatron_cache_blend2", tmp_path / "m")
    (f,) = (tmp_path / "m").glob("*-BlendedDataset-train-dataset_sample_index.npy")
    os.truncate(f, os.path.getsize(f) - 8)
    with pytest.raises(DataError, match=re.escape(str(f)) + r": not a whole \.npy file .*blend_index_dir are damaged"):
        _build(c, index_dir=str(tmp_path / "m"), cache_dir=str(tmp_path / "cache"))


def _naive_greedy(weights, size):
    counts = [0] * len(weights)
    picks = []
    for s in range(size):
        errs = [w * max(s, 1) - c for w, c in zip(weights, counts)]
        k = errs.index(max(errs))  # first maximum
        picks.append((k, counts[k]))
        counts[k] += 1
    return picks


def test_greedy_matches_naive_and_weights():
    w = B.normalize([0.2, 0.5, 0.3])
    di, dsi = B.build_blending_indices(w, 1000)
    assert list(zip(di.tolist(), dsi.tolist())) == _naive_greedy(w, 1000)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    np.testing.assert_allclose(np.bincount(di) / 1000, w, atol=2e-3)


def test_exhaustive_blend_uses_every_sample():
    di, dsi = B.build_exhaustive_blending_indices([3, 0, 5])
    assert sorted(zip(di.tolist(), dsi.tolist())) == [(0, i) for i in range(3)] + [
        (2, i) for i in range(5)]


def test_component_sizes_surplus_rule():
    target, built = B.component_sizes([0.3, 0.7], 1000)
    assert target == [300, 700]
    assert built == [math.ceil(300 * 1.005), math.ceil(700 * 1.005)] == [302, 704]


def test_unweighted_blends(tmp_path):
    for n in ("a", "b"):
        write_dataset(str(tmp_path / n), [[list(range(1, 30))]] * 4, dtype=np.uint16)
    path = f"{tmp_path / 'a'} {tmp_path / 'b'}"
    full = B.build_splits(path, "1,0,0", 8, [None, None, None])[0]
    assert len(full) == sum(len(d) for d in full.datasets)  # exhaustive
    capped = B.build_splits(path, "1,0,0", 8, [5, None, None])[0]
    assert len(capped) == 5
    single = B.build_splits(str(tmp_path / "a"), "1,0,0", 8, [5, None, None])[0]
    assert type(single).__name__ == "GPTDataset" and len(single) >= 5


def test_parse_data_path():
    assert B.parse_data_path("0.3 /a 0.7 /b") == (["/a", "/b"], [0.3, 0.7])
    assert B.parse_data_path("/a") == (["/a"], None)
    assert B.parse_data_path("/a /b") == (["/a", "/b"], None)
    with pytest.raises(ValueError, match=r"weight 1 \('-0.7'\) for /b must be > 0"):
        B.parse_data_path("0.3 /a -0.7 /b")
    with pytest.raises(ValueError, match=r"weight 0 \('0'\) for /a must be > 0"):
        B.parse_data_path("0 /a 1 /b")
    with pytest.raises(ValueError, match="mismatched"):
        B.parse_data_path("0.3 /a 0.7")
    with pytest.raises(ValueError, match="mismatched"):
        B.parse_data_path("0.3 /a /b")
    with pytest.raises(ValueError, match="data_path is empty"):
        B.parse_data_path("  ")


def test_a_prefix_given_twice_is_two_components_as_in_megatron():
    """Megatron-LM blends a prefix named twice as two datasets (each with its weight); its indices are the
    reference, so the blend is kept as written (ling2/infer/evaluation_test evaluates such a blend)."""
    assert B.parse_data_path("0.3 /d/a 0.7 /d/a") == (["/d/a", "/d/a"], [0.3, 0.7])


def test_weights_summing_past_the_float_range_are_named():
    with pytest.raises(ValueError, match="the weights sum past the largest float"):
        B.parse_data_path("1e308 /a 1e308 /b")


def test_missing_dataset_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.idx: no such file"):
        B.build_splits(f"0.5 {FIX / 'blend_a'} 0.5 {tmp_path / 'nope'}", "1,0,0", 8,
                       [10, None, None])


def test_weights_need_size():
    with pytest.raises(ValueError, match="needs a sample count for the train split"):
        B.build_splits(f"0.5 {FIX / 'blend_a'} 0.5 {FIX / 'blend_b'}", "1,0,0", 8,
                       [None, None, None])


SEM = json.loads((FIX / "semantics.json").read_text())


def test_blend_per_split_megatron_parity():
    """Reference: Megatron-LM's BlendedMegatronDatasetBuilder with blend_per_split (fixture
    per_split-*, see the README): train a weighted 2-way blend, valid an unweighted one, test a
    single prefix with a weight (a plain GPTDataset); each over whole datasets."""
    (c,) = SEM["per_split_cases"]
    per_split = [" ".join(str(FIX / t) if t.startswith("blend_") else t for t in p.split())
                 for p in c["blend_per_split"]]
    out = B.build_splits("", "969,30,1", c["seq_length"], c["sizes"], c["seed"],
                         blend_per_split=per_split)
    for split, sp in c["splits"].items():
        got, want = out[SPLITS.index(split)], np.load(FIX / f"{sp['case']}.npz")
        assert type(got).__name__ == sp["class"] and len(got) == sp["length"]
        names = (("dataset_index", "dataset_sample_index") if sp["class"] == "BlendedDataset"
                 else ("document_index", "sample_index", "shuffle_index"))
        for k in names:
            np.testing.assert_array_equal(getattr(got, k), want[k], err_msg=f"{split} {k}")
        np.testing.assert_array_equal(got.samples(np.arange(len(got)))[:, :-1], want["tokens"])
    with pytest.raises(ValueError, match="want 3 entries"):
        B.build_splits("", "1,0,0", 8, [5, 5, 5], blend_per_split=per_split[:2])
    empty = B.build_splits("", "1,0,0", 8, [5, 5, 5], blend_per_split=[per_split[0], "", ""])
    assert empty[1] is None and empty[2] is None


def test_prebuilt_blend_for_other_weights_is_refused(tmp_path):
    """Megatron's blend2 cache (weights 0.3, 0.7; size 120): other weights are a DataError
    naming them, requested vs found; through build_splits the components are refused first
    (they were built for other sample counts)."""
    c = BLENDS["blend2"]
    shutil.copytree(FIX / "megatron_cache_blend2", tmp_path / "m")
    path = " ".join(f"{w} {FIX / p}" for w, p in zip([0.4, 0.6], c["datasets"]))
    parts = B.build_splits(path, c["split"], c["seq_length"], c["sizes"], c["seed"])[0].datasets
    with pytest.raises(DataError, match=r"weights: requested \[0\.4, 0\.6\], found \[0\.3, 0\.7\]"):
        B.BlendedDataset(parts, [0.4, 0.6], 120, "train", index_dir=str(tmp_path / "m"))
    with pytest.raises(DataError, match=r"num_samples: requested \d+, found \d+"):
        B.build_splits(path, c["split"], c["seq_length"], c["sizes"], c["seed"],
                       index_dir=str(tmp_path / "m"))
