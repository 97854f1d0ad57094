"""The attention benchmark's packed batches: document ids and cuDNN's segment table, against hand-made rows."""

import numpy as np

from tools.bench.gpu import attention


def test_packed_segments_of_a_hand_made_batch():
    seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    lengths, offsets = attention.packed_segments(seg)
    assert np.asarray(lengths).tolist() == [[3, 2, 3], [8, -1, -1]]
    assert np.asarray(offsets).tolist() == [[0, 3, 5, 8], [0, 8, -1, -1]]


def test_random_batches_pack_whole_rows_of_documents():
    seg = np.asarray(attention.segments(3, 4096, 1024, seed=1))
    assert seg.shape == (3, 4096) and (seg[:, 0] == 0).all() and (np.diff(seg, axis=1) >= 0).all()
    lengths, offsets = (np.asarray(a) for a in attention.packed_segments(seg))
    for b in range(3):
        n = int((lengths[b] > 0).sum())
        assert n == seg[b, -1] + 1 and lengths[b, :n].sum() == 4096
        assert (np.diff(offsets[b, :n + 1]) == lengths[b, :n]).all()
    assert 2 <= lengths[lengths > 0].size / 3 <= 12  # about 4 documents of ~1K tokens a row
