"""A Ling2Model for inference from any checkpoint directory Ling2 writes or reads.

`--ckpt` may be
  a trainer run directory ({run}: its latest step under checkpoints/),
  a trainer step directory ({run}/checkpoints/{step}: state/ + meta/, the config recorded in meta),
  a Ling2 state directory (config.yml + state/, the converter's output), or
  a Hugging Face directory (config.json + safetensors; converted in memory, computing in its
  torch_dtype, stopping at its eos_token_id). One whose config.json declares MTP layers but which
  holds none of their tensors (transformers saves a Ling 3 model so) loads without MTP, with a note
  on stderr.
The model is built unscanned (decode slices no stacked weights) and with the dropless MoE
(`INFER_OVERRIDES`); the weights are re-laid out when the checkpoint was scanned.
"""

import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.checkpoint.manager import saved_config, verify
from ling2.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsError
from ling2.checkpoint.state import (CONFIG_NAME, STATE_NAME, CheckpointError, check_shapes, finish_interrupted_save,
                                    flat, load_state, model_leaves, read_config, relayout)
from ling2.config import ConfigError, cli, load_config
from ling2.config.paths import user_path
from ling2.convert import convert, hf_config
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec

REPO = Path(os.path.abspath(__file__)).parents[2]  # the runfiles tree under Bazel

# Inference runs every layer unscanned, every MoE dropless (no capacity drops at any batch size).
INFER_OVERRIDES = {"scan_layers": False, "sparse_matmul": True, "remat_policy": "none",
                   "ici_context_parallelism": 1, "dcn_context_parallelism": 1}
CONTEXT_KEYS = ("ici_context_parallelism", "dcn_context_parallelism")


def refuse_context(overrides) -> None:
    """InferError for an override asking for context parallelism: it splits training sequences over
    devices; generation and evaluation run the model on one device (a checkpoint trained with a context
    axis loads with it set to 1)."""
    for o in overrides:
        items = o.items() if isinstance(o, dict) else [o.split("=", 1)] if "=" in o else []
        for key, value in items:
            if key.strip() in CONTEXT_KEYS and str(value).strip() not in ("1", "-1"):
                raise InferError(f"{key.strip()}={str(value).strip()}: context parallelism is for training "
                                 "(//ling2/train:train); generation and evaluation run on one device")


class InferError(ValueError):
    """Bad input to generation or evaluation (checkpoint, prompt, flag); the message names it. CLIs exit 2."""


def print_out(text: str) -> None:
    """Prints `text` to stdout and flushes it (`cli.print_out`); InferError naming stdout when the write fails (a
    redirect to a full disk), which would otherwise be a traceback."""
    try:
        cli.print_out(text)
    except OSError as e:
        name = getattr(sys.stdout, "name", "stdout")
        raise InferError(f"stdout ({name}): cannot write: {e.strerror or e}") from None


class Loaded(NamedTuple):
    cfg: object  # the inference config (INFER_OVERRIDES applied)
    model: Ling2Model
    kind: str  # "run", "step", "state" or "hf"
    path: Path  # the directory the weights came from
    stop_ids: tuple  # end-of-sequence ids: config.json's eos_token_id (HF), else (cfg.eod_id,)


def find_file(p: str) -> Path:
    """A user path if it exists, else the same path inside the repository (bundled data, tokenizer)."""
    up = user_path(p)
    return up if up.exists() or Path(p).is_absolute() else REPO / p


# A HF checkpoint computes in its own dtype (what transformers does with torch_dtype="auto").
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _token_ids(eos, where: str) -> tuple:
    """An eos_token_id value (an id, a list of ids or null) as a tuple; InferError naming `where` otherwise."""
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise InferError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r} ({bad[0]!r} is "
                         "not a token id)")
    return tuple(ids)


def hf_stop_ids(path: Path, hf: dict) -> tuple:
    """eos_token_id of generation_config.json (what transformers' generate stops at), else config.json's;
    InferError naming the file and the field when either is malformed."""
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            obj = json.loads(gen.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InferError(f"{gen}: not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
        except json.JSONDecodeError as e:
            raise InferError(f"{gen}: malformed JSON: {e}") from None
        if not isinstance(obj, dict):
            raise InferError(f"{gen}: top level must be a JSON object, got {type(obj).__name__}")
        if "eos_token_id" in obj:
            return _token_ids(obj["eos_token_id"], str(gen))
    return _token_ids(hf.get("eos_token_id"), str(path / "config.json"))


def latest_step_dir(run_dir: Path) -> Path:
    """{run}/checkpoints/{largest step whose state verifies}, the step a resumed run would start from; a later step
    that did not finish saving or was damaged is named on stderr and passed over."""
    steps = sorted((int(p.name), p) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit() and p.is_dir())
    for step, path in reversed(steps):
        reason = verify(path, items=(STATE_NAME,), whole=False)
        if reason is None:
            return path
        print(f"warning: --ckpt={run_dir}: step {step} passed over: {reason}", file=sys.stderr)
    raise InferError(f"--ckpt={run_dir}: a run directory with no finished checkpoint under checkpoints/")


def kind_of(path: Path) -> str:
    """Which of the four layouts `path` is (see the module doc); InferError when none."""
    if not path.exists():
        raise InferError(f"--ckpt={path}: no such directory")
    if not path.is_dir():
        raise InferError(f"--ckpt={path}: not a directory")
    try:
        finish_interrupted_save(path)
    except CheckpointError as e:
        raise InferError(f"--ckpt={e}") from None
    if (path / "config.json").is_file() and ((path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file()):
        return "hf"
    if (path / CONFIG_NAME).is_file() and (path / STATE_NAME).is_dir():
        return "state"
    if (path / STATE_NAME).is_dir() and (path / "meta").is_dir():
        return "step"
    if (path / "checkpoints").is_dir():
        return "run"
    raise InferError(f"--ckpt={path}: not a checkpoint: expected a trainer run directory (checkpoints/), a step "
                     f"directory (state/ and meta/), a Ling2 state directory ({CONFIG_NAME} and {STATE_NAME}/) or a "
                     f"Hugging Face directory (config.json and {INDEX_NAME} or {SINGLE_NAME})")


def step_config(step_dir: Path):
    """The resolved config a trainer step saved (`ling2.checkpoint.manager.saved_config`), else the
    run's {run}/config.yml."""
    try:
        return saved_config(step_dir)
    except CheckpointError as e:
        run_config = step_dir.parent.parent / CONFIG_NAME
        if run_config.is_file():
            return read_config(run_config)
        raise InferError(f"--ckpt={step_dir}: {e}, and {run_config} does not exist; write the run's resolved "
                         f"config there (`./bazelw run //ling2/config:show -- ...`)") from None


def _model(cfg, state: dict) -> Ling2Model:
    model = nnx.eval_shape(lambda: Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0)))
    graph_state = nnx.state(model)
    nnx.replace_by_pure_dict(graph_state, jax.tree.map(jnp.asarray, state))
    nnx.update(model, graph_state)
    return model


def _missing_mtp(path: Path, layers: int, need_mtp: bool) -> None:
    """For a HF checkpoint with none of the `layers` MTP layers' tensors its config.json declares: a
    one-line note that it loads without them, or with `need_mtp` an InferError naming --speculative_mtp."""
    declared = (f"config.json declares {layers} MTP layer(s) but the checkpoint holds none of their tensors "
                "(transformers does not save them)")
    if need_mtp:
        raise InferError(f"--speculative_mtp: {path} has no MTP weights: {declared}; generate without "
                         "--speculative_mtp, or from a checkpoint that has them")
    print(f"note: {path}: loading without MTP: {declared}", file=sys.stderr)


def load_model(ckpt, *overrides, progress: bool = False, need_mtp: bool = False) -> Loaded:
    """The model and config of checkpoint directory `ckpt`; `overrides` ("key=value" or mappings) apply
    to its config (model-shape changes fail with the checkpoint's mismatch error).

    A HF checkpoint without the MTP tensors its config.json declares loads with mtp_num_layers=0 (a
    note on stderr says so); with `need_mtp` (the caller drafts with MTP: --speculative_mtp) it is an
    InferError instead, raised before any weight is read."""
    refuse_context(overrides)
    path = Path(ckpt)
    kind = kind_of(path)
    step_dir = latest_step_dir(path) if kind == "run" else path
    try:
        if kind == "hf":
            hf = convert.read_hf_config(path)
            stop_ids = hf_stop_ids(path, hf)
            layout = hf_config.detect_layout(hf)
            dtype = HF_DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", ""))), "float32")
            cfg = hf_config.load_ling2_config(hf, layout, {"dtype": dtype}, *overrides, INFER_OVERRIDES)
            reader = convert.open_hf(path, hf)
            if convert.mtp_absent(reader, cfg, layout):
                _missing_mtp(path, cfg.mtp_num_layers, need_mtp)
                cfg = hf_config.load_ling2_config(hf, layout, {"dtype": dtype}, *overrides, INFER_OVERRIDES,
                                                  {"mtp_num_layers": 0})
            state = convert.hf_to_state(reader, cfg, layout, progress=progress)
            return Loaded(cfg, _model(cfg, state), kind, path, stop_ids)
        if kind == "state":
            saved, cfg = read_config(path / CONFIG_NAME), read_config(path / CONFIG_NAME, *overrides, INFER_OVERRIDES)
        else:
            saved = step_config(step_dir)
            cfg = load_config(saved.model_dump(mode="json"), *overrides, INFER_OVERRIDES)
        state = load_state(step_dir, saved, verified=kind == "run")  # latest_step_dir verified it
        same_layout = cfg.model_copy(update={"scan_layers": saved.scan_layers})
        check_shapes({p: np.shape(v) for p, v in flat(state).items()}, model_leaves(same_layout),
                     f"{step_dir} (with the overrides {list(overrides)})")
        if saved.scan_layers != cfg.scan_layers:
            state = relayout(state, saved, cfg)
    except (CheckpointError, ConfigError, convert.ConversionError, hf_config.HFConfigError, SafetensorsError) as e:
        raise InferError(f"--ckpt={step_dir}: {e}") from e
    return Loaded(cfg, _model(cfg, state), kind, step_dir, (cfg.eod_id,))
