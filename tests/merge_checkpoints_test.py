"""WSM checkpoint merging (//ling2/checkpoint:merge; tested here, beside the trainer whose run it merges):
coefficients against hand computations and against the decayed schedule they emulate (plain SGD written
out), and the merge of a real run's step directories against the weighted sum of each step's state read
back on its own (orbax's full restore), written as a directory that generation loads."""

import os
import subprocess
import sys

import numpy as np
import pytest

from ling2.checkpoint import merge as M
from ling2.checkpoint.state import CheckpointError, load_state, model_leaves, save_state, flat
from ling2.config import load_config
from ling2.layers.spec import ModelSpec


@pytest.mark.parametrize("shape,k,want", [
    ("uniform", 4, [0.25, 0.25, 0.25, 0.25]),
    ("linear", 2, [0.5, 0.5]),
    # alpha = 0.5 (1 + cos(pi j / 4)), j = 0..3: 1, 0.853553, 0.5, 0.146447
    ("cosine", 4, [0.146447, 0.353553, 0.353553, 0.146447]),
    # alpha = 1 - sqrt(j / 4): 1, 0.5, 0.292893, 0.133975
    ("1-sqrt", 4, [0.5, 0.207107, 0.158919, 0.133975]),
])
def test_coefficients_by_hand(shape, k, want):
    c = M.decay_coefficients(shape, k)
    np.testing.assert_allclose(c, want, atol=1e-6)
    assert abs(c.sum() - 1) < 1e-12


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_merge_equals_the_decayed_schedule(shape):
    """SGD with fixed updates g_j: merging the constant-rate checkpoints gives the decayed run's end point."""
    rng = np.random.default_rng(0)
    k, eta = 6, 0.1
    g = rng.normal(size=(k, 5))
    theta0 = rng.normal(size=5)
    ckpts = theta0 + eta * np.cumsum(g, axis=0)  # theta_1..theta_k, constant rate
    f = {"linear": lambda x: 1 - x, "cosine": lambda x: 0.5 * (1 + np.cos(np.pi * x)),
         "1-sqrt": lambda x: 1 - np.sqrt(x)}[shape]
    decayed = theta0 + eta * sum(f(j / k) * g[j] for j in range(k))
    np.testing.assert_allclose(M.decay_coefficients(shape, k) @ ckpts, decayed, rtol=1e-12)


def test_bad_weights_are_named():
    with pytest.raises(ValueError, match="sum to 0.9"):
        M.check_weights([0.5, 0.4], 2)
    with pytest.raises(ValueError, match="3 weights for 2 checkpoints"):
        M.check_weights([0.5, 0.4, 0.1], 2)
    with pytest.raises(ValueError, match=">= 0"):
        M.check_weights([1.5, -0.5], 2)
    with pytest.raises(ValueError, match="unknown decay shape"):
        M.decay_coefficients("exp", 3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step ling2-micro run with a checkpoint every step."""
    from ling2.train import loop
    from ling2.train.data import make_iterator_factory
    from ling2.train.train import find_file

    d = tmp_path_factory.mktemp("run")
    cfg = load_config(dict(model_name="ling2-micro", max_target_length=32, per_device_batch_size=2, eval_interval=0, eval_steps=0,
                           data_split="98,2,0", log_period=1, steps=3, checkpoint_period=1, max_checkpoints_to_keep=5,
                           async_checkpointing=False), config_file=find_file("configs/train/tiny_sample.yml"))
    loop.run(cfg, d, make_iterator_factory(find_file), tensorboard=False, log=lambda s: None)
    return d, cfg


def test_merge_of_step_dirs_is_the_weighted_sum(run, tmp_path):
    d, cfg = run
    dirs = M.step_dirs_of(d, [1, 2, 3])
    w = [0.2, 0.3, 0.5]
    out = M.merge(dirs, w, tmp_path / "merged", log=lambda s: None)
    states = [flat(load_state(x, cfg)) for x in dirs]
    got = flat(load_state(out, cfg))
    assert set(got) == set(states[0]) == set(model_leaves(cfg))
    for p, v in got.items():
        want = sum(c * np.asarray(s[p], np.float64) for c, s in zip(w, states)).astype(v.dtype)
        np.testing.assert_array_equal(v, want, err_msg=str(p))
    assert any(not np.array_equal(states[0][p], states[2][p]) for p in got)  # the steps differ
    from ling2.infer.load import load_model
    assert load_model(out).kind == "state"  # generate / evaluate read it


def test_merge_errors_are_named(run, tmp_path):
    d, cfg = run
    with pytest.raises(CheckpointError, match=r"has no step\(s\) \[7\]"):
        M.step_dirs_of(d, [1, 7])
    with pytest.raises(CheckpointError, match="--last=9"):
        M.step_dirs_of(d, last=9)
    other = load_config(model_name="ling2-micro", base_mlp_dim=96)
    from flax import nnx
    from ling2.layers.model import Ling2Model
    other_model = Ling2Model(ModelSpec.of(other), rngs=nnx.Rngs(0))
    save_state(tmp_path / "other", nnx.to_pure_dict(nnx.state(other_model)), other)
    with pytest.raises(CheckpointError, match="different models:\n  base_mlp_dim: 128 in .* 96 in"):
        M.merge([d / "checkpoints" / "3", tmp_path / "other"], [0.5, 0.5], tmp_path / "x", log=lambda s: None)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "ling2.checkpoint.merge", f"--run_dir={d}", "--steps=1,2",
                        "--weights=0.5,0.6", f"--out={tmp_path / 'y'}"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "weights sum to 1.1" in r.stderr, r.stderr
    for flags, message in ((["--steps=1,x"], "--steps=1,x: want comma-separated ints"),
                           (["--steps=1,2", "--weights=a,b"], "--weights=a,b: want comma-separated floats")):
        r = subprocess.run([sys.executable, "-m", "ling2.checkpoint.merge", f"--run_dir={d}", *flags,
                            f"--out={tmp_path / 'y'}"], env=env, capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr == f"error: merge: {message}\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "ling2.checkpoint.merge", f"--run_dir={tmp_path / 'nope'}", "--last=2",
                        f"--out={tmp_path / 'y'}"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == f"error: merge: --run_dir {tmp_path / 'nope'}: no such directory\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "ling2.checkpoint.merge", f"--run_dir={d}", "--last=2",
                        "--shape=cosine", f"--out={tmp_path / 'z'}"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "z" / "config.yml").is_file(), r.stderr


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_merge_never_destroys_its_output_dir_or_inputs(run, tmp_path, monkeypatch):
    """--out is written whole or not at all: a merge failing partway leaves the previous merge there byte for
    byte (no half-written shard); --out naming one of the inputs, or a trainer step, is refused before a byte
    is written, and that step still restores."""
    d, cfg = run
    quiet = lambda s: None  # noqa: E731
    prev = M.merge(M.step_dirs_of(d, [1, 2]), [0.5, 0.5], tmp_path / "prev", log=quiet)
    before = _files(prev)
    real, calls = M.merged_leaf, []

    def failing(*a):
        calls.append(1)
        if len(calls) == 5:
            raise CheckpointError("merge: a tensor of the wrong shape (simulated)")
        return real(*a)

    monkeypatch.setattr(M, "merged_leaf", failing)
    with pytest.raises(CheckpointError, match="simulated"):
        M.merge(M.step_dirs_of(d, [2, 3]), [0.5, 0.5], prev, log=quiet)
    monkeypatch.setattr(M, "merged_leaf", real)
    assert _files(prev) == before
    with pytest.raises(CheckpointError, match=r"--out .*prev is one of the checkpoints merged"):
        M.merge([prev, d / "checkpoints" / "3"], [0.5, 0.5], prev, log=quiet)
    step = d / "checkpoints" / "3"
    step_before = _files(step)
    with pytest.raises(CheckpointError, match=r"checkpoints/3: not written, it is a trainer step directory"):
        M.merge(M.step_dirs_of(d, [1, 2]), [0.5, 0.5], step, log=quiet)
    assert _files(step) == step_before
    assert set(flat(load_state(step, cfg))) == set(model_leaves(cfg))


def test_training_logs_the_merged_eval_loss_and_trains_as_without(tmp_path):
    """merge_window=2, merge_every=2 on a run saving every step: the record of step 4 holds the eval loss of
    the uniform merge of steps 2 and 3 (the newest saved before it), equal to evaluating the merge tool's
    output; the training losses are those of the same run without merging."""
    import jax
    from flax import nnx

    from ling2.checkpoint.state import load_state
    from ling2.layers.model import Ling2Model
    from ling2.train import loop
    from ling2.train.data import make_iterator_factory
    from ling2.train.eval import Evaluator
    from ling2.train.metrics import read_metrics
    from ling2.train.runtime import make_mesh
    from ling2.train.train import find_file

    base = dict(model_name="ling2-micro", max_target_length=32, per_device_batch_size=2, eval_interval=0, eval_steps=1,
                data_split="90,10,0", log_period=1, steps=4, checkpoint_period=1, max_checkpoints_to_keep=5,
                lr_schedule="wsm")
    runs = {}
    for name, extra in (("plain", {}), ("merged", dict(merge_window=2, merge_every=2))):
        cfg = load_config(base, extra, config_file=find_file("configs/train/tiny_sample.yml"))
        runs[name] = loop.run(cfg, tmp_path / name, make_iterator_factory(find_file), tensorboard=False,
                              log=lambda s: None)
    assert runs["plain"].losses == runs["merged"].losses
    recs = {r["step"]: r for r in read_metrics(tmp_path / "merged" / "metrics.jsonl")}
    assert "eval/merged_loss" not in recs[2]  # only step 1 was saved before step 2's record
    assert recs[4]["eval/merged_from_step"] == 2
    out = M.merge(M.step_dirs_of(tmp_path / "merged", [2, 3]), M.decay_coefficients("uniform", 2), tmp_path / "m",
                  log=lambda s: None)
    mesh = make_mesh(cfg, jax.devices()[:1])
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    nnx.replace_by_pure_dict(state := nnx.state(model), load_state(out, cfg))
    gd, params, rest = nnx.split(nnx.merge(nnx.graphdef(model), state), nnx.Param, ...)
    ev = Evaluator(cfg, mesh, gd, make_iterator_factory(find_file))
    import types
    want = ev.evaluate(types.SimpleNamespace(params=params, rest=rest))
    assert abs(recs[4]["eval/merged_loss"] - want) <= 1e-6 * abs(want)


def test_a_merge_onto_a_full_disk_is_one_error_line_and_keeps_the_previous_output(run, tmp_path):
    """A write the file system refuses (here a file-size limit: EFBIG, as a full disk's ENOSPC) exits 2 with one
    error line naming --out, the previous merge byte for byte."""
    import resource
    import signal

    d, _ = run
    prev = M.merge(M.step_dirs_of(d, [1, 2]), [0.5, 0.5], tmp_path / "prev", log=lambda s: None)
    before = _files(prev)

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "ling2.checkpoint.merge", f"--run_dir={d}", "--steps=2,3",
                        "--weights=0.5,0.5", f"--out={prev}"], env=env, capture_output=True, text=True,
                       preexec_fn=small_disk, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"error: merge: --out {prev}: cannot write the merged checkpoint: "
                                                "File too large"), r.stderr
    assert {n: b for n, b in _files(prev).items() if not str(n).startswith(".")} == before
