"""GPT sample index: sample-for-sample parity with fixtures made by Megatron-LM's own code
(testdata/megatron, see its README), a naive reference, caching and bad input."""

import errno
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ling2 import native
from ling2.data import gather, index_cache
from ling2.data import gpt_index as G
from ling2.data.errors import DataError
from ling2.data.indexed import IndexedDataset, write_dataset

FIX = Path(__file__).resolve().parent / "testdata" / "megatron"
META = json.loads((FIX / "cases.json").read_text())
CASES = [(c, s) for c in META["gpt_cases"] for s in c["splits"]]
NAMES = ("document_index", "sample_index", "shuffle_index")


def restamp(cache_dir):
    """Records the current size and CRC-32 of every cached `.npy` in its set's description, as if the
    files had been written so: tests of what loading checks beyond the checksums."""
    for desc in Path(cache_dir).glob("*-description.txt"):
        d, base = json.loads(desc.read_text()), str(desc)[:-len("-description.txt")]
        for k in d[index_cache.FILES]:
            npy = index_cache.npy_path(base, k)
            d[index_cache.FILES][k] = {"bytes": os.path.getsize(npy), "crc32": index_cache.crc32(npy)}
        desc.write_text(json.dumps(d))


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


@pytest.mark.parametrize("split, message", [("98,2,x", "not a list of numbers"), ("0,0,0", "the parts sum to 0"),
                                            ("-1,2,0", "need 1 to 3 non-negative"), ("nan,1,1", "need 1 to 3"),
                                            ("1,2,3,4", "need 1 to 3"), ("1e308,1e308,0", "the parts sum past the largest float")])
def test_bad_split_strings_are_named(split, message):
    with pytest.raises(ValueError, match=rf"data_split '{split}': {message}"):
        G.parse_split(split)


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


def test_a_cache_dir_on_a_full_disk_is_named_and_left_clean(tmp_path, monkeypatch):
    """np.save into a full disk writes part of the file, then ENOSPC: the DataError names the index file, and no
    temporary file is left behind."""
    def full_disk_save(path, arr, allow_pickle):
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(index_cache.np, "save", full_disk_save)
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    with pytest.raises(DataError, match=rf"{tmp_path}/\w+-GPTDataset-train-document_index\.npy: writing the index "
                                        r"cache \(blend_cache_dir\) failed: disk full"):
        _gpt(c, "train", cache_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def _truncate(path, keep=0.5):
    os.truncate(path, int(os.path.getsize(path) * keep))


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncated", "changed", "no records", "unreadable description"])
def test_damaged_cache_is_rebuilt_with_one_warning(tmp_path, caplog, damage):
    """A cached index set is verified on load against the size and CRC-32 its description records;
    a damaged one (here its sample index) is rebuilt, with one warning line naming it (a truncated
    one used to fail in numpy with "mmap length is greater than file size", naming no file)."""
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    first = _gpt(c, "train", cache_dir=str(tmp_path))
    (desc,) = tmp_path.glob("*-description.txt")
    assert set(json.loads(desc.read_text())[index_cache.FILES]) == set(NAMES)
    (f,) = tmp_path.glob("*-sample_index.npy")
    if damage == "truncated":
        _truncate(f)
    elif damage == "changed":
        _flip_last_byte(f)
    elif damage == "no records":  # a set written before sizes and checksums were recorded
        desc.write_text(first.description)
    else:
        _truncate(desc)
    caplog.clear()
    again = _gpt(c, "train", cache_dir=str(tmp_path))
    assert again.source == "built"
    (rec,) = [r for r in caplog.records if r.levelname == "WARNING"]
    name = desc.name if damage in ("no records", "unreadable description") else f.name
    assert name in rec.getMessage() and "rebuilding the damaged cached indices" in rec.getMessage()
    for k in NAMES:
        np.testing.assert_array_equal(getattr(first, k), getattr(again, k))
    caplog.clear()
    assert _gpt(c, "train", cache_dir=str(tmp_path)).source == "cache"  # rewritten whole
    assert not caplog.records and len(list(tmp_path.iterdir())) == 4


def test_damaged_set_of_ours_in_an_index_dir_that_is_the_cache_is_rebuilt(tmp_path, caplog):
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    d = str(tmp_path)
    _gpt(c, "train", cache_dir=d, index_dir=d)
    (f,) = tmp_path.glob("*-document_index.npy")
    _truncate(f)
    caplog.clear()
    assert _gpt(c, "train", cache_dir=d, index_dir=d).source == "built"
    assert [f.name in r.getMessage() for r in caplog.records] == [True]
    assert _gpt(c, "train", cache_dir=d, index_dir=d).source == "megatron"  # found by its description


def test_unfinished_cache_set_is_built_quietly(tmp_path, caplog):
    """The description is written last: index files without it are an unfinished write, not damage."""
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    _gpt(c, "train", cache_dir=str(tmp_path))
    (desc,) = tmp_path.glob("*-description.txt")
    desc.unlink()
    caplog.clear()
    assert _gpt(c, "train", cache_dir=str(tmp_path)).source == "built" and not caplog.records
    assert desc.is_file()


@pytest.mark.parametrize("whose", ["megatron", "ours"])
def test_damaged_prebuilt_indices_are_a_named_error(tmp_path, whose):
    """blend_index_dir holds prebuilt indices, not ours to rebuild: a truncated file is a DataError
    naming it (Megatron's sets record no checksums: they are checked to load whole); a set of ours
    there is checked against its records."""
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    index_dir = tmp_path / "prebuilt"
    if whose == "megatron":
        shutil.copytree(FIX / "megatron_cache", index_dir)
    else:
        _gpt(c, "train", cache_dir=str(index_dir))
    (f,) = index_dir.glob("*-GPTDataset-train-shuffle_index.npy")
    _truncate(f)
    with pytest.raises(DataError, match=re.escape(str(f)) + r": (not a whole \.npy file of \d+ bytes "
                                        r"\(mmap length is greater than file size\)|\d+ bytes, \d+ when written)"
                                        r".*blend_index_dir are damaged"):
        _gpt(c, "train", index_dir=str(index_dir), cache_dir=str(tmp_path / "cache"))
    if whose == "ours":  # whole again, then one byte changed
        _gpt(c, "train", cache_dir=str(tmp_path / "fresh"))
        (good,) = (tmp_path / "fresh").glob("*-shuffle_index.npy")
        shutil.copyfile(good, f)
        _flip_last_byte(f)
        with pytest.raises(DataError, match=re.escape(str(f)) + ": checksum mismatch"):
            _gpt(c, "train", index_dir=str(index_dir))


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
    restamp(tmp_path / "c")
    with pytest.raises(ValueError, match=r"d: sample 0 reads tokens \[0, 6\) of sequence "
                                         r"\d of length \d: the sample index does not fit"):
        G.GPTDataset(ds, "train", "1,0,0", 2, cache_dir=str(tmp_path / "c"))  # checked on load
    bad[1] = (-1, 0)
    np.save(f, bad)
    restamp(tmp_path / "c")
    with pytest.raises(ValueError, match=r"sample_index.npy: position outside the document "
                                         r"index \[0, 3\)"):
        G.GPTDataset(ds, "train", "1,0,0", 2, cache_dir=str(tmp_path / "c"))


SEM = json.loads((FIX / "semantics.json").read_text())


def _bad_ids_dataset(tmp_path, dtype=np.int32):
    """Three one-sequence documents; sequence 1 holds an id at token offset 3."""
    docs = [[[5, 6, 7, 8, 9]], [[10, 11, 12, 0, 14, 15]], [[16, 17, 18, 19]]]
    write_dataset(str(tmp_path / "bad"), docs, dtype=dtype)
    return IndexedDataset(str(tmp_path / "bad"))


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("bad,dtype", [(-1, np.int32), (20, np.int32), (20, np.uint16),
                                       (-1, np.int8)])
def test_token_ids_outside_the_vocabulary_are_named(tmp_path, monkeypatch, native, bad, dtype):
    """Hand-made case: an id outside [0, vocab_size) (-1 would wrap to row V-1 in the
    embedding; >= V gives NaN) is a DataError naming the .bin, sequence, offset, id and
    vocab_size, on every read path."""
    if not native:
        monkeypatch.setattr(gather, "native", lambda: None)
    docs = [[[5, 6, 7, 8, 9]], [[10, 11, 12, 13, 14, 15]], [[16, 17, 18, 19]]]
    write_dataset(str(tmp_path / "bad"), docs, dtype=dtype)
    raw = np.memmap(str(tmp_path / "bad.bin"), dtype=dtype, mode="r+")
    raw[5 + 3] = bad  # sequence 1, token offset 3
    raw.flush()
    del raw
    ds = IndexedDataset(str(tmp_path / "bad"))
    g = G.GPTDataset(ds, "train", "1,0,0", 4, vocab_size=20)
    msg = (rf"bad\.bin: token id {bad} at sequence 1 \(document 1\), token offset 3 "
           rf"\(byte {8 * np.dtype(dtype).itemsize}\) is outside the vocabulary "
           rf"\[0, vocab_size=20\)")
    with pytest.raises(DataError, match=msg):
        g.samples(np.arange(len(g)))
    with pytest.raises(DataError, match=msg):
        for i in range(len(g)):
            g[i]
    unchecked = G.GPTDataset(ds, "train", "1,0,0", 4).samples(np.arange(len(g)))
    assert (unchecked == bad).any()  # read unchecked without a vocab_size
    if dtype == np.uint16:  # every uint16 id fits a vocabulary of 65536
        G.GPTDataset(ds, "train", "1,0,0", 4, vocab_size=65536).samples(np.arange(len(g)))


@pytest.mark.parametrize("case", SEM["float32_cases"], ids=lambda c: c["name"])
def test_keep_partial_count_is_megatrons_float32_by_default(case):
    """Reference: Megatron-LM's helpers.cpp build_sample_idx (fixtures float32_*, see the
    README): past 2^24 tokens its keep-partial sample count, ceil(float(T - add) / S) in float32,
    is one short (the partial sample dropped) or one over (an extra sample of the stream's last
    token, from a -DNDEBUG build as pip installs it). That is the default; exact_sample_count
    gives the integer ceil."""
    sizes = np.array(case["sizes"], np.int32)
    doc = np.array(case["document_index"], np.int32)
    S, total = case["seq_length"], int(sizes.sum())
    want = np.load(FIX / f"{case['name']}-sample_index.npy")
    got = G.build_sample_index(sizes, doc, S, 1, total, drop_last=False, add=1)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32
    assert G.sample_count(total, S, 1, drop_last=False) == case["megatron_num_samples"]
    exact = G.build_sample_index(sizes, doc, S, 1, total, drop_last=False, add=1, exact=True)
    assert exact.shape[0] - 1 == case["exact_num_samples"] != case["megatron_num_samples"]
    n = min(exact.shape[0], want.shape[0]) - 1  # the full samples agree
    np.testing.assert_array_equal(exact[:n], want[:n])
    # the exact index ends at the stream end: (last entry, its length - 1)
    np.testing.assert_array_equal(exact[-1], [3, sizes[0] - 1])


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("case", SEM["float32_cases"], ids=lambda c: c["name"])
def test_float32_and_exact_counts_through_the_reader(tmp_path, monkeypatch, native, case):
    """The same cases as a dataset (uint8 zeros): Megatron's count by default, the exact one
    with exact_sample_count; every sample reads, the short ones pad-filled past their length."""
    if not native:
        monkeypatch.setattr(gather, "native", lambda: None)
    write_dataset(str(tmp_path / "big"), [[np.zeros(n, np.uint8)] for n in case["sizes"]],
                  dtype=np.uint8)
    ds = IndexedDataset(str(tmp_path / "big"))
    S = case["seq_length"]
    for exact, n in ((False, case["megatron_num_samples"]), (True, case["exact_num_samples"])):
        g = G.GPTDataset(ds, "valid", "0,1,0", S, drop_last=False, exact_sample_count=exact,
                         pad_id=-7, vocab_size=10)
        assert len(g) == n
        tokens, lengths = g.read(np.arange(n))
        full = (sum(case["sizes"]) - 1) // S
        assert (lengths == np.where(g.shuffle_index < full, S + 1, lengths)).all()
        assert ((tokens == -7) == (np.arange(S + 1) >= lengths[:, None])).all()
        assert (lengths < S + 1).sum() == max(0, n - full)


def _megatron_dir(tmp_path):
    index_dir = tmp_path / "megatron"
    shutil.copytree(FIX / "megatron_cache", index_dir)
    return str(index_dir)


@pytest.mark.parametrize("change,field", [
    (dict(data_split="969,30,1"), r"split: requested '969,30,1' \(train = sequences \[0, \d+\)\), "
                                  r"found '80,15,5' \(sequences \[0, \d+\)\)"),
    (dict(seed=7), "random_seed: requested 7, found 1234"),
    (dict(seq_length=32), "sequence_length: requested 32, found 16"),
    (dict(num_samples=300), "num_samples: requested 300, found 200"),
])
def test_prebuilt_indices_for_another_request_are_refused(tmp_path, change, field):
    """Megatron's own cache (fixture megatron_cache: docs_u16, split 80,15,5, seq 16, seed
    1234, 200 train samples): a request differing in any field the indices depend on is a
    DataError naming that field, requested vs found (it used to load them regardless of the
    split)."""
    kw = dict(data_split="80,15,5", seq_length=16, num_samples=200, seed=1234)
    kw.update(change)
    ds = IndexedDataset(str(FIX / "docs_u16"))
    with pytest.raises(DataError, match=field):
        G.GPTDataset(ds, "train", kw["data_split"], kw["seq_length"], kw["num_samples"],
                     kw["seed"], index_dir=_megatron_dir(tmp_path))


def test_prebuilt_indices_for_another_drop_last_are_refused(tmp_path):
    """Megatron's description has no drop-last field: the sample count tells (fixture
    megatron_cache, valid split built with drop-last)."""
    ds = IndexedDataset(str(FIX / "docs_u16"))
    index_dir = _megatron_dir(tmp_path)
    g = G.GPTDataset(ds, "valid", "80,15,5", 16, 20, index_dir=index_dir)
    assert g.source == "megatron"
    with pytest.raises(DataError, match=r"this request \(num_samples=20, add_extra_token=True, "
                                        r"drop_last=False, exact_sample_count=False\) makes"):
        G.GPTDataset(ds, "valid", "80,15,5", 16, 20, drop_last=False, index_dir=index_dir)
    # Read without the extra token, the same index gives exactly the samples built for that
    # request (the stream slices and the shuffle agree when the counts do): accepted.
    loaded = G.GPTDataset(ds, "valid", "80,15,5", 16, 20, add_extra_token=False,
                          index_dir=index_dir)
    built = G.GPTDataset(ds, "valid", "80,15,5", 16, 20, add_extra_token=False)
    assert loaded.source == "megatron" and len(loaded) == len(built)
    np.testing.assert_array_equal(loaded.samples(np.arange(len(built))),
                                  built.samples(np.arange(len(built))))


def test_our_cache_is_int32_as_megatrons(tmp_path):
    """Our cached index files take Megatron's bytes (int32; its shuffle index is uint32), for
    the multi_epoch fixture case, and still read int64 files."""
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    g = _gpt(c, "train", cache_dir=str(tmp_path / "c"))
    for k in NAMES:
        (ours,) = (tmp_path / "c").glob(f"*-{k}.npy")
        (theirs,) = (FIX / "megatron_cache").glob(f"*-GPTDataset-train-{k}.npy")
        assert np.load(ours).dtype == np.int32, k
        assert ours.stat().st_size == theirs.stat().st_size, k
        np.save(ours, np.load(ours).astype(np.int64))
    restamp(tmp_path / "c")
    again = _gpt(c, "train", cache_dir=str(tmp_path / "c"))
    assert again.source == "cache" and again.sample_index.dtype == np.int64
    np.testing.assert_array_equal(again.samples(np.arange(len(g))), g.samples(np.arange(len(g))))


def test_split_too_small_for_one_sample(tmp_path):
    """Hand-made: 9 tokens cannot make a sample of 16 + 1; Megatron would tile the same 9
    tokens into every sample. A DataError naming the dataset and split instead."""
    write_dataset(str(tmp_path / "tiny"), [[[5, 6, 7, 8, 9, 2]], [[10, 11, 2]]], dtype=np.uint16)
    ds = IndexedDataset(str(tmp_path / "tiny"))
    with pytest.raises(DataError, match=r"tiny \(train split, sequences \[0, 2\)\): the split "
                                        r"has 9 tokens, too few for one sample of sequence "
                                        r"length 16 \(\+1 extra token\)"):
        G.GPTDataset(ds, "train", "1,0,0", 16, num_samples=20)


def test_index_dir_that_is_also_the_cache_is_not_strict(tmp_path):
    """blend_index_dir == blend_cache_dir: indices cached for an earlier request (another
    sample count) are not an error there; a new set is built and cached beside them."""
    c = next(c for c in META["gpt_cases"] if c["name"] == "multi_epoch")
    d = str(tmp_path / "c")
    assert _gpt(c, "train", cache_dir=d, index_dir=d).source == "built"
    ds = IndexedDataset(str(FIX / c["dataset"]))
    more = G.GPTDataset(ds, "train", c["split"], c["seq_length"], 300, c["seed"],
                        cache_dir=d, index_dir=d)
    assert more.source == "built" and len(more) >= 300
    with pytest.raises(DataError, match="num_samples: requested 400, found [23]00"):
        G.GPTDataset(ds, "train", c["split"], c["seq_length"], 400, c["seed"], index_dir=d,
                     cache_dir=str(tmp_path / "other"))


def test_a_sample_count_beyond_the_hosts_memory_is_named_before_building(monkeypatch):
    """Asking for more samples than the index arrays can hold in memory (steps=1e11) is a DataError naming the
    split, the samples, the epochs and the sizes, raised before any array is allocated; the bound is the
    arrays' smallest size (int32 everywhere), so a run that fits is never refused: with the host's memory
    just above that bound the same request builds past the check (it then fails on allocating, patched here)."""
    c = CASES[0][0]
    ds = IndexedDataset(str(FIX / c["dataset"]))
    lengths = ds.sequence_lengths
    n = 10**11
    tokens = int(lengths.sum(dtype=np.int64))
    epochs = G.num_epochs(tokens, n, c["seq_length"], 1)
    least = 4 * (epochs * len(lengths) + 2 * (n + 1) + n)  # by hand: int32 document, sample, shuffle indices
    page = os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(DataError, match=rf"{n} samples take {epochs} epochs over the split, index arrays of at "
                                        rf"least {least / 2**30:.1f} GiB, more than this host's"):
        G.GPTDataset(ds, "train", "1,0,0", c["seq_length"], n, 1234, True)
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda k: -(-least // page) if k == "SC_PHYS_PAGES" else real(k))
    monkeypatch.setattr(G, "build_document_index", lambda *a: (_ for _ in ()).throw(MemoryError("past the check")))
    with pytest.raises(MemoryError, match="past the check"):
        G.GPTDataset(ds, "train", "1,0,0", c["seq_length"], n, 1234, True)
