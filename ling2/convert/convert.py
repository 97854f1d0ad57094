"""HF safetensors <-> Ling2 state directories, tensor by tensor, never the whole model in memory.

A Ling2 state directory (config.yml + state/, one safetensors tensor per leaf) is the format of
`ling2.checkpoint.state`; trainer step directories are read through it too. hf_to_ling2 lays out
every header first, then reads each HF tensor once (a view of the mapped file) and writes its
Ling2 block (one expert, one scan group) straight to its file offset, in file order; ling2_to_hf
reads each block back alone and writes HF shards the same way (see
`ling2.checkpoint.safetensors_io` for the threads and buffers). Peak memory is about one HF tensor
plus a few small buffers, whatever the model size (a trainer step directory is still restored whole
by orbax).
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from ling2.checkpoint.manager import saved_config
from ling2.checkpoint.safetensors_io import (INDEX_NAME, SINGLE_NAME, PlannedWriter, SafetensorsError, ShardedReader,
                                             is_float, count_beyond, overflow_limit)
from ling2.checkpoint.state import (CONFIG_NAME, CheckpointError, STATE_NAME, check_shapes, finish_interrupted_save,
                                    flat, key, load_state, model_leaves, read_config, state_writer, unflat)
from ling2.config import ConfigError
from ling2.convert import hf_config, mapping, quantized
from ling2.layers.mtp import MTP
from ling2.layers.spec import ModelSpec


class ConversionError(ValueError):
    """Tensors that do not fit the model; the message lists every offender with both shapes."""


# Bad input (files, configs, flags) a converter CLI reports in one message and exits 2 for.
USER_ERRORS = (ConversionError, hf_config.HFConfigError, CheckpointError, ConfigError, SafetensorsError, OSError)


def report(e: BaseException) -> int:
    """Prints a user error as `error: Type: message` on stderr; the exit status (2)."""
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


HF_CODE = "hf_code"  # a state directory's copy of the source's remote-code modules (auto_map)


def read_hf_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ConversionError(f"{hf_dir}: not a directory")
    if not path.is_file():
        raise ConversionError(f"{path}: not found")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: malformed JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: top level must be a JSON object, got {type(hf).__name__}")
    return hf


def open_hf(hf_dir, hf: dict):
    """The tensors of an HF directory: a ShardedReader, wrapped in `quantized.Dequantized` when its config.json
    declares FP8 weights (read as weight x scale). ConversionError naming config.json for a quantization Ling2
    does not read."""
    try:
        how = quantized.scheme(hf)
    except ValueError as e:
        raise ConversionError(f"{Path(hf_dir) / 'config.json'}: {e}") from None
    reader = ShardedReader(hf_dir)
    if how is None:
        f8 = [n for n in reader.names() if reader.dtype(n).name in quantized.FLOAT8]
        if f8:  # their values mean nothing without the scales a quantization_config says how to apply
            raise ConversionError(f"{reader.path(f8[0])}: tensor {f8[0]} (and {len(f8) - 1} more) is "
                                  f"{reader.dtype(f8[0]).name}, but {Path(hf_dir) / 'config.json'} has no "
                                  "quantization_config saying how its scales apply")
        return reader
    return quantized.Dequantized(reader, how)


def auto_map_modules(hf: dict) -> list[str]:
    """The remote-code files a config.json's auto_map names (e.g. modeling_bailing_moe_v2_5.py)."""
    refs = (hf.get("auto_map") or {}).values() if isinstance(hf.get("auto_map"), dict) else ()
    return sorted({str(r).split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs if isinstance(r, str) and "." in r})


def _resolve(e, names: set):
    for n in (e.hf,) + e.aliases:
        if n in names:
            return n
    return None


def _castable(src, dst) -> bool:
    """Whether a checkpoint tensor of dtype `src` may fill a model leaf of dtype `dst`: float to float (any
    width, bf16 and fp8 included) is a cast; an integer or bool tensor where a float weight belongs is not a
    weight at all, and casting it would load made-up values."""
    floating = lambda d: jax.numpy.issubdtype(d, jax.numpy.floating)  # noqa: E731
    return floating(src) or not floating(dst)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def _check_counts(reader, cfg) -> None:
    """ConversionError when the config asks for more decoder layers, or more experts, than the checkpoint's
    tensor names hold (model.layers.N., mlp.experts.N.): found before the model's tensors are listed, which for
    a config.json claiming, say, 10^5 layers or 10^9 experts takes minutes and tens of GB."""
    layers = [int(m.group(1)) for n in reader.names() if (m := _LAYER.match(n))]
    experts = [int(m.group(1)) for n in reader.names() if (m := _EXPERT.search(n))]
    have = max(layers) + 1 if layers else 0
    if cfg.base_num_decoder_layers > have:
        raise ConversionError(f"{reader.dir}: the config has {cfg.base_num_decoder_layers} decoder layers (config.json "
                              f"num_hidden_layers), the checkpoint's tensors hold {have} (model.layers.N.*)")
    if experts and cfg.num_experts > max(experts) + 1:
        raise ConversionError(f"{reader.dir}: the config has {cfg.num_experts} routed experts per MoE layer "
                              f"(config.json num_experts / n_routed_experts), the checkpoint's tensors "
                              f"hold {max(experts) + 1} (mlp.experts.N.*)")


def _plan(reader, cfg, layout: str, allow_missing_mtp: bool):
    """(leaves, [(entry, HF name)], skip_mtp) after checking `reader` against the model.

    Raises ConversionError listing every missing, unexpected, mis-shaped and wrongly typed tensor.
    """
    _check_counts(reader, cfg)
    leaves = model_leaves(cfg)
    es = mapping.entries(cfg, layout, {p: v.shape for p, v in leaves.items()})
    names = set(reader.names())
    found = {e: _resolve(e, names) for e in es}
    missing = [e for e in es if found[e] is None]
    skip_mtp = allow_missing_mtp and any(e.mtp for e in es) and all(found[e] is None for e in es if e.mtp)
    if skip_mtp:
        missing = [e for e in missing if not e.mtp]
    used = {n for n in found.values() if n is not None}
    unexpected = sorted(n for n in names - used if not mapping.ignorable(n, layout, cfg))
    bad = [(e, found[e]) for e in es if found[e] is not None
           and reader.shape(found[e]) != mapping.hf_shape(e, leaves[e.path].shape)]
    typed = [(e, found[e]) for e in es if found[e] is not None and not _castable(reader.dtype(found[e]),
                                                                                 leaves[e.path].dtype)]
    if missing or unexpected or bad or typed:
        lines = [f"  missing: {e.hf} expected {mapping.hf_shape(e, leaves[e.path].shape)}, checkpoint has none"
                 for e in missing]
        lines += [f"  unexpected: {n} checkpoint {reader.shape(n)}, model has none" for n in unexpected]
        lines += [f"  mis-shaped: {n} checkpoint {reader.shape(n)} vs expected "
                  f"{mapping.hf_shape(e, leaves[e.path].shape)}" for e, n in bad]
        lines += [f"  wrong dtype: {n} checkpoint {reader.dtype(n)} vs expected {np.dtype(leaves[e.path].dtype)} "
                  "(only floating-point tensors are weights)" for e, n in typed]
        hint = "" if allow_missing_mtp or not any(e.mtp for e in missing) else " (--allow_missing_mtp skips MTP)"
        wrong = f", {len(typed)} of a wrong dtype" if typed else ""
        raise ConversionError(f"{reader.dir}: checkpoint does not match the {layout} layout of the config "
                              f"({len(missing)} missing, {len(unexpected)} unexpected, {len(bad)} mis-shaped"
                              f"{wrong}){hint}:\n" + "\n".join(lines))
    return leaves, [(e, found[e]) for e in es if found[e] is not None], skip_mtp


def mtp_absent(reader, cfg, layout: str) -> bool:
    """True when `cfg` has MTP layers and `reader` holds none of their tensors: what transformers'
    `save_pretrained` writes for a Ling 3 model (its BailingHybridForCausalLM has no MTP modules)."""
    _check_counts(reader, cfg)
    leaves = model_leaves(cfg)
    es = [e for e in mapping.entries(cfg, layout, {p: v.shape for p, v in leaves.items()}) if e.mtp]
    names = set(reader.names())
    return bool(es) and all(_resolve(e, names) is None for e in es)


def _not_finite(where: str, name: str, bad: tuple, src, dst) -> ConversionError:
    """The error for `bad` = (count, first index, its value) of tensor `name` cast from dtype `src` to `dst`."""
    count, index, value = bad
    what = "NaN or Inf value" + ("s" if count > 1 else "")
    if overflow_limit(src, dst) != overflow_limit(src, src):
        what = (f"value{'s' if count > 1 else ''} not finite in {np.dtype(dst).name} (NaN, Inf, or beyond its "
                f"largest, {float(ml_dtypes.finfo(dst).max):g})")
    return ConversionError(f"{where}: tensor {name} holds {count} {what}, the first at index {list(index)}: {value}")


def check_finite(reader, name: str, dtype) -> None:
    """Raises ConversionError naming the file, the tensor and the first place when a weight holds NaN or Inf, or
    a value that becomes Inf once cast to `dtype` (float32 -> float16 above 65504): such a checkpoint is damaged
    or does not fit the asked dtype, and a model built from it trains or generates nothing but NaN."""
    bad = reader.nonfinite(name, cast=dtype)
    if bad is not None:
        raise _not_finite(str(reader.path(name)), name, bad, reader.dtype(name), dtype)


def _hf_to_sink(reader, cfg, layout, sink, allow_missing_mtp, progress, plan=None) -> None:
    """Reads every HF tensor once, checks it is finite and hands its Ling2 block to `sink.add(key, block, index)`."""
    leaves, todo, skip_mtp = plan or _plan(reader, cfg, layout, allow_missing_mtp)
    rank = {p: i for i, p in enumerate(dict.fromkeys(e.path for e, _ in todo))}  # the order _state_writer plans
    todo = sorted(todo, key=lambda t: (rank[t[0].path], t[0].index))  # so blocks arrive in file order
    checked = set()
    for e, name in tqdm(todo, desc="hf->ling2", unit="tensor", disable=not progress):
        leaf = leaves[e.path]
        if name not in checked:
            checked.add(name)
            check_finite(reader, name, leaf.dtype)
        sink.add(key(e.path), mapping.to_ling2(e, reader.read(name, copy=False), leaf.shape), e.index)
    if skip_mtp:
        mtp = nnx.jit(lambda: MTP(ModelSpec.of(cfg), rngs=nnx.Rngs(cfg.seed)))()  # one compile, not one per op
        for p, v in flat(nnx.to_pure_dict(nnx.state(mtp))).items():
            sink.add(key(("mtp",) + p), np.asarray(v))


class _ArraySink:
    """Preallocated numpy leaves filled block by block (the in-memory twin of PlannedWriter)."""

    def __init__(self, leaves: dict):
        self.arrays = {key(p): np.empty(v.shape, v.dtype) for p, v in leaves.items()}

    def add(self, key, x, index=()):
        self.arrays[key][index] = x


def hf_to_state(reader, cfg, layout: str, allow_missing_mtp: bool = False, progress: bool = True) -> dict:
    """The pure-dict Ling2 state (numpy leaves) read from `reader` in `layout`, all in memory.

    Raises ConversionError listing every missing, unexpected, mis-shaped and wrongly typed tensor. With
    `allow_missing_mtp`, a checkpoint with none of the MTP tensors loads; the MTP layers
    keep their seeded initial values.
    """
    plan = _plan(reader, cfg, layout, allow_missing_mtp)
    sink = _ArraySink(plan[0])
    _hf_to_sink(reader, cfg, layout, sink, allow_missing_mtp, progress, plan)
    return unflat({p: sink.arrays[key(p)] for p in plan[0]})


def hf_specs(cfg, layout: str, dtype=None) -> list:
    """[(HF name, shape, dtype)] of every tensor `state_to_hf` writes, in its order."""
    leaves = model_leaves(cfg)
    return [(e.hf, mapping.hf_shape(e, leaves[e.path].shape), np.dtype(leaves[e.path].dtype if dtype is None else dtype))
            for e in mapping.entries(cfg, layout, {p: v.shape for p, v in leaves.items()})]


def state_to_hf(state, cfg, layout: str, writer, progress: bool = True, dtype=None) -> None:
    """Writes every HF tensor through `writer.add(name, array)`, one at a time (views; the writer casts to
    `dtype`, default each leaf's own), after checking each leaf is finite in that dtype (`check_finite`).

    `state` is a pure-dict Ling2 state (either key type) or a ShardedReader over a converter
    `state/` directory, from which each block is read only when it is written.
    """
    leaves = model_leaves(cfg)
    es = mapping.entries(cfg, layout, {p: v.shape for p, v in leaves.items()})
    if isinstance(state, ShardedReader):
        check_shapes({tuple(n.split("/")): state.shape(n) for n in state.names()}, leaves, str(state.dir))
        block = lambda e: state.read(key(e.path), e.index, copy=False)  # noqa: E731
        check = lambda e, to: check_finite(state, key(e.path), to)  # noqa: E731
    else:
        items = {tuple(map(str, p)): v for p, v in flat(state).items()}
        check_shapes({p: np.shape(v) for p, v in items.items()}, leaves, "state")
        block = lambda e: np.asarray(items[tuple(map(str, e.path))][e.index])  # noqa: E731

        def check(e, to):
            x = np.asarray(items[tuple(map(str, e.path))])
            if is_float(x.dtype) and (bad := count_beyond(x, overflow_limit(x.dtype, to)))[0]:
                index = tuple(int(j) for j in np.unravel_index(bad[1], x.shape))
                raise _not_finite("state", key(e.path), (bad[0], index, float(x[index])), x.dtype, to)
    checked = set()
    for e in tqdm(es, desc="ling2->hf", unit="tensor", disable=not progress):
        if e.path not in checked:
            checked.add(e.path)
            check(e, leaves[e.path].dtype if dtype is None else dtype)
        writer.add(e.hf, mapping.to_hf(e, block(e), leaves[e.path].shape))


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


def convert_hf_to_ling2(hf_dir, out_dir, *, scan_layers: bool = False, dtype: str = "fp32", layout: str = "auto",
                        allow_missing_mtp: bool = False, overrides=(), progress: bool = True):
    """HF directory -> Ling2 checkpoint directory; returns the Ling2 config."""
    hf = read_hf_config(hf_dir)
    if Path(out_dir).resolve() == Path(hf_dir).resolve():
        raise ConversionError(f"--out {out_dir}: is the HF directory converted (--hf_dir); the Ling2 checkpoint "
                              "written beside its shards would make it two checkpoints in one; choose another")
    layout = hf_config.detect_layout(hf) if layout == "auto" else layout
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype: unknown {dtype!r} (known: {sorted(DTYPES)})")
    cfg = hf_config.load_ling2_config(
        hf, layout, {"scan_layers": scan_layers, "weight_dtype": DTYPES[dtype], "dtype": DTYPES[dtype]}, *overrides)
    reader = open_hf(hf_dir, hf)
    plan = _plan(reader, cfg, layout, allow_missing_mtp)
    try:
        writer = state_writer(out_dir, cfg, [e.path for e, _ in plan[1]])
        reader.map_pages = writer.lib is None  # the native writer maps and drops each block's pages itself
        with writer:  # a tensor found damaged on the way: nothing half-written left to load
            _hf_to_sink(reader, cfg, layout, writer, allow_missing_mtp, progress, plan)
            writer.close()
        code = [Path(hf_dir) / m for m in auto_map_modules(hf) if (Path(hf_dir) / m).is_file()]
        if code:
            (Path(out_dir) / HF_CODE).mkdir(exist_ok=True)
            for f in code:
                shutil.copyfile(f, Path(out_dir) / HF_CODE / f.name)
    except OSError as e:
        raise _write_error(out_dir, e) from None
    return cfg


def _write_error(out_dir, e: OSError) -> ConversionError:
    """The error for a write into the output directory that the file system refused (a full disk, a quota)."""
    return ConversionError(f"{out_dir}: cannot write the converted checkpoint: {e.strerror or e}"
                           + (f" ({e.filename})" if e.filename else ""))


def convert_ling2_to_hf(ckpt_dir, out_dir, *, layout: str = "auto", config=None, dtype: str = "",
                        shard_bytes: int = 2 << 30, progress: bool = True) -> dict:
    """Ling2 checkpoint directory -> HF directory (shards, index, config.json); returns the index.

    The config is `config` (a YAML file), else the one saved with the checkpoint (a state directory's
    config.yml, a trainer step's `config` item). Remote-code modules kept by hf_to_ling2 are copied
    next to config.json."""
    saved = Path(ckpt_dir) / CONFIG_NAME
    if dtype and dtype not in DTYPES:
        raise ConversionError(f"--dtype: unknown {dtype!r} (known: {sorted(DTYPES)})")
    if not Path(ckpt_dir).is_dir():
        raise ConversionError(f"{ckpt_dir}: not a directory")
    finish_interrupted_save(ckpt_dir)
    source = (Path(ckpt_dir) / STATE_NAME).resolve()
    if source in [Path(out_dir).resolve(), *Path(out_dir).resolve().parents]:
        raise ConversionError(f"--out {out_dir}: is in the checkpoint's own {source}; the HF shards, named as its "
                              "own, would replace the tensors converted; choose another directory")
    if (Path(out_dir) / SINGLE_NAME).exists():
        raise ConversionError(f"--out {out_dir}: holds {SINGLE_NAME}, which loaders (transformers among them) read "
                              f"in place of the sharded checkpoint written; remove it or choose another directory")
    cfg = read_config(config) if config else saved_config(ckpt_dir)
    if (Path(ckpt_dir) / STATE_NAME / INDEX_NAME).is_file() and (
            config is None or not saved.is_file() or read_config(saved).scan_layers == cfg.scan_layers):
        state = ShardedReader(Path(ckpt_dir) / STATE_NAME)  # streamed: one block in memory at a time
    else:
        state = load_state(ckpt_dir, cfg)
    np_dtype = np.dtype(jax.numpy.dtype(DTYPES[dtype])) if dtype else None
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a directory")
    stage = out / HF_PARTIAL
    try:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)  # left by a killed conversion
        stage.mkdir()
    except OSError as e:
        raise ConversionError(f"{out}: cannot create the output directory: {e.strerror}") from None
    layout = hf_config.layout_for(cfg) if layout == "auto" else layout
    hf = hf_config.config_to_hf(cfg, layout, DTYPES[dtype] if dtype else "")
    try:
        writer = PlannedWriter(stage, hf_specs(cfg, layout, np_dtype), shard_bytes)
        if isinstance(state, ShardedReader):
            state.map_pages = writer.lib is None  # the native writer maps and drops each block's pages itself
        with writer:  # no half-written shards left to load
            state_to_hf(state, cfg, layout, writer, progress, np_dtype)
            index = writer.close()
        (stage / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        for f in sorted((Path(ckpt_dir) / HF_CODE).glob("*.py")):
            shutil.copyfile(f, stage / f.name)
        _publish_hf(stage, out)
    except OSError as e:
        raise _write_error(out, e) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return index


HF_PARTIAL = ".ling2_to_hf.partial"  # where ling2_to_hf writes before anything in the output directory changes


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_hf(stage: Path, out: Path) -> None:
    """Moves a finished HF checkpoint from `stage` into `out`, whose previous checkpoint stays loadable until
    the first rename. Every file is synced first; the old index goes first (with the shards it names that the
    new one does not overwrite) and the new index comes last, so a kill or a crash in between leaves shards
    without an index, which no loader takes for a whole checkpoint, never new shards under the old index or
    old config.json."""
    files = sorted(p.name for p in stage.iterdir())
    for name in files:
        _fsync(stage / name)
    old_index = out / INDEX_NAME
    stale = []
    if old_index.is_file():
        try:
            stale = sorted(set(map(str, json.loads(old_index.read_text())["weight_map"].values())))
        except (ValueError, KeyError, TypeError, AttributeError):
            stale = []  # a malformed old index: its shards are not known, only it is replaced
        old_index.unlink()
    for name in stale:
        if name not in files and "/" not in name and name.endswith(".safetensors"):
            (out / name).unlink(missing_ok=True)
    for name in files:
        if name != INDEX_NAME:
            os.replace(stage / name, out / name)
    _fsync(out)
    os.replace(stage / INDEX_NAME, old_index)
    _fsync(out)
