"""GPT sample index: sample-for-sample parity with fixtures made by Megatron-LM's own code
(testdata/megatron, see its README), a naive reference, caching and bad input."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ling2 import native
from ling2.data import gather
from ling2.data import gpt_index as G
from ling2.data.indexed import IndexedDataset, write_dataset

FIX = Path(__file__).resolve().parent / "testdata" / "megatron"
META = json.loads((FIX / "cases.json").read_text())
CASES = [(c, s) for c in META["gpt_cases"] for s in c["splits"]]
NAMES = ("document_index", "sample_index", "shuffle_index")


def _gpt(c, split, **kw):
    ds = IndexedDataset(str(FIX / c["dataset"]))
    return G.GPTDataset(ds, split, c["split"], c["seq_length"], c["splits"][split]["num_samples"],
                        c["seed"], c["add_extra_token"],
                        drop_last=split != "valid" or c["drop_last_valid"], pad_id=999, **kw)


@pytest.mark.parametrize("case,split", CASES, ids=[f"{c['name']}-{s}" for c, s in CASES])
def test_megatron_parity(case, split):
    g = _gpt(case, split)
    name = case["splits"][split]["case"]
    for k in NAMES:
        np.testing.assert_array_equal(getattr(g, k), np.load(FIX / f"{name}-{k}.npy"), err_msg=k)
    want = np.load(FIX / f"{name}-samples.npy")
    np.testing.assert_array_equal(np.stack([g[i] for i in range(len(g))]), want)
    order = np.random.default_rng(0).permutation(len(g))
    np.testing.assert_array_equal(g.samples(order), want[order])  # the batched reader


def test_fixture_cases_cover_epoch_modes():
    """The fixtures include one epoch, several epochs, and a separately shuffled last epoch."""
    by = {c["name"]: c for c in META["gpt_cases"]}

    def parts(name):
        g = _gpt(by[name], "train")
        n_seq = np.unique(g.document_index).size
        epochs = g.document_index.size // n_seq
        T = int(g.dataset.sequence_lengths[np.unique(g.document_index)].sum())
        sans = ((epochs - 1) * T - g.add) // g.seq_length
        head_is_own_perm = set(g.shuffle_index[:sans].tolist()) == set(range(sans))
        last = g.document_index[-n_seq:]
        return epochs, head_is_own_perm, sorted(last) == sorted(np.unique(g.document_index))

    assert parts("one_epoch")[0] == 1
    epochs, own, _ = parts("multi_epoch")
    assert epochs > 1 and not own
    epochs, own, last_is_epoch = parts("separate_last_epoch")
    assert epochs > 1 and own and last_is_epoch


def _naive_sample_index(lengths, doc_index, S, add, drop_last=True):
    """Walk the token stream one token at a time: record (entry, offset) at every j*S."""
    stream = [(k, o) for k, d in enumerate(doc_index) for o in range(lengths[d])]
    total = len(stream)
    n = (total - add) // S if drop_last else -(-(total - add) // S)
    rows = [(0, 0)]
    for j in range(1, n + 1):
        q = min(j * S, total - add)
        k, _ = stream[q + add - 1]
        start = next(i for i, (kk, _) in enumerate(stream) if kk == k)
        rows.append((k, q - start))
    return np.array(rows, np.int64)


@pytest.mark.parametrize("add", [0, 1])
@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_sample_index_matches_naive_stream(add, chunk, monkeypatch):
    monkeypatch.setattr(G, "_CHUNK", chunk)
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=30).astype(np.int32)
    lengths[[0, 5, 29]] = 0
    doc = np.random.RandomState(1).permutation(np.tile(np.arange(30), 2))
    T = int(lengths.sum())
    for S in (1, 2, 5, 7, 16):
        got = G.build_sample_index(lengths, doc, S, 2, T, True, add)
        np.testing.assert_array_equal(got, _naive_sample_index(lengths, doc, S, add))
    # keep-partial: the last sample ends at the stream end (last non-empty entry)
    got = G.build_sample_index(lengths, doc, 7, 2, T, False, add)
    np.testing.assert_array_equal(got, _naive_sample_index(lengths, doc, 7, add, False))


def test_split_ranges_use_round_half_even():
    assert G.parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert G.split_range(10, "25,25,50", "train") == (0, 2)   # round(2.5) == 2
    assert G.split_range(10, "25,25,50", "valid") == (2, 5)
    assert G.split_range(10, "1,0,0", "valid") == (0, 0)
    with pytest.raises(ValueError, match="data_split 'a,b'"):
        G.parse_split("a,b")


def test_cache_round_trip(tmp_path):
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    first = _gpt(c, "train", cache_dir=str(tmp_path))
    assert first.source == "built"
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 4 and all("-GPTDataset-train-" in f for f in files)
    again = _gpt(c, "train", cache_dir=str(tmp_path))
    assert again.source == "cache"
    for k in NAMES:
        np.testing.assert_array_equal(getattr(first, k), getattr(again, k))


def test_loads_megatron_prebuilt_npy(tmp_path):
    """blend_index_dir: Megatron's own cache files (matched by their description.txt)."""
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    index_dir = tmp_path / "megatron"
    shutil.copytree(FIX / "megatron_cache", index_dir)
    for f in index_dir.glob("*-document_index.npy"):  # make sure nothing is rebuilt
        np.save(f, np.load(f))
    for split in ("train", "valid", "test"):
        g = _gpt(c, split, index_dir=str(index_dir))
        assert g.source == "megatron", split
        want = np.load(FIX / f"{c['splits'][split]['case']}-samples.npy")
        np.testing.assert_array_equal(np.stack([g[i] for i in range(len(g))]), want)
        assert g.sample_index.dtype == np.int32  # Megatron's int32 indices, read in place
        np.testing.assert_array_equal(g.samples(np.arange(len(g))[::-1]), want[::-1])


def test_sequence_length_too_large(tmp_path):
    write_dataset(str(tmp_path / "s"), [[[1, 2, 3]], [[4, 5]]], dtype=np.uint16)
    ds = IndexedDataset(str(tmp_path / "s"))
    with pytest.raises(ValueError, match=r"s \(train split, sequences \[0, 2\)\): the split has "
                                         r"5 tokens, too few for one sample of sequence length 8"):
        G.GPTDataset(ds, "train", "1,0,0", seq_length=8)
    with pytest.raises(ValueError, match="has 0 tokens"):
        G.GPTDataset(ds, "valid", "99,1,0", seq_length=2, num_samples=3)


def test_many_epochs_from_tiny_data(tmp_path):
    write_dataset(str(tmp_path / "t"), [[[1, 2, 3]], [[4, 5]]], dtype=np.uint16)
    g = G.GPTDataset(IndexedDataset(str(tmp_path / "t")), "train", "1,0,0", seq_length=4,
                     num_samples=10)
    assert len(g) >= 10 and g.document_index.size == 2 * 9
    assert all(set(g[i].tolist()) <= {1, 2, 3, 4, 5} for i in range(len(g)))


def test_native_gather_is_built():
    """Under Bazel the C gather (gather.c) is in the runfiles and loads; a library that was not
    built gives None and a warning naming the target to build."""
    if "TEST_SRCDIR" in os.environ:
        assert gather.native() is not None
    with pytest.warns(UserWarning, match=r"bazel build //ling2/data:libnone\.so"):
        assert native.load(G.__file__, "libnone.so", lambda lib: None) is None


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("add,drop_last", [(1, True), (1, False), (0, False)])
def test_reader_matches_naive_stream(tmp_path, monkeypatch, native, dtype, add, drop_last):
    """Every read path, with the C gather and with the numpy fallback, equals pre-shuffle
    sample j = stream[j*S : j*S + S + add] of the concatenated sequences in document-index
    order, pad-filled at the stream end."""
    if not native:
        monkeypatch.setattr(gather, "native", lambda: None)
    rng = np.random.default_rng(3)
    docs = [[rng.integers(1, 250, size=rng.integers(0, 6)).tolist()
             for _ in range(rng.integers(1, 3))] for _ in range(60)]
    write_dataset(str(tmp_path / "d"), docs, dtype=dtype)
    ds = IndexedDataset(str(tmp_path / "d"))
    S = 7
    g = G.GPTDataset(ds, "train", "1,0,0", S, num_samples=40, seed=5, add_extra_token=add,
                     drop_last=drop_last, pad_id=-3)
    stream = [t for s in g.document_index for t in ds.get(int(s)).tolist()]
    want = np.full((len(g), S + add), -3, np.int64)
    for j in range(len(g)):
        got = stream[j * S: j * S + S + add]
        want[j, :len(got)] = got
    assert (want[-1] == -3).any() == (not drop_last)  # the fixture has a partial last sample
    np.testing.assert_array_equal(np.stack([g.sample(j) for j in range(len(g))]), want)
    np.testing.assert_array_equal(np.stack([g[i] for i in range(len(g))]), want[g.shuffle_index])
    ids = np.concatenate([np.random.default_rng(0).permutation(len(g)), [len(g) - 1] * 2,
                          np.flatnonzero(g.shuffle_index == len(g) - 1)])
    for out in (np.int32, np.int64):
        got = g.samples(ids, out)
        assert got.dtype == out and got.shape == (ids.size, S + add)
        np.testing.assert_array_equal(got, want[g.shuffle_index[ids]])
    assert g.samples([], np.int32).shape == (0, S + add)
    g.sample_index = np.array(g.sample_index)
    g.sample_index[3, 1] = 99  # corrupted after load: a read must refuse, not read past
    if native:
        with pytest.raises(ValueError, match=r"d: sample 2 reads tokens \[\d+, \d+\) of "):
            g.samples(np.flatnonzero(g.shuffle_index == 2))


def test_reader_rejects_an_index_that_does_not_fit(tmp_path):
    write_dataset(str(tmp_path / "d"), [[[1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]])
    ds = IndexedDataset(str(tmp_path / "d"))
    g = G.GPTDataset(ds, "train", "1,0,0", 2, cache_dir=str(tmp_path / "c"))
    with pytest.raises(IndexError, match=r"d: sample ids must be in \[0, 4\)"):
        g.sample(4)
    (f,) = (tmp_path / "c").glob("*-sample_index.npy")
    bad = np.array(g.sample_index)
    bad[1, 1] = 5  # offset 5 in a sequence of 3 or 4 tokens
    np.save(f, bad)
    with pytest.raises(ValueError, match=r"d: sample 0 reads tokens \[0, 6\) of sequence "
                                         r"\d of length \d: the sample index does not fit"):
        G.GPTDataset(ds, "train", "1,0,0", 2, cache_dir=str(tmp_path / "c"))  # checked on load
    bad[1] = (-1, 0)
    np.save(f, bad)
    with pytest.raises(ValueError, match=r"sample_index.npy: position outside the document "
                                         r"index \[0, 3\)"):
        G.GPTDataset(ds, "train", "1,0,0", 2, cache_dir=str(tmp_path / "c"))
