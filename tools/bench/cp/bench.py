"""Context parallelism benchmark: one training step of a fixed batch (rows x seq tokens) with each
sequence split over `context` devices (context 1, 2, 4, 8 of 8 fake CPU devices; fsdp 1), side by side in
one run. Prints a table and writes JSON.

Per context size: XLA's plan of the compiled train step per device (`memory_analysis()`: arguments =
parameters, Adam state and batch; temporaries; the total) and the step's median wall time (round-robin,
--repeats), plus the collectives the step runs per device (`ling2.train.hlo_traffic`, by kind and axis).
The devices are fake: 8 XLA CPU devices share this host's cores, so the time shows the cost of the
extra work and communication, not a speed-up. With --plans FILE..., the long-context TPU plans'
(`tools/bench/compile`) collective bytes are tabulated per decoder layer.

  bazel run //tools/bench/cp:bench -- [--model ling2-micro] [--seq 4096] [--rows 2] [--repeats 3] [--out FILE]
      [--plans tools/bench/compile/results_tpu_long.json]  (--contexts "": the plans' table alone)
"""

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ling2.config import load_config  # noqa: E402
from ling2.train import hlo_traffic, loop, runtime  # noqa: E402
from ling2.train.state import abstract_state, init_state  # noqa: E402
from ling2.train import step as step_lib  # noqa: E402
from ling2.layers.spec import ModelSpec  # noqa: E402
from tools.bench.report import host_facts, time_round_robin, write_results  # noqa: E402

MiB = 2**20


def config(a, context):
    return load_config(model_name=a.model, max_target_length=a.seq, max_position_embeddings=a.seq,
                       per_device_batch_size=a.rows / context,
                       ici_fsdp_parallelism=1, ici_context_parallelism=context, gla_chunk_size=64, kda_chunk_size=64,
                       remat_policy="full", scan_layers=True, dtype="float32", weight_dtype="float32")


def case(a, context):
    """(row of the table, a function running one step) for one context size on `context` devices."""
    cfg = config(a, context)
    mesh = runtime.make_mesh(cfg, jax.devices()[:context])
    setup = abstract_state(cfg, mesh)
    compiled = loop.compile_train_step(cfg, mesh, setup)
    mem = compiled.memory_analysis()
    t = hlo_traffic.traffic(compiled.as_text(), dict(mesh.shape))
    state = init_state(cfg, mesh, setup)
    r = np.random.default_rng(0)
    ids = r.integers(0, cfg.vocab_size, (1, a.rows, a.seq + 1)).astype(np.int32)
    batch = dict(inputs=ids[..., :-1], targets=ids[..., 1:], positions=np.broadcast_to(np.arange(a.seq), (1, a.rows, a.seq)),
                 segment_ids=np.ones((1, a.rows, a.seq), np.int32), loss_weights=np.ones((1, a.rows, a.seq), np.float32))
    batch = runtime.to_global(batch, cfg, mesh)
    step_fn = step_lib.jit_train_step(setup.graphdef, setup.tx, cfg, setup.schedule)
    holder = {"state": state}

    def run():
        with jax.set_mesh(mesh):
            holder["state"], metrics = step_fn(holder["state"], batch)
        return metrics["loss"]

    jax.block_until_ready(run())  # compile and warm up
    row = {"context": context, "devices": context, "tokens_per_step": a.rows * a.seq,
           "tokens_per_device": a.rows * a.seq // context,
           "argument_mib": mem.argument_size_in_bytes / MiB, "temp_mib": mem.temp_size_in_bytes / MiB,
           "total_mib": (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                         - mem.alias_size_in_bytes) / MiB,
           "collectives": {k: v / MiB for k, v in hlo_traffic.by_axis(t["collectives"]).items()}}
    return row, run


def plan_rows(paths):
    """Per long-context TPU plan: collective wire bytes per chip per step and per decoder layer, by axis."""
    out = []
    for p in paths:
        for plan in json.load(open(p))["plans"]:
            if "collectives" not in plan:
                continue
            layers = len(ModelSpec.of(load_config(model_name=plan["model_name"])).plan.all())
            ctx = sum(c["wire_bytes"] for c in plan["collectives"] if c["axes"] == ["context"])
            out.append({"plan": plan["name"], "mesh": plan["mesh"], "seq_len": plan["seq_len"], "layers": layers,
                        "wire_gib_per_step": plan["collective_wire_bytes"] / 2**30,
                        "context_axis_mib_per_layer": ctx / layers / MiB,
                        "by_kind_axis_mib_per_layer": {f"{c['kind']} over {'x'.join(c['axes'])}":
                                                       c["wire_bytes"] / layers / MiB for c in plan["collectives"]},
                        "roofline_s": plan["roofline_s"], "roofline_step_s": plan["roofline_step_s"],
                        "total_gib": plan["total_bytes"] / 2**30, "fits": plan["fits"]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ling2-micro")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--contexts", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plans", nargs="*", default=[])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows, fns = [], []
    for c in (int(x) for x in a.contexts.split(",") if x.strip()):
        row, fn = case(a, c)
        rows.append(row)
        fns.append(fn)
    for row, t in zip(rows, time_round_robin(fns, a.repeats) if fns else []):
        row["step_s"] = t
    base = rows[0] if rows else None
    if rows:
        print(f"{a.model}, {a.rows} x {a.seq} tokens per step, fsdp 1, XLA CPU devices (fake, sharing the host's cores)")
        print(f"{'context':>7} {'args MiB':>9} {'temp MiB':>9} {'total MiB':>10} {'x ctx 1':>8} {'step s':>8} "
              f"{'x ctx 1':>8}  collectives per device per step (MiB on the wire)")
    for r in rows:
        coll = ", ".join(f"{k} {v:.1f}" for k, v in list(r["collectives"].items())[:4])
        print(f"{r['context']:>7} {r['argument_mib']:9.1f} {r['temp_mib']:9.1f} {r['total_mib']:10.1f} "
              f"{r['total_mib'] / base['total_mib']:8.3f} {r['step_s']:8.3f} {r['step_s'] / base['step_s']:8.2f}  {coll}")
    plans = plan_rows(a.plans)
    for p in plans:
        print(f"{p['plan']}: {p['total_gib']:.2f} GiB per chip, fits {p['fits']}; context-axis collectives "
              f"{p['context_axis_mib_per_layer']:.1f} MiB per layer per chip; roofline {p['roofline_step_s']:.2f} s")
    write_results({**host_facts(), "model": a.model, "seq": a.seq, "rows": a.rows, "cases": rows, "plans": plans},
                  a.out, "cp", "results_cpu.json")


if __name__ == "__main__":
    main()
