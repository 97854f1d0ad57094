"""One model saved four ways (trainer run and step directory, Ling2 state directory, Hugging Face
directory written by the converter) loads back to the same logits as the model itself (scanned
when saved, unscanned when loaded), and bad checkpoint directories get named errors."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.checkpoint.manager import Checkpointer, saved_config
from ling2.checkpoint.state import save_state
from ling2.config import load_config, to_yaml
from ling2.convert import convert
from ling2.convert.testing.hf_fixtures import mtp_names, write_random_hf
from ling2.infer.load import InferError, hf_stop_ids, kind_of, load_model
from ling2.infer.testing.models import LING3_MICRO, MICRO
from ling2.layers.model import Ling2Model
from ling2.train.optim import make_optimizer
from ling2.train.state import trainable_filter
from ling2.layers.spec import ModelSpec


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpts")
    cfg = load_config(MICRO, base_num_decoder_layers=4, scan_layers=True, async_checkpointing=False)
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(3))
    _, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    tx, _ = make_optimizer(cfg, params)
    zero = np.zeros((), np.int32)
    fields = dict(step=zero, params=params, rest=rest, opt_state=tx.init(params), skipped=zero, skipped_total=zero)
    ckpt = Checkpointer(tmp / "run" / "checkpoints", cfg)
    ckpt.save(4, fields, None, {"step": 4}, force=True)
    ckpt.save(7, fields, None, {"step": 7}, force=True)
    ckpt.close()
    save_state(tmp / "state", nnx.to_pure_dict(nnx.state(model)), cfg)
    convert.convert_ling2_to_hf(tmp / "state", tmp / "hf", progress=False)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    want = np.asarray(nnx.jit(lambda m, x: m(x).logits)(model, ids))
    return tmp, cfg, ids, want


@pytest.mark.parametrize("where,kind", [("run", "run"), ("run/checkpoints/4", "step"), ("state", "state"),
                                        ("hf", "hf")])
def test_every_layout_loads_the_same_model(saved, where, kind):
    tmp, cfg, ids, want = saved
    loaded = load_model(tmp / where)
    assert loaded.kind == kind
    if where == "run":
        assert loaded.path == tmp / "run" / "checkpoints" / "7"  # the latest step
    assert not loaded.cfg.scan_layers and loaded.cfg.sparse_matmul
    assert loaded.stop_ids == (cfg.eod_id,)  # HF: the written config.json's eos_token_id
    got = np.asarray(nnx.jit(lambda m, x: m(x).logits)(loaded.model, ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_trainer_step_records_its_config(saved):
    tmp, cfg, *_ = saved
    assert saved_config(tmp / "run" / "checkpoints" / "7") == cfg


def test_step_without_a_recorded_config_uses_the_run_config_or_says_so(saved, tmp_path):
    tmp, cfg, ids, want = saved
    step = tmp_path / "run" / "checkpoints" / "7"
    shutil.copytree(tmp / "run" / "checkpoints" / "7", step)
    shutil.rmtree(step / "config")
    with pytest.raises(InferError, match="no saved config"):
        load_model(step)
    (tmp_path / "run" / "config.yml").write_text(to_yaml(cfg))
    got = np.asarray(nnx.jit(lambda m, x: m(x).logits)(load_model(tmp_path / "run").model, ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_damaged_step_is_refused_and_a_run_falls_back_to_its_last_whole_step(saved, tmp_path, capfd):
    """A byte of a step's state changed after its save (the trainer's checksums no longer match): generate, the
    converter and merge name the file instead of reading wrong weights; a run directory whose latest step is
    damaged loads the step before it, as a resumed run would."""
    from ling2.checkpoint.merge import merge
    from ling2.checkpoint.state import CheckpointError

    tmp, cfg, ids, want = saved
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    step7 = run / "checkpoints" / "7"
    victim = max((f for f in (step7 / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(InferError, match="checksum mismatch"):
        load_model(step7)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        convert.convert_ling2_to_hf(step7, tmp_path / "hf", progress=False)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        merge([step7, run / "checkpoints" / "4"], [0.5, 0.5], tmp_path / "merged", log=lambda *a: None)
    loaded = load_model(run)
    assert loaded.path == run / "checkpoints" / "4"
    assert "step 7 passed over" in capfd.readouterr().err
    got = np.asarray(nnx.jit(lambda m, x: m(x).logits)(loaded.model, ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # both steps saved the same weights


def test_bad_directories_are_named(saved, tmp_path):
    tmp, *_ = saved
    with pytest.raises(InferError, match="no such directory"):
        kind_of(tmp_path / "missing")
    with pytest.raises(InferError, match="not a checkpoint"):
        kind_of(tmp_path)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    with pytest.raises(InferError, match="no finished checkpoint"):
        load_model(tmp_path / "r")
    with pytest.raises(InferError, match="does not match the config"):
        load_model(tmp / "state", "base_emb_dim=32")


def test_hf_ling3_without_mtp_tensors_loads_without_mtp(tmp_path, capfd):
    """transformers saves a Ling 3 model with no MTP tensors while its config.json still declares MTP
    layers: it loads without MTP, says so in one line, and is the model its main tensors make;
    --speculative_mtp (need_mtp) is a named error instead."""
    cfg = load_config(LING3_MICRO)
    write_random_hf(tmp_path / "hf", cfg, "bailing_hybrid", drop=mtp_names(cfg, "bailing_hybrid"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    capfd.readouterr()
    loaded = load_model(tmp_path / "hf")
    err = capfd.readouterr().err
    assert loaded.cfg.mtp_num_layers == 0 and loaded.model.mtp is None
    notes = [line for line in err.splitlines() if "MTP" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ") and "loading without MTP" in notes[0], err
    plain = load_model(tmp_path / "hf", "mtp_num_layers=0")  # the same main weights, nothing to note
    assert "MTP" not in capfd.readouterr().err
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    fwd = nnx.jit(lambda m, x: m(x).logits)
    np.testing.assert_array_equal(np.asarray(fwd(loaded.model, ids)), np.asarray(fwd(plain.model, ids)))
    with pytest.raises(InferError, match=r"--speculative_mtp: .* has no MTP weights: config.json declares 1 MTP"):
        load_model(tmp_path / "hf", need_mtp=True)


def test_hf_stop_ids_follow_generation_config_then_config(tmp_path):
    assert hf_stop_ids(tmp_path, {}) == ()
    assert hf_stop_ids(tmp_path, {"eos_token_id": 9}) == (9,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert hf_stop_ids(tmp_path, {"eos_token_id": 9}) == (5, 7)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(InferError, match="generation_config.json: malformed JSON"):
        hf_stop_ids(tmp_path, {})


@pytest.mark.parametrize("text,message", [
    (b'{"eos_token_id": "abc"}', "generation_config.json: eos_token_id must be a token id or a list of them, "
                                 "got 'abc'"),
    (b'{"eos_token_id": [2, null]}', "generation_config.json: eos_token_id must be a token id or a list of them, "
                                     "got [2, None] (None is not a token id)"),
    (b'{"eos_token_id": [2, -1]}', "(-1 is not a token id)"),
    (b"[1, 2]", "generation_config.json: top level must be a JSON object, got list"),
    (b'{"eos_token_id": 2, "x": "\xff"}', "generation_config.json: not UTF-8 (byte 0xff at offset 26)"),
])
def test_a_bad_generation_config_names_the_file_and_field(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_bytes(text)
    with pytest.raises(InferError) as e:
        hf_stop_ids(tmp_path, {"eos_token_id": 9})
    assert message in str(e.value)


def test_a_bad_eos_token_id_in_config_json_is_named(tmp_path):
    with pytest.raises(InferError, match=r"config.json: eos_token_id must be .* got True"):
        hf_stop_ids(tmp_path, {"eos_token_id": True})


@pytest.mark.parametrize("where", ["run", "run/checkpoints/7"])
def test_a_step_is_checksummed_once(saved, where, monkeypatch):
    """Loading reads each state file once for its checksum, also when a run directory's latest step was just
    picked by verifying it (a 1T model's state is terabytes)."""
    from ling2.checkpoint import manager

    tmp, *_ = saved
    seen = []
    crc32 = manager.crc32
    monkeypatch.setattr(manager, "crc32", lambda path: seen.append(path) or crc32(path))
    load_model(tmp / where)
    state = tmp / "run" / "checkpoints" / "7" / "state"
    assert seen and len(seen) == len(set(seen)) and all(state in p.parents for p in seen), seen
