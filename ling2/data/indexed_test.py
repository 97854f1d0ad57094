"""Indexed dataset: round trip, exact bytes, Megatron byte parity, bad input."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from ling2.data import indexed as I
from ling2.data.errors import DataError

FIX = Path(__file__).resolve().parent / "testdata" / "megatron"


def _docs():
    return [[[5, 6, 7], [8]], [], [[9, 10]], [[]], [[11]]]


def test_round_trip_all_dtypes(tmp_path):
    for code in sorted(I.TOKEN_CODES):
        dt = I.DTYPES[code]
        prefix = str(tmp_path / f"d{code}")
        I.write_dataset(prefix, _docs(), dtype=dt)
        ds = I.IndexedDataset(prefix)
        assert ds.dtype == dt and not ds.multimodal
        assert len(ds) == 5 and ds.num_documents == 5
        assert ds.sequence_lengths.tolist() == [3, 1, 2, 0, 1]
        assert ds.document_indices.tolist() == [0, 2, 2, 3, 4, 5]
        assert ds.get(0).tolist() == [5, 6, 7]
        assert ds.get(0, 1, 2).tolist() == [6, 7]
        assert ds.get(2, 1).tolist() == [10]
        assert ds.document(0).tolist() == [5, 6, 7, 8]
        assert ds.document(1).size == 0 and ds.document(3).size == 0
        assert isinstance(ds.get(0).base, np.ndarray)  # a view, not a copy
        with pytest.raises(IndexError, match="sequence 0 of length 3"):
            ds.get(0, 2, 2)


def test_add_documents_bulk_equals_one_by_one(tmp_path):
    docs = [[1, 2, 3], [], [4], [5, 6]]
    a = I.IndexedDatasetBuilder(str(tmp_path / "a.bin"), dtype=np.uint16)
    a.add_documents(np.concatenate([np.array(d, np.int64) for d in docs]), [3, 0, 1, 2])
    a.finalize(str(tmp_path / "a.idx"))
    I.write_dataset(str(tmp_path / "b"), [[d] for d in docs], dtype=np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


def test_multimodal_round_trip(tmp_path):
    prefix = str(tmp_path / "mm")
    I.write_dataset(prefix, [[[1, 2], [3]], [[4]]], dtype=np.uint8, modes=[[0, 2], [1]])
    ds = I.IndexedDataset(prefix)
    assert ds.multimodal and ds.sequence_modes.tolist() == [0, 2, 1]
    assert ds.mode(1) == 2 and ds.get(2).tolist() == [4]


def test_exact_idx_bytes_hand_built(tmp_path):
    prefix = str(tmp_path / "h")
    I.write_dataset(prefix, [[[1, 2, 3], [4]], []], dtype=np.uint16)
    want = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8])
            + struct.pack("<QQ", 2, 3)             # 2 sequences, 3 document indices
            + struct.pack("<ii", 3, 1)            # lengths
            + struct.pack("<qq", 0, 6)            # byte pointers (uint16)
            + struct.pack("<qqq", 0, 2, 2))       # documents: [0,2), [2,2) empty
    assert Path(prefix + ".idx").read_bytes() == want
    assert Path(prefix + ".bin").read_bytes() == struct.pack("<4H", 1, 2, 3, 4)


def test_byte_identical_to_megatron_builder(tmp_path):
    meta = json.loads((FIX / "cases.json").read_text())
    for name, d in meta["datasets"].items():
        prefix = str(tmp_path / name)
        I.write_dataset(prefix, d["documents"], dtype=np.dtype(d["dtype"]), modes=d.get("modes"))
        for ext in (".idx", ".bin"):
            assert Path(prefix + ext).read_bytes() == (FIX / (name + ext)).read_bytes(), name + ext
        ours = I.IndexedDataset(str(FIX / name))
        flat = [s for doc in d["documents"] for s in doc]
        assert [ours.get(i).tolist() for i in range(len(ours))] == flat


def test_merge_matches_megatron_add_index(tmp_path):
    out = str(tmp_path / "merged")
    I.merge_datasets([str(FIX / "blend_a"), str(FIX / "blend_b")], out)
    for ext in (".idx", ".bin"):
        assert Path(out + ext).read_bytes() == (FIX / ("merged_ab" + ext)).read_bytes()


def test_pointers_past_2_31_bytes(tmp_path):
    """int64 byte arithmetic: a sparse .bin of 5 GiB, the last sequence past 2^32 bytes."""
    prefix = str(tmp_path / "big")
    n_tok = 5 * 2**30 // 4
    lengths = np.array([n_tok - 3, 3], np.int32)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(n_tok * 4 - 12)
        f.seek(n_tok * 4 - 12)
        f.write(np.array([7, 8, 9], np.int32).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(I.MAGIC + struct.pack("<QBQQ", 1, 4, 2, 2))
        f.write(lengths.tobytes() + np.array([0, (n_tok - 3) * 4], np.int64).tobytes())
        f.write(np.array([0, 2], np.int64).tobytes())
    ds = I.IndexedDataset(prefix)
    assert ds.sequence_pointers[1] > 2**32
    assert ds.get(1).tolist() == [7, 8, 9]
    assert ds.get(0, n_tok - 4, 1).tolist() == [0]
    assert ds.num_tokens == n_tok


def test_optimal_dtype():
    assert I.optimal_dtype(65499) == np.uint16
    assert I.optimal_dtype(65500) == np.int32 and I.optimal_dtype(157184) == np.int32


def test_writer_rejects_out_of_range_tokens(tmp_path):
    b = I.IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit uint16"):
        b.add_item([1, 70000])


# --- bad input: each names the file and the byte offset or field ---

@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "g")
    I.write_dataset(prefix, [[[1, 2, 3]], [[4, 5]]], dtype=np.int32)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_magic(good):
    _patch(good + ".idx", 0, b"XXXXXXXXX")
    with pytest.raises(I.DataFormatError, match=r"g\.idx: bad magic .* at byte 0"):
        I.IndexedDataset(good)


def test_bad_version(good):
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(I.DataFormatError, match=r"g\.idx: unsupported version 2 at byte 9"):
        I.IndexedDataset(good)


def test_bad_dtype_code(good):
    _patch(good + ".idx", 17, bytes([9]))
    with pytest.raises(I.DataFormatError, match=r"g\.idx: unknown dtype code 9 at byte 17"):
        I.IndexedDataset(good)


@pytest.mark.parametrize("code,name,written", [(7, "float32", np.int32), (6, "float64", np.int64)])
def test_float_dtype_code_is_not_a_token_file(tmp_path, code, name, written):
    """Megatron's codes 6 and 7 are floats: read as token ids they would be truncated values."""
    prefix = str(tmp_path / "f")
    I.write_dataset(prefix, [[[1, 2, 3]], [[4, 5]]], dtype=written)
    _patch(prefix + ".idx", 17, bytes([code]))
    with pytest.raises(I.DataFormatError, match=rf"f\.idx: dtype code {code} \({name}\) at byte 17 is "
                                                r"not an integer type; token files use codes \[1, 2, 3, 4, 5, 8\]"):
        I.IndexedDataset(prefix)
    with pytest.raises(ValueError, match=rf"x\.bin: unsupported token dtype {name}"):
        I.IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=name)


def test_truncated_idx(good):
    size = os.path.getsize(good + ".idx")
    os.truncate(good + ".idx", size - 4)
    with pytest.raises(I.DataFormatError, match=r"g\.idx: truncated"):
        I.IndexedDataset(good)
    os.truncate(good + ".idx", 20)
    with pytest.raises(I.DataFormatError, match=r"g\.idx: truncated header: 20 bytes"):
        I.IndexedDataset(good)


def test_truncated_bin(good):
    os.truncate(good + ".bin", 12)
    with pytest.raises(I.DataFormatError, match=r"sequence 1 \(pointer at byte 50\) spans "
                                                 r"bytes \[12, 20\) .*truncated \.bin"):
        I.IndexedDataset(good)


def test_pointer_inconsistent(good):
    _patch(good + ".idx", 34 + 8 + 8, struct.pack("<q", 16))  # sequence 1 pointer
    with pytest.raises(I.DataFormatError, match=r"sequence 1 \(pointer at byte 50\)"):
        I.IndexedDataset(good)
    _patch(good + ".idx", 34 + 8 + 8, struct.pack("<q", 13))  # not a multiple of 4
    with pytest.raises(I.DataFormatError, match=r"sequence 1"):
        I.IndexedDataset(good)


def test_sequences_must_follow_each_other_in_the_bin(good):
    """Sequences of int32 tokens [1, 2, 3] and [4, 5]: Megatron writes them back to back (pointers 0 and 12, 20
    bytes in all). A dtype code of another width, pointers that overlap or a .bin of another dataset would read
    other tokens silently."""
    _patch(good + ".idx", 17, bytes([8]))  # uint16: the same pointers now leave gaps
    with pytest.raises(I.DataFormatError, match=r"sequence 1 \(pointer at byte 50\) starts at byte 12 of .*g\.bin, "
                                                 r"but the sequences before it end at byte 6 \(uint16 tokens of 2 "
                                                 r"bytes: is the dtype code right\?\)"):
        I.IndexedDataset(good)
    _patch(good + ".idx", 17, bytes([4]))
    _patch(good + ".idx", 34 + 8 + 8, struct.pack("<q", 0))  # both sequences at byte 0
    with pytest.raises(I.DataFormatError, match=r"sequence 1 \(pointer at byte 50\) starts at byte 0 .* end at byte 12"):
        I.IndexedDataset(good)
    _patch(good + ".idx", 34 + 8 + 8, struct.pack("<q", 12))
    I.IndexedDataset(good)
    with open(good + ".bin", "ab") as f:
        f.write(bytes(4))
    with pytest.raises(I.DataFormatError, match=r"g\.idx: its 2 sequences end at byte 20 but .*g\.bin has 24 bytes"):
        I.IndexedDataset(good)


def test_length_inconsistent(good):
    _patch(good + ".idx", 34 + 4, struct.pack("<i", -1))
    with pytest.raises(I.DataFormatError, match=r"negative sequence length -1 for sequence 1 "
                                                 r"at byte 38"):
        I.IndexedDataset(good)


def test_document_index_not_ending_at_sequence_count(good):
    _patch(good + ".idx", 34 + 24 + 16, struct.pack("<q", 1))
    with pytest.raises(I.DataFormatError, match=r"document index ends at 1 \(byte 74\) but "
                                                 r"there are 2 sequences"):
        I.IndexedDataset(good)


def test_document_index_not_starting_at_zero(good):
    _patch(good + ".idx", 34 + 24, struct.pack("<q", 1))
    with pytest.raises(I.DataFormatError, match=r"must start at 0, got 1 at byte 58"):
        I.IndexedDataset(good)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "e")
    I.write_dataset(prefix, [], dtype=np.int32)
    with pytest.raises(I.DataFormatError, match=r"e\.idx: empty dataset"):
        I.IndexedDataset(prefix)


def test_missing_file(good):
    """A missing .bin or .idx is a DataError naming the file (hand-made case)."""
    os.remove(good + ".bin")
    with pytest.raises(DataError, match=r"g\.bin: no such file"):
        I.IndexedDataset(good)
    os.remove(good + ".idx")
    with pytest.raises(DataError, match=r"g\.idx: no such file"):
        I.IndexedDataset(good)


def test_a_directory_or_a_device_where_a_file_belongs_is_named(good):
    os.remove(good + ".idx")
    os.mkdir(good + ".idx")
    with pytest.raises(DataError, match=r"g\.idx: a directory, not a file"):
        I.IndexedDataset(good)
    os.rmdir(good + ".idx")
    os.symlink("/dev/zero", good + ".idx")
    with pytest.raises(DataError, match=r"g\.idx: not a regular file"):
        I.IndexedDataset(good)


def test_format_errors_are_data_errors():
    assert issubclass(I.DataFormatError, DataError) and issubclass(DataError, ValueError)


def test_trailing_bytes(good):
    with open(good + ".idx", "ab") as f:
        f.write(b"\x00" * 5)
    with pytest.raises(I.DataFormatError, match="trailing bytes"):
        I.IndexedDataset(good)


_FILL = """
import json, sys
import numpy as np
from ling2.data import indexed as I
prefix, full = sys.argv[1], sys.argv[2]
b = I.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
errors = []
try:
    if full == "bin":  # 200 bytes a document: the .bin outgrows the limit
        for _ in range(10000):
            b.add_document(np.full(100, 7), [100])
    else:  # 2 bytes of .bin and 20 of .idx a document: only the .idx does
        for _ in range(10000):
            b.add_document([7], [1])
        b.finalize(prefix + ".idx")
except OSError as e:
    errors.append(e.strerror)
try:
    b.discard()
except BaseException as e:
    errors.append(repr(e))
print(json.dumps(errors))
"""


@pytest.mark.parametrize("full", ["bin", "idx"])
def test_discard_on_a_full_disk_raises_nothing_and_leaves_no_file(tmp_path, full):
    """A build the file system stops (a full disk; here RLIMIT_FSIZE of 64 KiB) while writing the `.bin` or the
    `.idx`: discard() raises no second error (flushing what the `.bin` still buffers would fail again) and removes
    both partial files."""
    import resource
    import signal
    import subprocess
    import sys

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _FILL, str(tmp_path / "d"), full], capture_output=True, text=True,
                       env=env, timeout=120, preexec_fn=small_disk)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["File too large"]
    assert list(tmp_path.iterdir()) == []
