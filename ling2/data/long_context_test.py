"""128K-token sequences from a Megatron-format corpus through the config's pipeline, without host memory
growing with the corpus: the .bin stays memory-mapped and a batch is gathered straight into its rows.

Reference: the documents themselves (each row must be a contiguous run of the concatenated document stream
in the index's document order, with segment ids counting the EODs before each position) and Python's
tracemalloc, which sees every NumPy allocation (not the pages of a memory map)."""

import tracemalloc

import numpy as np

from ling2.config import load_config
from ling2.data import pipeline as P
from ling2.data.indexed import write_dataset

S = 131072
EOD = 0


def test_128k_sequences_read_in_memory_of_a_few_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "PREFETCH_BYTES", 10 * 2**20)  # two batches ahead
    rng = np.random.default_rng(0)
    lengths = rng.integers(20_000, 200_000, 600)  # ~66M tokens: a 132 MB uint16 .bin
    docs = [np.append(rng.integers(1, 60_000, n - 1), EOD) for n in lengths]
    write_dataset(str(tmp_path / "long"), [[d] for d in docs], dtype=np.uint16)
    cfg = load_config(data_path=str(tmp_path / "long"), data_split="1,0,0", max_target_length=S, max_position_embeddings=S,
                      per_device_batch_size=2, gradient_accumulation_steps=1, steps=16, eval_interval=0,
                      eval_steps=0, vocab_size=65536, eod_id=EOD, blend_cache_dir=str(tmp_path / "cache"))
    tracemalloc.start()
    it = P.make_data_iterator(cfg, 1, "train", process_index=0, process_count=1)
    batches = [next(it) for _ in range(4)]  # of 16 train batches
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    batch_bytes = sum(x.nbytes for x in batches[0].values())  # 2 rows x 128K x 5 arrays x 4 bytes = 5 MiB
    corpus_bytes = int(lengths.sum()) * 2
    # the read-ahead is capped by bytes (P.PREFETCH_BYTES), not grain's default of 500 batches ahead; the
    # corpus is never copied into memory
    assert peak < 12 * batch_bytes < corpus_bytes / 2, (peak, batch_bytes, corpus_bytes)
    assert P.read_options(batch_bytes * 32).prefetch_buffer_size == 2

    stream = np.concatenate(docs)
    for b in batches:
        assert b["inputs"].shape == (2, S) and b["segment_ids"].shape == (2, S)
        for r in range(2):
            inp = b["inputs"][r]
            is_eod = (inp == EOD).astype(np.int64)
            np.testing.assert_array_equal(b["segment_ids"][r], np.cumsum(is_eod) - is_eod + 1)
            np.testing.assert_array_equal(b["targets"][r, :-1], inp[1:])
            # a window of the document stream (documents in some order): its first document's tail, whole
            # documents, the last one's head; check the first whole document is one of the corpus's
            starts = np.flatnonzero(inp == EOD)
            if len(starts) >= 2:
                whole = inp[starts[0] + 1:starts[1] + 1]
                assert any(len(d) == len(whole) and np.array_equal(d, whole) for d in docs)
    assert stream.size == corpus_bytes // 2
