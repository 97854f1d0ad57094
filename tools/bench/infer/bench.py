"""Benchmark of generation: prints a table and writes JSON.

1. ling2-small (random weights; --model to change): prefill tokens/s at each context (B=1),
   decode tokens/s at each batch and context (compute in --dtype), with the MLA decode absorbed (attention in the
   latent space) and expanded (K/V up-projected from the cached latents every step), side by
   side as a ratio. Decode runs `--steps` tokens inside the jitted loop from a cache filled to
   the context (values do not change the cost: every cached slot is attended, masked or not).
2. Cache bytes per token of every MLA layer: the latent (kv_lora_rank + qk_rope_head_dim) vs an
   uncompressed per-head K/V cache (H (qk_head_dim + v_head_dim)), for the benchmarked config and
   for the full ling2 config; GLA layers hold a fixed state per sequence instead.
3. MTP self-speculative decoding on a trained checkpoint (--tiny_ckpt, the trainer's default run):
   greedy plain vs speculative on prompts from the sample corpus, batch 1, tokens/s ratio and
   the acceptance rate per depth (identical output checked).

  bazel run //tools/bench/infer:bench -- [--model ling2-small] [--contexts 512,4096] [--batches 1,32]
      [--steps 16] [--tiny_ckpt runs/ling2-tiny] [--new_tokens 64] [--out FILE]
"""

import argparse
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config import load_config
from ling2.config.paths import user_path
from ling2.infer import generation
from ling2.infer.load import INFER_OVERRIDES, find_file, load_model
from ling2.layers.attention.decode import DecodeOptions, DecoderCache
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec


def _time(fn, *args, repeats=2):
    """Best of `repeats` timed runs after one warm-up (which compiles)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def cache_bytes(cfg) -> dict:
    """Per token, summed over the MLA layers (decoder + MTP), in the cache dtype."""
    item = jnp.dtype(cfg.dtype).itemsize
    plan = ModelSpec.of(cfg).plan
    mla = sum(s.attn == "mla" for s in plan.all())
    gla = sum(s.attn == "gla" for s in plan.all())
    latent = mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item
    full = mla * cfg.base_num_query_heads * (cfg.qk_head_dim + cfg.v_head_dim) * item
    all_mla_full = (mla + gla) * cfg.base_num_query_heads * (cfg.qk_head_dim + cfg.v_head_dim) * item
    return {"model": cfg.model_name, "mla_layers": mla, "gla_layers": gla, "dtype": cfg.dtype,
            "latent_bytes_per_token": latent, "per_head_kv_bytes_per_token": full,
            "ratio": full / latent, "all_layers_per_head_kv_bytes_per_token": all_mla_full,
            "gla_state_bytes_per_sequence": gla * cfg.base_num_query_heads * cfg.head_dim ** 2 * 4}


def bench_small(args, log) -> dict:
    cfg = load_config({"model_name": args.model, "dtype": args.dtype}, INFER_OVERRIDES)
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    gd, state = nnx.split(model)
    rng = np.random.default_rng(0)
    out = {"model": cfg.model_name, "dtype": cfg.dtype, "prefill": [], "decode": []}

    @jax.jit
    def prefill(state, ids):
        m = nnx.merge(gd, state)
        B, T = ids.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cache = m.decoder.init_cache(B, T)
        o, cache = m.decoder.decode("prefill", ids, pos, cache, return_logits=False)
        return m.decoder.logits(o.hidden[:, -1:]), cache.index

    for C in args.contexts:
        ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, C)), jnp.int32)
        t = _time(prefill, state, ids)
        out["prefill"].append({"context": C, "batch": 1, "seconds": t, "tokens_per_s": C / t})
        log(f"prefill C={C}: {C / t:,.0f} tok/s")

    def filled_cache(B, S, C):
        """A cache of B rows filled to C slots with random latents and GLA states."""
        @jax.jit
        def make(key):
            cache = model.decoder.init_cache(B, S)
            layers = {i: jax.tree.map(lambda v: jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype) * 0.1,
                                      lc) for i, lc in cache.layers.items()}
            seg = jnp.broadcast_to(jnp.arange(S)[None] < C, (B, S)).astype(jnp.int32)
            return DecoderCache(jnp.full((B,), C, jnp.int32), seg, layers)
        return make(jax.random.PRNGKey(2))

    def decode_fn(absorb, steps):
        @jax.jit
        def run(state, cache, key):
            m = nnx.merge(gd, state)
            B = cache.index.shape[0]
            z = jnp.zeros((B,), jnp.int32)
            loop = generation.Loop(cache, jnp.zeros((B, steps + 2), jnp.int32), jnp.ones((B,), jnp.int32), z + 5,
                                   cache.index, jnp.zeros((B,), bool), jnp.zeros((), jnp.int32), key)
            res = generation._decode_loop(m, loop, steps + 1, generation.Sampling(), (), DecodeOptions(absorb))
            return res.tokens, res.step
        return run

    for C in args.contexts:
        for B in args.batches:
            row = {"context": C, "batch": B, "steps": args.steps}
            cache = filled_cache(B, C + args.steps + 1, C)
            for absorb in (True, False):
                t = _time(decode_fn(absorb, args.steps), state, cache, jax.random.PRNGKey(1), repeats=1)
                row["absorbed" if absorb else "expanded"] = {"seconds": t, "tokens_per_s": B * args.steps / t,
                                                             "ms_per_step": 1e3 * t / args.steps}
            row["absorbed_speedup"] = row["expanded"]["seconds"] / row["absorbed"]["seconds"]
            out["decode"].append(row)
            log(f"decode C={C} B={B}: absorbed {row['absorbed']['tokens_per_s']:,.1f} tok/s, expanded "
                f"{row['expanded']['tokens_per_s']:,.1f} tok/s ({row['absorbed_speedup']:.2f}x)")
    return out


def sample_prompts(cfg, n: int, length: int) -> list:
    """n prompts of `length` tokens: the starts of documents of the sample corpus's valid split."""
    from ling2.data.indexed import IndexedDataset

    ds = IndexedDataset(str(find_file("data/sample/sample_text_document")))
    docs = [np.asarray(ds[i], np.int32) for i in range(len(ds) - 1, 0, -1)]
    return [d[:length] for d in docs if d.size >= length][:n]


def bench_speculative(args, log) -> dict:
    loaded = load_model(user_path(args.tiny_ckpt))
    g = generation.Generator(loaded.model)
    prompts = sample_prompts(loaded.cfg, args.num_prompts, args.prompt_len)
    res = {"ckpt": str(loaded.path), "prompts": len(prompts), "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens}
    plain_ids = None
    for spec in (False, True):
        g.generate(prompts[:1], args.new_tokens, speculative=spec)  # compile
        t0 = time.perf_counter()
        outs = [g.generate([p], args.new_tokens, speculative=spec) for p in prompts]
        t = time.perf_counter() - t0
        key = "speculative" if spec else "plain"
        res[key] = {"seconds": t, "tokens_per_s": sum(len(o.ids[0]) for o in outs) / t,
                    "main_forwards": sum(o.stats["main_forwards"] for o in outs)}
        if spec:
            att = np.sum([o.stats["drafts_examined"] for o in outs], axis=0)
            acc = np.sum([o.stats["drafts_accepted"] for o in outs], axis=0)
            res[key]["acceptance_per_depth"] = (acc / np.maximum(att, 1)).tolist()
            res["identical_output"] = [o.ids for o in outs] == plain_ids
        else:
            plain_ids = [o.ids for o in outs]
    res["speedup"] = res["plain"]["seconds"] / res["speculative"]["seconds"]
    log(f"speculative: {res['speedup']:.2f}x, acceptance {res['speculative']['acceptance_per_depth']}, "
        f"identical {res['identical_output']}")
    return res


def table(r: dict) -> str:
    lines = [f"# generation benchmark, {r['host']['date']}, {r['host']['backend']}, load {r['host']['load']}", ""]
    if "small" in r:
        lines += [f"{r['small']['model']}, compute {r['small']['dtype']}, random weights", ""]
    if "small" in r:
        lines += ["| prefill (B=1) | tokens/s |", "|---|---|"]
        lines += [f"| {p['context']} | {p['tokens_per_s']:,.0f} |" for p in r["small"]["prefill"]]
        lines += ["", "| decode context | batch | absorbed tok/s | expanded tok/s | absorbed / expanded speed |",
                  "|---|---|---|---|---|"]
        lines += [f"| {d['context']} | {d['batch']} | {d['absorbed']['tokens_per_s']:,.1f} | "
                  f"{d['expanded']['tokens_per_s']:,.1f} | {d['absorbed_speedup']:.2f}x |" for d in r["small"]["decode"]]
    lines += ["", "| cache, per token | MLA layers | latent bytes | per-head K/V bytes | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {c['model']} ({c['dtype']}) | {c['mla_layers']} | {c['latent_bytes_per_token']:,} | "
              f"{c['per_head_kv_bytes_per_token']:,} | {c['ratio']:.1f}x |" for c in r["cache"]]
    if "speculative" in r:
        s = r["speculative"]
        lines += ["", "| MTP speculative (B=1, greedy) | plain tok/s | speculative tok/s | speed-up | acceptance per depth "
                  "| identical |", "|---|---|---|---|---|---|",
                  f"| {s['prompts']} prompts x {s['new_tokens']} tokens | {s['plain']['tokens_per_s']:.1f} | "
                  f"{s['speculative']['tokens_per_s']:.1f} | {s['speedup']:.2f}x | "
                  f"{', '.join(f'{a:.2f}' for a in s['speculative']['acceptance_per_depth'])} | {s['identical_output']} |"]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ling2-small")
    p.add_argument("--dtype", default="", help="compute dtype (default: float32 on CPU, where XLA's bf16 dots are "
                   "slow or missing, else the model's)")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tiny_ckpt", default="runs/ling2-tiny")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--skip_small", action="store_true")
    p.add_argument("--skip_speculative", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else load_config(model_name=args.model).dtype)
    log = lambda s: print(s, flush=True)  # noqa: E731
    host = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "cpus": os.cpu_count(),
            "machine": platform.machine(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "jax": jax.__version__}
    r = {"host": host, "cache": [cache_bytes(load_config(model_name=m)) for m in (args.model, "ling2")]}
    if not args.skip_small:
        r["small"] = bench_small(args, log)
    if not args.skip_speculative:
        r["speculative"] = bench_speculative(args, log)
    r["host"]["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(table(r))
    if args.out:
        path = user_path(args.out)
        path.write_text(json.dumps(r, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
