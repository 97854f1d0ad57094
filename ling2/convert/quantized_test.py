"""FP8 Hugging Face checkpoints (compressed-tensors float-quantized; the "fp8" method's weight_scale_inv blocks)
convert as the float32 weights they stand for.

Reference: torch. The FP8 checkpoints are written by safetensors.torch from torch float8_e4m3fn tensors, and the
weights they stand for are computed by torch (float8 -> float32 times the scale, repeated by
repeat_interleave); the same HF checkpoint holding those float32 weights must convert to the same Ling2 state,
bit for bit.
"""

import json

import numpy as np
import pytest
import safetensors.torch
import torch

from ling2.checkpoint import state as ckpt_state
from ling2.checkpoint.safetensors_io import ShardedReader, ShardedWriter
from ling2.config import load_config
from ling2.convert import hf_to_ling2
from ling2.convert.testing.hf_fixtures import write_random_hf


@pytest.fixture(scope="module")
def hf_fp32(tmp_path_factory):
    """A random float32 HF checkpoint of ling2-tiny: (its directory, {name: array})."""
    d = tmp_path_factory.mktemp("hf32")
    return d, write_random_hf(d, load_config(model_name="ling2-tiny"))


def _quantized(name: str, a: np.ndarray) -> bool:
    """The Linear weights an FP8 release quantizes (not embeddings, norms, the router or the LM head)."""
    return a.ndim == 2 and name.endswith(".weight") and not any(
        s in name for s in ("embed", "norm", "lm_head", ".gate.weight", "word_embeddings"))


def _scale_for(w: torch.Tensor, strategy: str, block=(48, 40), group=32) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale in its stored shape, the scale repeated over w's shape) with amax / 448 per covered part."""
    out, inp = w.shape
    a = w.abs()
    if strategy == "tensor":
        s = (a.max() / 448).reshape(1)
        return s, s.expand(out, inp)
    if strategy == "channel":
        s = a.amax(dim=1, keepdim=True) / 448
        return s, s.expand(out, inp)
    rows, cols = (1, group) if strategy == "group" else block
    nr, nc = -(-out // rows), -(-inp // cols)
    padded = torch.zeros(nr * rows, nc * cols)
    padded[:out, :inp] = a
    s = padded.reshape(nr, rows, nc, cols).amax(dim=(1, 3)) / 448 + 1e-12
    full = s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:out, :inp]
    return (s.reshape(out, nc) if strategy == "group" else s), full


def _write_fp8(src: dict, out, hf_config_json: dict, quant: dict, strategy: str, scale_name: str) -> dict:
    """An FP8 copy of the HF checkpoint `src` ({name: float32 array}) in `out`; returns {name: the float32 weight
    each quantized tensor stands for} (torch's arithmetic)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors, meant = {}, {}
    for name, a in src.items():
        if not _quantized(name, a):
            tensors[name] = torch.from_numpy(np.ascontiguousarray(a))
            continue
        w = torch.from_numpy(np.ascontiguousarray(a))
        scale, full = _scale_for(w, strategy)
        q = (w / full).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + scale_name] = q, scale.to(torch.float32)
        meant[name] = (q.to(torch.float32) * full).numpy()
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**hf_config_json, "quantization_config": quant}))
    return meant


def _compressed(strategy, **extra):
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy, **extra}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                                                "strategy": "token"}}},
            "ignore": ["lm_head"]}


SCHEMES = {
    "compressed_tensors_channel": (_compressed("channel"), "channel", "_scale"),
    "compressed_tensors_tensor": (_compressed("tensor"), "tensor", "_scale"),
    "compressed_tensors_group": (_compressed("group", group_size=32), "group", "_scale"),
    "compressed_tensors_block": (_compressed("block", block_structure=[48, 40]), "block", "_scale"),
    "fp8_weight_scale_inv": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [48, 40]}, "block", "_scale_inv"),
}


@pytest.mark.parametrize("case", SCHEMES)
def test_fp8_checkpoint_converts_as_the_weights_it_stands_for(tmp_path, hf_fp32, case):
    """Blocks of 48 x 40 leave ragged blocks at the edges of every 64- and 128-wide weight."""
    d, src = hf_fp32
    quant, strategy, scale_name = SCHEMES[case]
    hf_json = json.loads((d / "config.json").read_text())
    meant = _write_fp8(src, tmp_path / "fp8", hf_json, quant, strategy, scale_name)
    assert len(meant) > 20
    w = ShardedWriter(tmp_path / "ref", shard_bytes=1 << 20)  # the same checkpoint in float32
    for name, a in src.items():
        w.add(name, meant.get(name, a))
    w.close()
    (tmp_path / "ref" / "config.json").write_text(json.dumps(hf_json))
    for src_dir, out in (("fp8", "l2_fp8"), ("ref", "l2_ref")):
        assert hf_to_ling2.main(["--hf_dir", str(tmp_path / src_dir), "--out", str(tmp_path / out),
                                 "--no_progress"]) == 0
    got, want = ShardedReader(tmp_path / "l2_fp8" / "state"), ShardedReader(tmp_path / "l2_ref" / "state")
    assert got.names() == want.names()
    for n in want.names():
        np.testing.assert_array_equal(got.read(n), want.read(n), err_msg=n)
    cfg = ckpt_state.read_config(tmp_path / "l2_fp8" / ckpt_state.CONFIG_NAME)
    assert cfg == ckpt_state.read_config(tmp_path / "l2_ref" / ckpt_state.CONFIG_NAME)
    some = next(n for n in meant if "experts" in n)  # and the float8 rounding is really there
    assert not np.array_equal(meant[some], src[some])
    if case == "compressed_tensors_channel":  # generate's loader reads the FP8 directory the same way
        import jax
        from flax import nnx

        from ling2.infer.load import load_model

        got, want = (nnx.to_pure_dict(nnx.state(load_model(tmp_path / d).model)) for d in ("fp8", "ref"))
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _fp8_dir(tmp_path, hf_fp32, edit_tensors=None, quant=None):
    d, src = hf_fp32
    hf_json = json.loads((d / "config.json").read_text())
    out = tmp_path / "bad"
    _write_fp8(src, out, hf_json, quant or _compressed("channel"), "channel", "_scale")
    if edit_tensors:
        t = safetensors.torch.load_file(str(out / "model.safetensors"))
        edit_tensors(t)
        safetensors.torch.save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _expert(t):
    return next(n for n in sorted(t) if "experts.1.down_proj.weight" in n and not n.endswith("_scale"))


def _no_quant_config(out):
    hf = json.loads((out / "config.json").read_text())
    del hf["quantization_config"]
    (out / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("case,edit,quant,message", [
    ("scale missing", lambda t: t.pop(_expert(t) + "_scale"), None,
     r"tensor model\.layers\.\d+\.mlp\.experts\.1\.down_proj\.weight is float8_e4m3fn without its scale"),
    ("scale of another shape", lambda t: t.update({_expert(t) + "_scale": torch.ones(3, 1)}), None,
     r"scale \S+experts\.1\.down_proj\.weight_scale has shape \(3, 1\), the channel scheme of \S+ \(\d+, \d+\) "
     r"needs \(\d+, 1\)"),
    ("scale not finite", lambda t: t[_expert(t) + "_scale"].__setitem__((2, 0), float("nan")), None,
     r"tensor \S+experts\.1\.down_proj\.weight holds \d+ NaN or Inf values?, the first at index \[2, 0\]"),
    ("an unread method", None, {"quant_method": "gptq", "bits": 4},
     r"config\.json: quantization_config\.quant_method 'gptq' is not read"),
    ("integer weights", None, {**_compressed("channel"), "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}}},
     r"only symmetric 8-bit float weights are read, got type 'int', num_bits 4"),
])
def test_fp8_checkpoints_that_cannot_be_read_right_are_refused(tmp_path, hf_fp32, capsys, case, edit, quant, message):
    """A float8 weight without its scale, a scale that does not cover its weight, a scale that is not finite,
    and a quantization Ling2 does not read: exit 2, one message naming the file and the tensor or field."""
    import re

    out = _fp8_dir(tmp_path, hf_fp32, edit)
    if quant is not None:
        hf = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**hf, "quantization_config": quant}))
    assert hf_to_ling2.main(["--hf_dir", str(out), "--out", str(tmp_path / "l2"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err
    assert not (tmp_path / "l2" / "state").exists()


def test_float8_tensors_without_a_quantization_config_are_refused(tmp_path, hf_fp32, capsys):
    """Float8 values are not the weights without their scales: a checkpoint holding them with no
    quantization_config is refused, never converted as if the scales were 1."""
    out = _fp8_dir(tmp_path, hf_fp32)
    _no_quant_config(out)
    assert hf_to_ling2.main(["--hf_dir", str(out), "--out", str(tmp_path / "l2"), "--no_progress"]) == 2
    assert "is float8_e4m3fn, but " in capsys.readouterr().err
