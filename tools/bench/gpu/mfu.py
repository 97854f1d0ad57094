"""MFU of a one-GPU training step three ways (issue 36): the whole step, the step without its LM heads, and
a full-model figure extrapolated from per-layer times.

    python -m tools.bench.gpu.mfu --model ling2-1gpu --full_model ling2 --batch 8 --seq 4096 --repeats 5 \\
        --out FILE.json [key=value ...]

Every step is `jit(grad(objective))` over random tokens, the objective the trainer's (`ling2.train.step.forward`:
main CE, MTP, MoE aux), as `tools/bench/step` times it. The figures, each `FLOPs per token x tokens / s / peak`:
  whole      the step, with `training_flops_per_token(model)`;
  no_heads   the same step with the main and MTP LM heads (the [T, E] x [E, V] products and their CE) replaced
             by a stand-in loss on the final hidden states, with that count less the heads' FLOPs (`flop_split`);
  full_model `training_flops_per_token(full_model)` over an extrapolated step time: each layer kind of the two
             plans (GLA+MoE, MLA+MoE, KDA+MoE, the dense-MLP layer) timed alone forward+backward at the model's
             widths on the same batch, summed over the full model's plan (decoder and MTP layers), plus what the
             measured step spends outside its layers (heads = whole - no_heads; the rest = no_heads - its own
             layers' sum: embedding, final norms, MTP's eh_proj).
`peak` is the datasheet bf16 dense rate (989.4 TFLOP/s for H100 and H200 SXM); the measured bf16 8192^3
matmul rate is recorded beside it. Each phase (matmul, whole, no_heads, layers) compiles once, times
`repeats` runs after one warm-up, and rewrites the JSON, so a run cut short keeps its finished phases; a phase
that fails (e.g. out of memory) records its error and the rest still run. The CLI lets JAX's allocator take 95%
of the device (`XLA_PYTHON_CLIENT_MEM_FRACTION`, unless set; JAX's default 75% is short of ling2-1gpu's 8 rows on
an H100: tools/bench/gpu/plans_1gpu.json).
"""

import argparse
import functools
import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config.paths import replaced
from ling2.layers.moe import layer as moe
from ling2.layers.attention.registry import ATTENTION
from ling2.layers.plan import LayerSpec
from ling2.layers.spec import ModelSpec
from tools.bench.report import host_facts, matmul_rate, planned_bytes, results_path, time_round_robin

PEAK_BF16_FLOPS = 989.4e12  # H100 / H200 SXM, dense bf16
F32 = jnp.float32
PHASES = ("matmul", "whole", "no_heads", "layers")


# ---- FLOPs: one split of ling2.layers.model.training_flops_per_token ----

def layer_flops(cfg, attn: str, mlp: str, seq_len: int) -> float:
    """Training FLOPs per token (3 x forward) of one decoder layer of kinds (attn, mlp): its attention's and
    MLP's weight matmuls and its attention's token mixing, as `training_flops_per_token` counts them."""
    spec = ModelSpec.of(cfg)
    a, a_spec = ATTENTION[attn], spec.layers.attention_spec(attn)
    mlp_params = 3 * spec.emb_dim * spec.layers.mlp_dim if mlp == "dense" else moe.matmul_params(spec.layers.moe)
    return 3.0 * (2 * (a.matmul_params(a_spec) + mlp_params) + a.mixing_flops(a_spec, seq_len))


def flop_split(cfg, seq_len: int | None = None) -> dict:
    """Training FLOPs per token of `cfg` by where they run: {"layers": [FLOPs of each plan layer, decoder then
    MTP], "mtp_input": MTP's eh_proj, "heads": the main and MTP LM heads, "embedding": 0.0 (a lookup, not
    counted; nor are norms), "total": their sum (= training_flops_per_token), "no_heads": total - heads}."""
    S = seq_len or cfg.max_target_length
    D, K = cfg.base_emb_dim, cfg.mtp_num_layers
    layers = [layer_flops(cfg, spec.attn, spec.mlp, S) for spec in ModelSpec.of(cfg).plan.all()]
    mtp_input = 3.0 * 2 * K * 2 * D * D
    heads = 3.0 * 2 * (1 + K) * D * cfg.vocab_size
    total = sum(layers) + mtp_input + heads
    return {"layers": layers, "mtp_input": mtp_input, "heads": heads, "embedding": 0.0, "total": total,
            "no_heads": total - heads}


# ---- the step, with and without heads ----

def load(model_name: str, seq: int, overrides: dict | None = None):
    """The Config of `model_name` at sequence length `seq` (RoPE tables reaching it), scanned as configured."""
    from ling2.config import load_config

    max_pos = max(seq, load_config(model_name=model_name).max_position_embeddings)
    return load_config(model_name=model_name, max_target_length=seq, max_position_embeddings=max_pos,
                       **(overrides or {}))


def random_batch(cfg, rows: int, seq: int, seed: int = 0) -> dict:
    """One micro-batch of random tokens, [rows, seq] each: one document per row, every position counted."""
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, seq + 1))
    return {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
            "segment_ids": jnp.ones((rows, seq), jnp.int32), "loss_weights": jnp.ones((rows, seq), F32)}


def batch_struct(rows: int, seq: int, sharding=None) -> dict:
    """ShapeDtypeStructs of `random_batch` (for compile-only plans)."""
    s = lambda dt: jax.ShapeDtypeStruct((rows, seq), dt, sharding=sharding)  # noqa: E731
    out = {k: s(jnp.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    out["loss_weights"] = s(F32)
    return out


def step_tokens(cfg, rows: int, seq: int) -> dict:
    """The step's token counts the objective normalises by: {"tokens": [], "mtp_tokens": [K]}."""
    return {"tokens": jnp.float32(rows * seq), "mtp_tokens": jnp.full((cfg.mtp_num_layers,), rows * seq, F32)}


def stand_in_sums(hidden_BTE, weights_BT):
    """(loss sum, weight sum, 0) of the stand-in for an LM head and its CE: sum_t w_t mean_e h_te^2, fp32.
    O(B T E) work, so a step with it costs what the step costs outside its heads."""
    h = hidden_BTE.astype(F32)
    w = weights_BT.astype(F32)
    return jnp.sum(w * jnp.mean(h * h, axis=-1)), jnp.sum(w), jnp.zeros((), F32)


class _StandInHeadDecoder(NamedTuple):
    """What MTP takes of the main decoder: its embedding and, instead of its head's CE, `stand_in_sums`."""
    embed: Any

    def ce_sums(self, hidden_BTE, targets_BT, weights_BT):
        return stand_in_sums(hidden_BTE, weights_BT)


def objective(graphdef, cfg, tokens: dict, *, heads: bool = True) -> Callable:
    """f(params, rest, mb) -> (objective, sums): the trainer's objective of one micro-batch (mb [B, T] arrays,
    `random_batch`); with heads=False the same objective with every LM head's CE replaced by `stand_in_sums`."""
    from ling2.train import step as train_step

    if heads:
        return functools.partial(train_step.forward, graphdef, cfg=cfg, step_tokens=tokens)

    def no_heads(params, rest, mb):
        model = nnx.merge(graphdef, params, rest)
        d = model.decoder
        valid_BT = mb["segment_ids"] != 0
        out = d(mb["inputs"], mb["positions"], mb["segment_ids"], valid_BT, return_logits=False)
        ce, _, _ = stand_in_sums(out.hidden, mb["loss_weights"])
        total = ce / tokens["tokens"]
        moe_aux = dict(out.moe_aux)
        if model.mtp is not None:
            hidden = out.hidden_pre_norm if model.mtp_hidden_pre_norm else out.hidden
            m = model.mtp(_StandInHeadDecoder(d.embed), hidden, mb["inputs"], mb["targets"], mb["loss_weights"],
                          mb["positions"], mb["segment_ids"], valid_BT)
            total += cfg.mtp_loss_scaling_factor * jnp.mean(m.ce_sum / tokens["mtp_tokens"])
            moe_aux.update(m.moe_aux)
        total += sum((a.loss for a in moe_aux.values()), jnp.zeros((), F32))
        return total, {}

    return no_heads


def split_abstract(cfg):
    """(graphdef, params, rest) of Ling2Model(cfg) as ShapeDtypeStructs, split as the trainer splits it."""
    from ling2.layers.model import abstract_model
    from ling2.train.state import trainable_filter

    return nnx.split(abstract_model(ModelSpec.of(cfg)), trainable_filter(cfg), ...)


def init_model(cfg, seed: int = 0):
    """(graphdef, params, rest) of a freshly initialised Ling2Model(cfg), built by one jitted call on the
    default device."""
    from ling2.layers.model import Ling2Model
    from ling2.train.state import trainable_filter

    graphdef, _, _ = split_abstract(cfg)
    spec = ModelSpec.of(cfg)
    build = jax.jit(lambda: nnx.split(Ling2Model(spec, rngs=nnx.Rngs(seed)), trainable_filter(cfg), ...)[1:])
    params, rest = build()
    return graphdef, params, rest


def grad_step(graphdef, cfg, rows: int, seq: int, *, heads: bool = True):
    """jit(grad(objective)) over (params, rest, mb): the gradient of the step's objective w.r.t. params."""
    f = objective(graphdef, cfg, step_tokens(cfg, rows, seq), heads=heads)
    return jax.jit(jax.grad(f, argnums=0, has_aux=True))


# ---- one decoder layer of each kind ----

class LayerCase(NamedTuple):
    attn: str
    mlp: str
    index: int  # the layer_index it runs with: the first of its kinds in the model's own plan (GLA's decays)
    model_count: int  # layers of these kinds in the model's plan (decoder and MTP)
    full_count: int  # ... in the full model's plan


def layer_cases(cfg, full_cfg) -> list[LayerCase]:
    """Each (attention, MLP) kind pair in the plan of `cfg` or `full_cfg`, in order of first appearance, with
    how often each plan has it (MTP depths are MLA+MoE layers)."""
    own, full = ModelSpec.of(cfg).plan.all(), ModelSpec.of(full_cfg).plan.all()
    kinds = list(dict.fromkeys((s.attn, s.mlp) for s in own + full))
    out = []
    for attn, mlp in kinds:
        first = next((s.index for s in own if (s.attn, s.mlp) == (attn, mlp)), 0)
        index = min(first, cfg.base_num_decoder_layers - 1)
        out.append(LayerCase(attn, mlp, index, sum((s.attn, s.mlp) == (attn, mlp) for s in own),
                             sum((s.attn, s.mlp) == (attn, mlp) for s in full)))
    return out


def build_layer(cfg, case: LayerCase, seed: int = 0):
    """(graphdef, params, rest) of one DecoderLayer of `case`'s kinds at cfg's widths."""
    from ling2.layers.decoder import DecoderLayer
    from ling2.train.state import trainable_filter

    spec = LayerSpec(case.index, case.attn, case.mlp, ("layer",))
    return nnx.split(DecoderLayer(ModelSpec.of(cfg).layers, spec, rngs=nnx.Rngs(seed)), trainable_filter(cfg), ...)


def layer_inputs(cfg, rows: int, seq: int, seed: int = 0) -> dict:
    """The layer's input x and output cotangent [rows, seq, E] in the compute dtype, and its [rows, seq]
    positions and segment ids."""
    r = np.random.default_rng(seed)
    dt = jnp.dtype(cfg.dtype)
    shape = (rows, seq, cfg.base_emb_dim)
    return {"x": jnp.asarray(r.normal(size=shape), dt), "cotangent": jnp.asarray(r.normal(size=shape) / seq, dt),
            "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
            "segment_ids": jnp.ones((rows, seq), jnp.int32)}


def layer_grad_step(graphdef, cfg, case: LayerCase) -> Callable:
    """jit of (params, rest, inputs) -> gradients w.r.t. params and x of sum(y * cotangent) + the MoE aux loss:
    the layer's forward and backward as the decoder runs it (under cfg.remat_policy)."""
    from ling2.layers.decoder import remat

    def loss(params, x_BTE, rest, inputs):
        def f(params, x_BTE):
            layer = nnx.merge(graphdef, params, rest)
            seg = inputs["segment_ids"]
            return layer(x_BTE, inputs["positions"], seg, seg != 0, layer_index=case.index)

        y_BTE, aux = remat(f, cfg.remat_policy)(params, x_BTE)
        out = jnp.sum(y_BTE.astype(F32) * inputs["cotangent"].astype(F32))
        return out + (aux.loss if aux is not None else 0.0)

    g = jax.grad(loss, argnums=(0, 1))
    return jax.jit(lambda params, rest, inputs: g(params, inputs["x"], rest, inputs))


# ---- the figures ----

def extrapolate(cases: list[LayerCase], layer_s: dict, whole_s: float, no_heads_s: float) -> dict:
    """Seconds of the full model's step from per-layer times {(attn, mlp): s} and the model's measured steps:
    heads = whole - no_heads; rest = no_heads - the model's layers' sum; full = the full plan's layers' sum +
    heads + rest."""
    own = sum(c.model_count * layer_s[(c.attn, c.mlp)] for c in cases)
    full_layers = sum(c.full_count * layer_s[(c.attn, c.mlp)] for c in cases)
    heads, rest = whole_s - no_heads_s, no_heads_s - own
    return {"model_layers_s": own, "heads_s": heads, "rest_s": rest, "full_layers_s": full_layers,
            "full_step_s": full_layers + heads + rest}


def figures(record: dict, peak: float = PEAK_BF16_FLOPS) -> dict:
    """The three MFU figures (and each against the measured matmul) from what `record`'s phases hold so far."""
    tokens = record["batch"] * record["seq"]
    flops, ph = record["flops_per_token"], record["phases"]
    measured = ph.get("matmul", {}).get("flops_per_s")
    out = {}

    def put(name, flops_per_token, step_s):
        rate = flops_per_token * tokens / step_s
        out[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "flops_per_token": flops_per_token,
                     "flops_per_s": rate, "mfu": rate / peak,
                     "of_measured_matmul": rate / measured if measured else None}

    whole, nh = ph.get("whole", {}).get("step_s"), ph.get("no_heads", {}).get("step_s")
    if whole:
        put("whole", flops["model"]["total"], whole)
    if nh:
        put("no_heads", flops["model"]["no_heads"], nh)
    layers = ph.get("layers", {}).get("rows")
    if whole and nh and layers and all("step_s" in r for r in layers):
        cases = [LayerCase(r["attn"], r["mlp"], r["index"], r["model_count"], r["full_count"]) for r in layers]
        ext = extrapolate(cases, {(r["attn"], r["mlp"]): r["step_s"] for r in layers}, whole, nh)
        put("full_model", flops["full_model"]["total"], ext["full_step_s"])
        out["full_model"]["extrapolation"] = ext
    return out


# ---- timing ----

def _memory(compiled) -> dict:
    return {"planned_bytes": planned_bytes(compiled.memory_analysis())}


def _device_peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def time_compiled(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls of fn after one warm-up call."""
    jax.block_until_ready(fn())
    return time_round_robin([fn], repeats)[0]


def matmul_record(n: int, dtype, repeats: int) -> dict:
    """The measured rate of one [n, n] x [n, n] matmul in `dtype` (tools.bench.report.matmul_rate)."""
    rate = matmul_rate(n, dtype, calls=repeats)
    return {"n": n, "dtype": jnp.dtype(dtype).name, "step_s": 2 * n**3 / rate, "flops_per_s": rate}


def time_step(cfg, model_state, rows: int, seq: int, repeats: int, *, heads: bool) -> dict:
    """Compile and time the gradient step (with or without heads) once; its plan and median seconds."""
    graphdef, params, rest = model_state
    mb = random_batch(cfg, rows, seq)
    t0 = time.perf_counter()
    compiled = grad_step(graphdef, cfg, rows, seq, heads=heads).lower(params, rest, mb).compile()
    out = {"compile_s": time.perf_counter() - t0, **_memory(compiled)}
    out["step_s"] = time_compiled(lambda: compiled(params, rest, mb), repeats)
    return out


def time_layers(cfg, cases: list[LayerCase], rows: int, seq: int, repeats: int, save: Callable[[list], None]) -> list:
    """Compile each case's layer step once, then time them all round-robin; rows of plans and medians."""
    inputs = layer_inputs(cfg, rows, seq)
    rows_out, fns = [], []
    for case in cases:
        row = case._asdict()
        try:
            graphdef, params, rest = build_layer(cfg, case)
            t0 = time.perf_counter()
            compiled = layer_grad_step(graphdef, cfg, case).lower(params, rest, inputs).compile()
            row.update(compile_s=time.perf_counter() - t0, **_memory(compiled),
                       flops_per_token=layer_flops(cfg, case.attn, case.mlp, seq))
            fn = functools.partial(compiled, params, rest, inputs)
            jax.block_until_ready(fn())
            fns.append((row, fn))
        except Exception as e:  # noqa: BLE001 - one kind failing (e.g. out of memory) keeps the others
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows_out.append(row)
        save(rows_out)
    if fns:
        for (row, _), s in zip(fns, time_round_robin([fn for _, fn in fns], repeats)):
            row["step_s"] = s
    return rows_out


def run(model: str, full_model: str, batch: int, seq: int, repeats: int, out: str | None, *,
        phases=PHASES, matmul_n: int = 8192, peak: float = PEAK_BF16_FLOPS, overrides: dict | None = None,
        log: Callable[[str], None] = print) -> dict:
    """Every phase in order, the JSON at `out` rewritten after each; returns the record."""
    cfg = load(model, seq, overrides)
    full_cfg = load(full_model, seq, overrides)
    cases = layer_cases(cfg, full_cfg)
    record = {**host_facts(), "model": model, "full_model": full_model, "batch": batch, "seq": seq,
              "repeats": repeats, "overrides": overrides or {}, "peak_flops": peak,
              "config": {k: getattr(cfg, k) for k in ("remat_policy", "attention_kernel", "moe_gmm_backend",
                                                        "scan_layers", "dtype", "weight_dtype", "loss_vocab_blocks")},
              "flops_per_token": {"model": flop_split(cfg, seq), "full_model": flop_split(full_cfg, seq)},
              "phases": {}, "mfu": {}}

    def save():
        record["mfu"] = figures(record, peak)
        if out:
            with replaced(out) as fh:
                json.dump(record, fh, indent=2, default=str)

    def phase(name, fn):
        t0 = time.perf_counter()
        try:
            record["phases"][name] = fn()
        except Exception as e:  # noqa: BLE001 - a failed phase (e.g. out of memory) is recorded; the rest run
            record["phases"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        record["phases"][name]["wall_s"] = time.perf_counter() - t0
        record["phases"][name]["device_peak_bytes_so_far"] = _device_peak_bytes()
        save()
        log(f"{name}: {json.dumps({k: v for k, v in record['phases'][name].items() if k != 'rows'}, default=str)}")

    save()
    if "matmul" in phases:
        phase("matmul", lambda: matmul_record(matmul_n, jnp.bfloat16, repeats))
    state = None
    for name, heads in (("whole", True), ("no_heads", False)):
        if name in phases:
            if state is None:
                t0 = time.perf_counter()
                state = init_model(cfg)
                record["init_s"] = time.perf_counter() - t0
            phase(name, lambda heads=heads: time_step(cfg, state, batch, seq, repeats, heads=heads))
    state = None
    if "layers" in phases:
        def layers():
            res = {"rows": []}

            def keep(rows):
                res["rows"] = rows
                record["phases"]["layers"] = res
                save()

            res["rows"] = time_layers(cfg, cases, batch, seq, repeats, keep)
            for r in res["rows"]:
                log(f"  layer {r['attn']}+{r['mlp']}: {r.get('step_s', r.get('error'))}")
            return res

        phase("layers", layers)
    for name, f in record["mfu"].items():
        log(f"MFU {name}: {f['mfu']:.2%} of {peak / 1e12:.1f} TFLOP/s ({f['tokens_per_s']:.0f} tokens/s, "
            f"step {f['step_s'] * 1e3:.1f} ms)")
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ling2-1gpu", help="the model whose step is timed")
    p.add_argument("--full_model", default="ling2", help="the model whose MFU is extrapolated from per-layer times")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="mfu.json", help="relative: to the working directory (bazel run: the caller's)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--matmul_n", type=int, default=8192)
    p.add_argument("--peak", type=float, default=PEAK_BF16_FLOPS)
    p.add_argument("overrides", nargs="*", help="config key=value for both models (e.g. remat_policy=full)")
    a = p.parse_args(argv)
    # JAX's GPU allocator takes 75% of the device by default; the step at batch 8 needs more.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    from ling2.config.loader import parse_overrides

    phases = tuple(x for x in a.phases.split(",") if x)
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"--phases: unknown {sorted(unknown)} (of {PHASES})")
    out = str(results_path(a.out, "gpu", "mfu.json"))
    run(a.model, a.full_model, a.batch, a.seq, a.repeats, out, phases=phases, matmul_n=a.matmul_n,
        peak=a.peak, overrides=parse_overrides(a.overrides) if a.overrides else None)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
