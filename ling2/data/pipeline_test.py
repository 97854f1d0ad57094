"""Grain pipeline: transforms on packed samples (hand-computed expectations), host sharding,
iterator save/restore, worker processes, and the bundled sample data through the config."""

import numpy as np
import pytest

from ling2.config import load_config
from ling2.data import pipeline as P
from ling2.data.blend import build_splits

EOD, PAD, BOS = 2, 0, 1


def _apply(ops, text):
    x = {"text": np.asarray(text, np.int32)}
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
    text = [10, 11, EOD, 12, 7, 7, 7]  # a keep-partial sample padded with 7
    x = _apply(P.transforms(EOD, pad_id=7), text)
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
    train = build_splits(cfg.data_path, cfg.data_split, 64, [20, None, None], seed=cfg.data_seed,
                         pad_id=cfg.pad_id)[0]
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
