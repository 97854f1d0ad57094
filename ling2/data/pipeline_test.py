"""Grain pipeline: transforms on packed samples (hand-computed expectations), host sharding,
iterator save/restore, worker processes, and the bundled sample data through the config."""

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

from ling2.config import load_config
from ling2.data import pipeline as P
from ling2.data.blend import build_splits
from ling2.data.errors import DataError
from ling2.data.indexed import write_dataset

EOD, PAD, BOS = 2, 0, 1


def _apply(ops, text, length=None):
    x = {"text": np.asarray(text, np.int32)}
    if length is not None:
        x["length"] = np.asarray(length, np.int32)
    for op in ops:
        x = op.map(x)
    return x


def test_packed_sample_with_eod():
    # text (S + 1 = 9):   a  b EOD  c  d  e EOD  f | g
    text = [10, 11, EOD, 12, 13, 14, EOD, 15, 16]
    x = _apply(P.transforms(EOD, pad_id=-1), text)
    assert x["inputs"].tolist() == [10, 11, 2, 12, 13, 14, 2, 15]
    assert x["targets"].tolist() == [11, 2, 12, 13, 14, 2, 15, 16]
    assert x["segment_ids"].tolist() == [1, 1, 1, 2, 2, 2, 2, 3]
    assert x["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert x["loss_weights"].tolist() == [1] * 8
    assert x["inputs"].dtype == np.int32 and x["loss_weights"].dtype == np.float32


def test_eod_mask_loss_and_no_resets():
    text = [10, EOD, 12, 13, EOD]
    x = _apply(P.transforms(EOD, eod_mask_loss=True, reset_attention_mask=False,
                            reset_position_ids=False), text)
    assert x["segment_ids"].tolist() == [1, 1, 1, 1]
    assert x["positions"].tolist() == [0, 1, 2, 3]
    assert x["loss_weights"].tolist() == [1, 0, 1, 1]  # zero where the INPUT is EOD


def test_padding_is_masked_and_zeroed():
    text = [10, 11, EOD, 12, 7, 7, 7]  # a keep-partial sample of 4 real tokens, padded with 7
    x = _apply(P.transforms(EOD, pad_id=7), text, length=4)
    assert x["inputs"].tolist() == [10, 11, 2, 12, 0, 0]
    assert x["targets"].tolist() == [11, 2, 12, 0, 0, 0]
    assert x["loss_weights"].tolist() == [1, 1, 1, 0, 0, 0]
    assert x["segment_ids"].tolist() == [1, 1, 1, 2, 0, 0]


def test_without_extra_token_last_target_is_masked():
    x = _apply(P.transforms(EOD, pad_id=PAD, add_extra_token=False), [10, 11, 12])
    assert x["inputs"].tolist() == [10, 11, 12]
    assert x["targets"].tolist() == [11, 12, 0]
    assert x["loss_weights"].tolist() == [1, 1, 0]


def test_bos_only_where_configured():
    text = [10, EOD, 12, 13, EOD, 14]
    assert _apply(P.transforms(EOD, bos_id=BOS), text)["inputs"].tolist() == [10, 2, 12, 13, 2]
    x = _apply(P.transforms(EOD, bos_id=BOS, add_bos=True), text)
    assert x["inputs"].tolist() == [10, 2, 1, 12, 13]
    assert x["targets"].tolist() == [2, 1, 12, 13, 2]
    # A padded sample: the inserted BOS is real, so the real length grows by one.
    x = _apply(P.transforms(EOD, bos_id=BOS, add_bos=True), [10, EOD, 12, -1, -1, -1], length=3)
    assert x["inputs"].tolist() == [10, 2, 1, 12, 0]
    assert x["loss_weights"].tolist() == [1, 1, 1, 0, 0]
    assert x["segment_ids"].tolist() == [1, 1, 2, 2, 0]


@pytest.mark.parametrize("kw", [dict(), dict(add_bos=True, bos_id=BOS, eod_mask_loss=True),
                                dict(pad_id=7, add_extra_token=False)])
def test_batched_transforms_equal_per_sample(kw):
    rng = np.random.default_rng(0)
    text = rng.integers(3, 9, size=(5, 17)).astype(np.int32)
    text[rng.random(text.shape) < 0.2] = EOD
    ops = P.transforms(EOD, **kw)
    batch = _apply(ops, text)
    for r in range(5):
        one = _apply(ops, text[r])
        for k in one:
            np.testing.assert_array_equal(batch[k][r], one[k], err_msg=k)


def test_pad_equal_to_eod_warns_and_is_not_masked():
    with pytest.warns(UserWarning, match="pad_id 2 equals the EOD"):
        ops = P.transforms(EOD, pad_id=EOD)
    assert _apply(ops, [10, EOD, 12])["loss_weights"].tolist() == [1, 1]


class _Range:
    """Sample i is [i, i+1, ...]: makes batch contents traceable."""

    def __init__(self, n, length=5):
        self.n, self.length = n, length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.arange(i * 100, i * 100 + self.length)


def _ids(batch):
    return (batch["inputs"][:, 0] // 100).tolist()


def test_hosts_split_each_global_batch_contiguously():
    src = _Range(24)
    ops = P.transforms(EOD, pad_id=-1)
    per_host = [[_ids(b) for b in P.make_iterator(src, 8, ops, p, 2)] for p in range(2)]
    assert per_host[0] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert per_host[1] == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 23]]
    with pytest.raises(ValueError, match="not divisible by 3 processes"):
        P.make_iterator(src, 8, ops, 0, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterator_state_restore_gives_identical_batches(workers):
    src = _Range(40)
    ops = P.transforms(EOD, pad_id=-1)
    it = P.make_iterator(src, 4, ops, worker_count=workers)
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]
    fresh = P.make_iterator(src, 4, ops, worker_count=workers)
    fresh.set_state(state)
    got = [next(fresh) for _ in range(3)]
    assert [_ids(b) for b in want] == [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    for a, b in zip(want, got):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def _sample_config(**kw):
    base = dict(data_path=P.sample_prefix(), tokenizer_path=P.sample_tokenizer(),
                max_target_length=64, per_device_batch_size=2, gradient_accumulation_steps=1,
                steps=5, eval_interval=5, eval_steps=1, data_split="90,10,0")
    base.update(kw)
    return load_config(base)


def test_sample_data_through_config():
    cfg = _sample_config()
    batches = list(P.make_data_iterator(cfg, num_devices=2, process_index=0, process_count=1))
    assert len(batches) >= 5
    b = batches[0]
    assert b["inputs"].shape == (4, 64) and b["targets"].shape == (4, 64)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert b["inputs"].max() < 8192
    # Segment ids step up exactly after EOD inputs.
    seg, inp = b["segment_ids"], b["inputs"]
    np.testing.assert_array_equal(np.diff(seg, axis=1), (inp[:, :-1] == cfg.eod_id))
    valid = next(P.make_data_iterator(cfg, 2, "valid", 0, 1))
    assert valid["inputs"].shape == (4, 64)


def test_train_samples_are_megatron_order():
    cfg = _sample_config()
    train = build_splits(cfg.data_path, cfg.data_split, 64, [20, None, None], seed=cfg.data_seed)[0]
    it = P.make_data_iterator(cfg, 2, "train", 0, 1, dataset=train)
    first = next(it)
    want = np.stack([train[i][:-1] for i in range(4)]).astype(np.int32)
    np.testing.assert_array_equal(first["inputs"], np.where(want == cfg.pad_id, 0, want))


def test_default_split_on_small_data_builds_only_what_is_used():
    cfg = _sample_config(data_split="969,30,1")  # the test split of 119 documents is empty
    assert next(P.make_data_iterator(cfg, 2, "train", 0, 1))["inputs"].shape == (4, 64)
    with pytest.raises(ValueError, match=r"test split, sequences \[119, 119\)\): the split "
                                         r"has 0 tokens"):
        P.make_data_iterator(cfg, 2, "test", 0, 1)


def test_synthetic_source():
    cfg = _sample_config(dataset_type="synthetic")
    b = next(P.make_data_iterator(cfg, 2, "train", 0, 1))
    assert b["inputs"].shape == (4, 64) and (b["inputs"] < cfg.vocab_size).all()
    again = next(P.make_data_iterator(cfg, 2, "train", 0, 1))
    np.testing.assert_array_equal(b["inputs"], again["inputs"])


def test_empty_data_path_is_an_error():
    with pytest.raises(ValueError, match="data_path is empty"):
        P.make_data_iterator(_sample_config(data_path=""), 2, "train", 0, 1)


FIX = Path(__file__).resolve().parent / "testdata" / "megatron"
SEM = json.loads((FIX / "semantics.json").read_text())
GETITEM = [(c, s) for c in SEM["getitem_cases"] for s in ("train", "valid")]


@pytest.mark.parametrize("case,split", GETITEM, ids=[f"{c['name']}-{s}" for c, s in GETITEM])
def test_batches_equal_megatron_getitem(case, split):
    """Reference: Megatron-LM's GPTDataset.__getitem__ (fixtures getitem-*, see the README) on
    documents [BOS, ..., EOD] holding the ordinary token 3, for a pad id that is distinct, equal
    to EOD, equal to BOS, an ordinary token (3), or none; with and without the extra token; with
    and without the resets; the valid split keeps its partial last sample. inputs, targets,
    loss weights and positions equal Megatron's tokens, labels, loss mask and position ids; the
    segment ids allow exactly Megatron's attention for every real query position."""
    S, add = case["seq_length"], case["add_extra_token"]
    ds = build_splits(str(FIX / case["dataset"]), case["split"], S, [None, None, None],
                      seed=case["seed"], add_extra_token=add, drop_last_valid=False)[
        ("train", "valid").index(split)]
    want = np.load(FIX / f"{case['name']}-{split}.npz")
    collides = case["pad_id"] in (EOD, BOS)
    with pytest.warns(UserWarning, match="equals the EOD/BOS") if collides else nullcontext():
        ops = P.transforms(EOD, case["pad_id"], BOS, False, case["reset_attention_mask"],
                           case["reset_position_ids"], case["eod_mask_loss"], add)
    (x,) = list(P.make_iterator(ds, len(ds), ops))
    np.testing.assert_array_equal(x["inputs"], want["tokens"])
    np.testing.assert_array_equal(x["targets"], want["labels"])
    loss = x["loss_weights"]
    if not (case["reset_position_ids"] or case["reset_attention_mask"] or case["eod_mask_loss"]):
        # Megatron caches this loss mask and its first __getitem__ zeroes the pad positions of
        # the cached tensor in place, so sample 0's pad mask leaks into every later sample. We
        # do not reproduce that bug: the fixture equals our mask times its own row 0.
        np.testing.assert_array_equal(loss[0], want["loss_mask"][0])
        loss = loss * want["loss_mask"][0]
    np.testing.assert_array_equal(loss, want["loss_mask"])
    np.testing.assert_array_equal(x["positions"], want["position_ids"])
    seg = x["segment_ids"]
    allowed = (seg[:, :, None] == seg[:, None, :]) & np.tri(S, dtype=bool)
    real = seg != 0  # query rows past the real length (padding) are loss-free
    np.testing.assert_array_equal(allowed[real], ~want["attention_mask"][real])
    if split == "valid":  # the fixture covers a padded sample
        pad = case["splits"][split]["pad_token_id"]
        assert (want["text"][:, -1] == pad).any() and real.sum(1).min() < S


def _write_pad_docs(tmp_path, docs, dtype=np.int32):
    write_dataset(str(tmp_path / "d"), [[d] for d in docs], dtype=dtype)
    return str(tmp_path / "d")


def test_pad_id_as_ordinary_token_keeps_documents_whole(tmp_path):
    """Hand-computed: pad_id 3 also occurs as a real token inside a document. Its segment and
    positions follow the document (it attends to and is attended by its document, and does
    not restart the GLA state); as Megatron, it is fed as 0 and not predicted."""
    docs = [[10, 3, 11, 3, 12, EOD], [13, 14, 3, EOD], [15, 16, EOD]]
    ds = build_splits(_write_pad_docs(tmp_path, docs), "1,0,0", 8, [None] * 3, seed=1)[0]
    (x,) = list(P.make_iterator(ds, len(ds), P.transforms(EOD, pad_id=3)))
    text = ds.samples(np.arange(len(ds)))
    for r in range(len(ds)):
        inp = text[r, :-1]
        is_eod = (inp == EOD).astype(int)
        np.testing.assert_array_equal(x["segment_ids"][r], np.cumsum(is_eod) - is_eod + 1)
        np.testing.assert_array_equal(x["inputs"][r], np.where(inp == 3, 0, inp))
        np.testing.assert_array_equal(x["loss_weights"][r], (text[r, 1:] != 3).astype(np.float32))


def test_keep_partial_padding_is_known_by_position(tmp_path):
    """Hand-computed keep-partial last sample (S = 4, 10 tokens: 2 full samples of 4 + 1, then
    [16, EOD] + 3 padding): for every pad setting (equal to EOD, none, an ordinary token) the
    padding has input 0, target 0, loss 0 and segment 0; positions run on as Megatron's."""
    docs = [[10, 11, 12, EOD, 3, 14, EOD, 15, 16, EOD]]  # one sequence: no shuffle of the stream
    ds = build_splits(_write_pad_docs(tmp_path, docs), "0,1,0", 4, [None] * 3, seed=1,
                      drop_last_valid=False)[1]
    assert len(ds) == 3
    last = int(np.flatnonzero(ds.shuffle_index == 2)[0])
    for pad in (EOD, -1, 3):
        with pytest.warns(UserWarning) if pad == EOD else nullcontext():
            ops = P.transforms(EOD, pad_id=pad)
        (x,) = list(P.make_iterator(ds, len(ds), ops))
        assert x["inputs"][last].tolist() == [16, EOD, 0, 0], pad
        assert x["targets"][last].tolist() == [EOD, 0, 0, 0], pad
        assert x["loss_weights"][last].tolist() == [1, 0, 0, 0], pad
        assert x["segment_ids"][last].tolist() == [1, 1, 0, 0], pad
        assert x["positions"][last].tolist() == [0, 1, 0, 1], pad  # reset after the EOD input


def _tiny_config(prefix, **kw):
    base = dict(data_path=prefix, max_target_length=4, per_device_batch_size=2,
                gradient_accumulation_steps=1, steps=2, eval_interval=0, eval_steps=1,
                data_split="1,0,0", vocab_size=64)
    base.update(kw)
    return load_config(base)


def test_out_of_vocabulary_id_stops_the_pipeline(tmp_path):
    """Hand-made: -1 in an int32 .bin (it would train as row V-1) is a DataError naming the
    file, sequence, offset, id and vocab_size when the batch holding it is read."""
    prefix = _write_pad_docs(tmp_path, [[10, 11, 12, EOD], [13, -1, 15, EOD], [16, 17, EOD]])
    it = P.make_data_iterator(_tiny_config(prefix), 1, "train", 0, 1)
    with pytest.raises(DataError, match=r"d\.bin: token id -1 at sequence 1 \(document 1\), "
                                        r"token offset 1 \(byte 20\) is outside the vocabulary "
                                        r"\[0, vocab_size=64\)"):
        for _ in range(10):
            next(it)


def test_global_batch_of_zero_is_named():
    cfg = _sample_config(per_device_batch_size=0.25)
    with pytest.raises(DataError, match=r"global batch size is 0: per_device_batch_size=0\.25 "
                                        r"x 2 device"):
        P.make_data_iterator(cfg, 2, "train", 0, 1)


def test_dataset_too_small_for_one_sample_is_named(tmp_path):
    prefix = _write_pad_docs(tmp_path, [[10, 11, EOD]])
    with pytest.raises(DataError, match=r"d \(train split, sequences \[0, 1\)\): the split has 3 "
                                        r"tokens, too few for one sample of sequence length 4"):
        P.make_data_iterator(_tiny_config(prefix), 1, "train", 0, 1)


def test_data_config_fields_reach_the_datasets(tmp_path):
    """drop_last_partial_validation_sequence, exact_sample_count and blend_per_split from the
    config (defaults: Megatron's) reach the index builder."""
    prefix = _write_pad_docs(tmp_path, [[10, 11, 12, EOD], [3, 14, EOD], [15, 16, EOD]])
    cfg = _tiny_config(prefix, data_split="0,1,0", eval_steps=1, per_device_batch_size=1)
    assert not cfg.exact_sample_count and cfg.drop_last_partial_validation_sequence
    assert len(P.datasets_from_config(cfg, 1, ["valid"])[1]) == 2  # the partial sample dropped
    keep = cfg.model_copy(update={"drop_last_partial_validation_sequence": False,
                                  "exact_sample_count": True})
    valid = P.datasets_from_config(keep, 1, ["valid"])[1]
    assert len(valid) == 3 and valid.read(np.arange(3))[1].min() == 2
    assert json.loads(valid.description)["exact_sample_count"] is True
    per_split = _tiny_config("", blend_per_split=[prefix, "", prefix], eval_steps=1)
    train, valid, test = P.datasets_from_config(per_split, 1)
    assert valid is None and len(train) >= 2 and len(test) >= 2
    assert set(train.document_index.tolist()) == {0, 1, 2}  # whole datasets, not data_split


@pytest.mark.parametrize("field", ["blend_cache_dir", "blend_index_dir"])
def test_index_directories_that_are_files_are_named(tmp_path, field):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(DataError, match=rf"{field}: .*a_file is a file, not a directory"):
        P.datasets_from_config(_sample_config(**{field: str(a_file)}), 1)
