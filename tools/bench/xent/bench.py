"""Benchmark of the output head + cross-entropy, fwd+bwd: today's full [tokens, V] logits
(`head_logits` -> `cross_entropy_sums`) beside the vocab-blocked `head_cross_entropy_sums`,
side by side in one run. Prints a table and writes JSON.

Both take --dtype (bf16) hidden states, fp32 head weights cast to that compute dtype and fp32
logits (Ling2's dtype / weight_dtype / float32_logits) and return d loss / d (hidden, kernel).
Memory is XLA's plan of the compiled program (`memory_analysis()`): temporaries, and the total
of arguments + outputs + temporaries, per device. The blocked loss recomputes the forward
logits in the backward (4/3 of the full path's matmul FLOPs). Timed cases alternate
(round-robin, median of --repeats) so a shared machine's load hits both alike; the blocked
case's loss and gradients are compared with the full path's on the same inputs.

--target tpu:<topology> (e.g. tpu:v5p:2x2x1) compiles for TPU devices through libtpu on this
host (a venv with jax[tpu]) and reports memory only: one chip, and all the topology's chips
with the tokens sharded over fsdp and, separately, the vocab over tensor.

  bazel run //tools/bench/xent:bench -- [--cases 4096:2048:157184,1024:512:32000] [--num_blocks 16]
      [--time all|small|none] [--repeats 3] [--target cpu|tpu:v5p:2x2x1] [--out FILE]
"""

import argparse
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ling2.config.schema import MESH_AXES
from ling2.layers import losses, sharding
from tools.bench.report import host_facts, planned_bytes, time_round_robin, write_results

RULES = [("activation_batch", ["data", "fsdp", "expert"]), ("activation_length", None),
         ("activation_embed", None), ("activation_vocab", ["tensor"]), ("embed", ["fsdp"]), ("vocab", ["tensor"])]


def run_spec(mesh):
    """What the loss reads of a RunSpec: the mesh's axis sizes and RULES."""
    return types.SimpleNamespace(mesh_shape=tuple(mesh.shape.items()),
                                 logical_axis_rules=tuple((n, tuple(a or ())) for n, a in RULES))


def loss_fn(num_blocks, compute_dtype, vocab_shards, run):
    """value_and_grad over (hidden, kernel) of the weighted CE sum; num_blocks 0 = full logits."""

    def f(x, k, t, w):
        return jax.value_and_grad(lambda x, k: losses.head_cross_entropy_sums(
            x, k, t, w, num_blocks=num_blocks, vocab_shards=vocab_shards, compute_dtype=compute_dtype, run=run)[0],
            argnums=(0, 1))(x, k)

    return f


def make_mesh(devices, **sizes):
    shape = [sizes.get(a, 1) for a in MESH_AXES]
    return jax.sharding.Mesh(np.asarray(devices[:int(np.prod(shape))]).reshape(shape), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def abstract_args(mesh, B, T, E, V, dt):
    """ShapeDtypeStructs sharded by the Ling2 rules: tokens by batch, the kernel [E, V] by (embed, vocab)."""
    rules = sharding.rules_dict(RULES)

    def sds(shape, dtype, names):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
            mesh, sharding.logical_to_spec(names, shape, rules, mesh)))

    bt = ("activation_batch", "activation_length")
    return (sds((B, T, E), dt, bt + ("activation_embed",)), sds((E, V), jnp.float32, ("embed", "vocab")),
            sds((B, T), jnp.int32, bt), sds((B, T), jnp.float32, bt))


def compile_case(f, mesh, args):
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        c = jax.jit(f).lower(*args).compile()
        secs = time.perf_counter() - t0
    m = c.memory_analysis()
    return c, {"temp_mib": m.temp_size_in_bytes / 2 ** 20, "total_mib": planned_bytes(m) / 2 ** 20,
               "compile_s": secs}


def max_rel_err(got, ref):
    """|got - ref| of the loss, and the largest of d hidden / d kernel, each over ref's largest magnitude."""
    (v1, (dx1, dk1)), (v0, (dx0, dk0)) = got, ref
    err = {"loss_rel_err": abs(float(v1) - float(v0)) / abs(float(v0))}
    for name, a, b in (("d_hidden_rel_err", dx1, dx0), ("d_kernel_rel_err", dk1, dk0)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err[name] = float(np.abs(a - b).max() / np.abs(b).max())
    return err


def parse_cases(text):
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in text.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 3 or min(c) < 1 for c in cases):
        raise ValueError(f"--cases: expected tokens:E:V[,tokens:E:V...] of positive ints, got {text!r}")
    return cases


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="4096:2048:157184,1024:512:32000", help="tokens:E:V, comma separated")
    p.add_argument("--num_blocks", type=int, default=16, help="vocab blocks of the blocked loss")
    p.add_argument("--dtype", default="bfloat16", help="hidden / compute dtype (weights and logits are fp32)")
    p.add_argument("--time", choices=("all", "small", "none"), default="all",
                   help="which cases to time (small: all but the first); TPU targets are never timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", default="cpu", help="cpu (this host's devices) or tpu:<topology>, e.g. tpu:v5p:2x2x1")
    p.add_argument("--out", default="",
                   help="JSON path (default: tools/bench/xent/results_<target>.json under bazel run, else cwd)")
    a = p.parse_args()
    try:
        cases = parse_cases(a.cases)
    except ValueError as e:
        p.error(str(e))
    dt = jnp.dtype(a.dtype)

    if a.target == "cpu":
        devices, layouts = jax.devices(), [("1 device", {})]
    elif a.target.startswith("tpu:"):
        from jax.experimental import topologies
        try:
            devices = topologies.get_topology_desc(platform="tpu", topology_name=a.target[4:]).devices
        except Exception as e:  # libtpu missing or an unknown topology name
            p.error(f"--target {a.target}: no TPU topology ({type(e).__name__}: {e})")
        n = len(devices)
        layouts = [("1 chip", {})] + ([(f"fsdp={n}", {"fsdp": n}), (f"tensor={n}", {"tensor": n})] if n > 1 else [])
    else:
        p.error(f"--target: expected cpu or tpu:<topology>, got {a.target!r}")
    timed = a.target == "cpu" and a.time != "none"

    rows = []
    for ci, (tokens, E, V) in enumerate(cases):
        if V % a.num_blocks:
            print(f"note: {a.num_blocks} blocks do not divide V={V}; the last block is padded")
        for lname, sizes in layouts:
            mesh = make_mesh(devices, **sizes)
            rows_per_token = mesh.shape["fsdp"] * mesh.shape["data"] * mesh.shape["expert"]
            args = abstract_args(mesh, rows_per_token, tokens, E, V, dt)  # `tokens` per batch-shard
            pair = []
            for name, nb in (("full_logits", 0), (f"blocked_{a.num_blocks}", a.num_blocks)):
                compiled, mem = compile_case(loss_fn(nb, dt, mesh.shape["tensor"], run_spec(mesh)), mesh, args)
                pair.append((compiled, dict(case=name, tokens_per_device=tokens, E=E, V=V, layout=lname, **mem)))
            if timed and (a.time == "all" or ci > 0):
                r = np.random.default_rng(0)
                x = jnp.asarray(r.normal(size=(1, tokens, E)), dt)
                k = jnp.asarray(r.normal(size=(E, V)) * E ** -0.5, jnp.float32)
                t = jnp.asarray(r.integers(0, V, (1, tokens)), jnp.int32)
                w = jnp.ones((1, tokens), jnp.float32)
                outs = [jax.device_get(c(x, k, t, w)) for c, _ in pair]  # warm-up; compared below
                secs = time_round_robin([lambda c=c: c(x, k, t, w) for c, _ in pair], a.repeats)
                for (_, row), s in zip(pair, secs):
                    row["fwd_bwd_s"] = s
                pair[1][1].update(max_rel_err(outs[1], outs[0]))
                del x, k, t, w, outs
            base = pair[0][1]
            for _, row in pair:
                row["temp_ratio"] = row["temp_mib"] / base["temp_mib"]
                if "fwd_bwd_s" in row:
                    row["time_ratio"] = row["fwd_bwd_s"] / base["fwd_bwd_s"]
                rows.append(row)
            del pair

    dev = devices[0].device_kind
    print(f"head + CE fwd+bwd, {dt.name} hidden/compute, fp32 weights and logits, on {a.target} ({dev}); "
          f"memory per device; ratios vs full_logits")
    print(f"{'case':<13}{'tokens':>7}{'E':>6}{'V':>8} {'layout':<11}{'temp MiB':>10}{'total MiB':>10}"
          f"{'temp x':>8}{'fwd+bwd s':>11}{'time x':>8}")
    for r in rows:
        s = f"{r['fwd_bwd_s']:>11.2f}{r['time_ratio']:>8.2f}" if "fwd_bwd_s" in r else f"{'-':>11}{'-':>8}"
        print(f"{r['case']:<13}{r['tokens_per_device']:>7}{r['E']:>6}{r['V']:>8} {r['layout']:<11}"
              f"{r['temp_mib']:>10.0f}{r['total_mib']:>10.0f}{r['temp_ratio']:>8.3f}{s}")
    for r in rows:
        if "loss_rel_err" in r:
            print(f"{r['case']} vs full_logits at tokens={r['tokens_per_device']} V={r['V']}: loss rel err "
                  f"{r['loss_rel_err']:.1e}, d hidden {r['d_hidden_rel_err']:.1e}, d kernel {r['d_kernel_rel_err']:.1e} "
                  f"(max |diff| / max |full|)")

    result = {"bench": "xent", **host_facts(), "target": a.target, "device": dev, "config": {"num_blocks": a.num_blocks, "dtype": dt.name, "repeats": a.repeats},
              "rows": rows}
    tag = a.target.replace(":", "_")
    write_results(result, a.out, "xent", f"results_{tag}.json")


if __name__ == "__main__":
    main()
