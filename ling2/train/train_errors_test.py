"""Trainer faults: one-line errors for bad config/data, NaN steps (never checkpointed), dry run."""

import os
import re
import signal
import subprocess

import jax
import numpy as np
import pytest

from ling2.config import load_config
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.testing import e2e
from ling2.train.train import find_file


def test_bad_config_and_bad_data_are_one_line_errors(tmp_path):
    r = subprocess.run(e2e.binary() + [f"--run_dir={tmp_path}", "num_expertz=3"], env=e2e.env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "error: bad config" in r.stderr and "num_experts" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run(e2e.binary() + [f"--run_dir={tmp_path}", "--", *e2e.MICRO, "data_path=/nonexistent/prefix"],
                       env=e2e.env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "DataError" in r.stderr and "/nonexistent/prefix" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_dry_run_prints_memory(tmp_path):
    r = subprocess.run(e2e.binary() + [f"--run_dir={tmp_path}", "--dry_run", "--", *e2e.MICRO], env=e2e.env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "temp_size_in_bytes" in r.stdout and "MiB" in r.stdout
    assert not (tmp_path / "checkpoints").exists()


def test_dry_run_reads_no_data_and_materialises_no_state(tmp_path, monkeypatch):
    """The data path does not exist and building real state or batches fails: the dry run still
    compiles (abstract state only) and reports XLA's memory analysis."""
    cfg = load_config(*e2e.MICRO, "data_path=/nonexistent/prefix")

    def forbidden(*a, **k):
        raise AssertionError("the dry run built real state or read data")

    monkeypatch.setattr(loop, "init_state", forbidden)
    lines = []
    result = loop.run(cfg, tmp_path, forbidden, dry_run_only=True, tensorboard=False, log=lines.append,
                      devices=jax.devices()[:1])
    assert result.final_step == 0 and not (tmp_path / "checkpoints").exists()
    args = [float(s.split()[1]) for s in lines if s.strip().startswith("argument_size_in_bytes")]
    assert args and args[0] > 0, lines
    big = max((x.nbytes for x in jax.live_arrays()), default=0)
    assert big < 1 << 20, big  # the embedding alone (8192 x 64 fp32) would be 2 MiB


def test_consecutive_non_finite_steps_stop_with_last_good_checkpoint(tmp_path):
    cfg = load_config(*e2e.MICRO, "steps=10", "checkpoint_period=2", "async_checkpointing=false",
                      config_file=find_file("configs/train/tiny_sample.yml"))
    real = make_iterator_factory(find_file)

    class Poisoned:
        """Real batches, then NaN loss weights from the 3rd batch on."""

        def __init__(self, it):
            self.it, self.n = it, 0

        def __next__(self):
            b = next(self.it)
            self.n += 1
            if self.n >= 3:
                b["loss_weights"] = b["loss_weights"] * np.nan
            return b

        def __getattr__(self, name):  # get_state / set_state for checkpoints
            return getattr(self.it, name)

    logs = []
    with pytest.raises(loop.TrainingError, match="2 consecutive non-finite steps"):
        loop.run(cfg, tmp_path, lambda c, s, n, share: Poisoned(real(c, s, n, share)), max_consecutive_skips=2,
                 tensorboard=False, log=logs.append, devices=jax.devices()[:1])
    assert any("update skipped" in line for line in logs)
    assert max(e2e.saved_steps(tmp_path)) == 2  # skipped steps are never checkpointed


def _bad_data(tmp_path, kind):
    """A data_path (and overrides) that is wrong in one way; see test_data_errors_exit_2."""
    from ling2.data.indexed import IndexedDataset, write_dataset
    sample = IndexedDataset(str(find_file("data/sample/sample_text_document")))
    docs = [[sample.get(i).astype(np.int64)] for i in range(len(sample))]
    prefix = str(tmp_path / kind)
    if kind == "negative_id":
        for d in docs:
            d[0][::50] = -1
        write_dataset(prefix, docs, dtype=np.int32)
    elif kind == "too_small":
        write_dataset(prefix, [[[5, 6, 7, 2]], [[8, 9, 2]]], dtype=np.uint16)
    elif kind == "truncated_bin":
        write_dataset(prefix, docs[:20], dtype=np.uint16)
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(f.seek(0, 2) - 10)
    return [f"data_path={prefix}"]


@pytest.mark.parametrize("kind,message", [
    ("negative_id", r"DataError: .*negative_id\.bin: token id -1 at sequence \d+ \(document \d+\), "
                    r"token offset \d+ \(byte \d+\) is outside the vocabulary \[0, vocab_size=8192\)"),
    ("too_small", r"DataError: .*too_small \(train split, sequences \[0, 2\)\): the split has 7 "
                  r"tokens, too few for one sample of sequence length 32"),
    ("truncated_bin", r"DataError: .*truncated_bin\.idx: sequence 19 .* spans bytes .*truncated_bin\.bin"),
    ("zero_batch", r"ConfigError: per_device_batch_size: 0\.5 x 1 device\(s\) = 0\.5 sequences per micro-batch, "
                   r"not a whole number"),
    ("empty_valid", r"DataError: .*data_split '100,0,0' leaves the valid split empty"),
])
def test_data_errors_exit_2(tmp_path, kind, message):
    """Bad data is one named DataError and exit 2, before the model is built (token ids when
    their batch is read)."""
    extra = {"zero_batch": ["per_device_batch_size=0.5"],
             "empty_valid": ["data_split=100,0,0", "eval_interval=2", "eval_steps=1"],  # valid data, checked at start
             }.get(kind) or _bad_data(tmp_path, kind)
    r = subprocess.run(e2e.binary() + [f"--run_dir={tmp_path / 'run'}", "--notensorboard", "--",
                                       *e2e.MICRO, "steps=3", *extra],
                       env=e2e.env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert re.search(message, r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    if kind != "negative_id":
        assert "model:" not in r.stdout  # validated before building the model


@pytest.mark.parametrize("how", ["end", "sigterm"])
def test_run_ending_on_a_skipped_step_saves_nothing_after_it(tmp_path, how):
    """Batch 3 is poisoned and is the last (steps=3), or SIGTERM arrives while it is read: step 3 is skipped,
    so neither the end-of-run nor the signal's save is made; step 2 stays the newest checkpoint."""

    class PoisonThird:
        def __init__(self, it):
            self.it, self.n = it, 0

        def __next__(self):
            b = next(self.it)
            self.n += 1
            if self.n == 3:
                b["loss_weights"] = b["loss_weights"] * np.nan
                if how == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
            return b

        def __getattr__(self, name):
            return getattr(self.it, name)

    logs = []
    steps = 3 if how == "end" else 50
    cfg = load_config(*e2e.MICRO, f"steps={steps}", "checkpoint_period=2", "async_checkpointing=false",
                      config_file=find_file("configs/train/tiny_sample.yml"))
    real = make_iterator_factory(find_file)
    result = loop.run(cfg, tmp_path, lambda c, s, n, share: PoisonThird(real(c, s, n, share)), tensorboard=False,
                      log=logs.append, devices=jax.devices()[:1])
    assert result.final_step == 3 and result.stopped_by_signal == (how == "sigterm")
    assert any("step 3: non-finite" in line for line in logs)
    assert any("step 3 followed 1 skipped steps: not checkpointed" in line for line in logs), logs
    assert e2e.saved_steps(tmp_path) == [2]


def test_failed_background_save_stops_the_run_at_the_next_step(tmp_path, monkeypatch):
    """A background checkpoint save that fails is reported one step later (not at the next checkpoint step, one
    period late): a CheckpointError naming the step whose save failed, its cause, and where it was found."""
    from ling2.checkpoint.manager import Checkpointer
    from ling2.checkpoint.state import CheckpointError

    def failing_commit(self, step, args):
        raise OSError(f"simulated storage failure for step {step}")

    monkeypatch.setattr(Checkpointer, "_commit", failing_commit)
    cfg = load_config(*e2e.MICRO, "async_checkpointing=true", "checkpoint_period=4", "steps=8", "log_period=100",
                      config_file=find_file("configs/train/tiny_sample.yml"))
    with pytest.raises(CheckpointError) as err:
        loop.run(cfg, tmp_path, make_iterator_factory(find_file), log=lambda s: None, devices=jax.devices()[:1],
                 tensorboard=False)
    msg = str(err.value)
    assert "/4: saving the checkpoint failed: OSError: simulated storage failure for step 4" in msg, msg
    found = int(re.search(r"found after step (\d+)", msg).group(1))
    assert 4 < found < 8, msg  # before step 8, the next checkpoint step
