"""Compile-only plans of the full models (`model_name=ling2`, 17.4B parameters, `ling3`, and the 1T flagship
`ling2.5-1t`) at seq 4096 and >= 1M tokens per step, and at long context, on v5p, v6e and H100 / H200 clusters
(the real XLA:TPU compiler, and XLA:GPU with Triton), through `//ling2/train:compile` (the trainer's own
step, on this CPU host).
Each plan runs in its own process, one after another; the table gives per chip what XLA plans, the
host's peak RSS of that process (and once the step is lowered, before XLA compiles it), and the
full-logits loss (loss_vocab_blocks=0) beside the vocab-blocked one as a ratio. A venv compiles for
its own platform: TPU plans under --config=tpu, H100 plans under --config=cuda.

  bazel run --config=tpu //tools/bench/compile:bench -- [--only NAME ...] [--out FILE]
  bazel run --config=cuda //tools/bench/compile:bench -- --only "ling2 h100-64" "ling3 h100-64" --out ...
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

from ling2 import topology as topology_lib
from ling2.config.loader import load_config
from ling2.config.paths import user_path

GiB = 1024**3
SEQ = ["max_target_length=4096", "scan_layers=true"]
_V5P_64 = ["ici_fsdp_parallelism=4", "ici_expert_parallelism=8", "per_device_batch_size=1",
           "gradient_accumulation_steps=8", "remat_policy=full"]
_V6E_256 = ["ici_fsdp_parallelism=32", "ici_expert_parallelism=8", "per_device_batch_size=1",
            "gradient_accumulation_steps=4", "remat_policy=full"]
_H100_64 = ["ici_fsdp_parallelism=8", "ici_expert_parallelism=8", "per_device_batch_size=1",
            "gradient_accumulation_steps=4", "remat_policy=full"]



def _rules_with(**axes) -> str:
    """The default logical_axis_rules with some names re-mapped, as one key=value override."""
    rules = [[name, list(axes.get(name, mesh) or []) or None] for name, mesh in load_config().logical_axis_rules]
    return "logical_axis_rules=" + json.dumps(rules, separators=(",", ":"))


# ling3's non-expert weights (attention, dense layers, embeddings: 8.6B parameters) also sharded over the
# expert axis, so that no chip holds an eighth of them in fp32 with Adam.
_EMBED_OVER_EXPERT = _rules_with(embed=["fsdp", "expert"])

# name -> (topology, num_slices, overrides); a name without a model is ling2's. 256 sequences x 4096 =
# 1,048,576 tokens per step.
PLANS = {
    "v5p-64": ("v5p-64", 1, ["ici_fsdp_parallelism=4", "ici_expert_parallelism=8", "per_device_batch_size=1",
                             "gradient_accumulation_steps=8", "remat_policy=full"]),
    "v5p-64 full logits": ("v5p-64", 1, ["ici_fsdp_parallelism=4", "ici_expert_parallelism=8",
                                         "per_device_batch_size=1", "gradient_accumulation_steps=8",
                                         "remat_policy=full", "loss_vocab_blocks=0"]),
    "v5p-256": ("v5p-256", 1, ["ici_fsdp_parallelism=16", "ici_expert_parallelism=8", "per_device_batch_size=1",
                               "gradient_accumulation_steps=2", "remat_policy=full"]),
    "v6e-256": ("v6e-256", 1, _V6E_256),
    "ling3 v5p-64": ("v5p-64", 1, ["model_name=ling3", *_V5P_64, _EMBED_OVER_EXPERT, "mu_dtype=bfloat16"]),
    "ling3 v6e-256": ("v6e-256", 1, ["model_name=ling3", *_V6E_256, _EMBED_OVER_EXPERT]),
    "ling2 h100-64": ("h100-64", 1, _H100_64),
    "ling3 h100-64": ("h100-64", 1, ["model_name=ling3", *_H100_64]),
}
# Long context (issue 25): 32 sequences of 131,072 tokens (4M tokens per step) with each sequence split 4
# ways over the context axis, YaRN as configs/train/ling2-128k.yml sets it; one 1,048,576-token sequence
# split 128 ways. Splash attention (attention_kernel=flash) with the queries split (q_seq_shards); at 1M
# tokens in blocks of 2048 (splash builds its block masks on the host, one Python step per block).
_LONG = ["rope_type=yarn", "attention_kernel=flash", "remat_policy=full", "gradient_accumulation_steps=1"]
_LING2_128K = ["max_target_length=131072", "max_position_embeddings=131072", "rope_factor=32",
               "original_max_position_embeddings=4096", *_LONG]
PLANS.update({
    "ling2 128k v5p-256": ("v5p-256", 1, [*_LING2_128K, "per_device_batch_size=0.25", "ici_fsdp_parallelism=4",
                                          "ici_expert_parallelism=8", "ici_context_parallelism=4"]),
    # ling3: two micro-batches of 16 sequences (16K tokens per chip each: the padded expert-parallel buffers
    # scale with them), non-expert weights over fsdp, expert and context
    "ling3 128k v5p-256": ("v5p-256", 1, ["model_name=ling3", "max_target_length=131072", "attention_kernel=flash",
                                          "remat_policy=full", "gradient_accumulation_steps=2",
                                          "per_device_batch_size=0.125", "ici_fsdp_parallelism=2",
                                          "ici_expert_parallelism=8", "ici_context_parallelism=8",
                                          _rules_with(embed=["fsdp", "expert", "context"]), "mu_dtype=bfloat16"]),
    # Ring-2.5's YaRN stage: 16 sequences of 262,144 tokens (4M tokens), each split 8 ways
    "ling2 256k v5p-256": ("v5p-256", 1, ["max_target_length=262144", "max_position_embeddings=262144",
                                          "rope_factor=64", "original_max_position_embeddings=4096", *_LONG,
                                          "per_device_batch_size=0.125", "ici_fsdp_parallelism=2",
                                          "ici_expert_parallelism=8", "ici_context_parallelism=8"]),
    "ling2 1m v5p-256": ("v5p-256", 1, ["max_target_length=1048576", "max_position_embeddings=1048576",
                                        "rope_factor=256", "original_max_position_embeddings=4096", *_LONG,
                                        "per_device_batch_size=0.0078125", "ici_fsdp_parallelism=1",
                                        "ici_context_parallelism=128", "attention_block_size=2048"]),
})
# The flagship, Ling-2.5-1T (configs/models/ling2.5-1t.yml, 1.03T parameters): 4M tokens per step at 4K (1,024
# sequences as micro-batches of one per chip) and at 128K (32 sequences, each split over the context axis);
# expert parallelism 8, non-expert weights over fsdp and expert (and context), Adam's first moment in bf16.
_1T = ["model_name=ling2.5-1t", "remat_policy=full", "mu_dtype=bfloat16", _EMBED_OVER_EXPERT,
       "ici_expert_parallelism=8"]


def _1t_4k(topology: str, devices: int) -> tuple:
    """4K: fsdp over devices / 8, one sequence per device per micro-batch, 1,024 sequences per step."""
    return (topology, 1, [*_1T, f"ici_fsdp_parallelism={devices // 8}", "per_device_batch_size=1",
                          f"gradient_accumulation_steps={1024 // devices}"])


def _1t_128k(topology: str, devices: int, context: int, *extra) -> tuple:
    """128K: 32 sequences in one micro-batch, each over `context` devices; fsdp takes the rest."""
    return (topology, 1, [*_1T, _rules_with(embed=["fsdp", "expert", "context"]), "max_target_length=131072",
                          f"ici_fsdp_parallelism={devices // 8 // context}", f"ici_context_parallelism={context}",
                          f"per_device_batch_size={32 / devices}", "gradient_accumulation_steps=1", *extra])


PLANS.update({f"ling2.5-1t {t}": _1t_4k(t, n) for t, n in (
    ("v5p-512", 256), ("v5p-1024", 512), ("h100-256", 256), ("h100-512", 512), ("h100-1024", 1024),
    ("h200-128", 128), ("h200-256", 256), ("h200-512", 512), ("tpu7x-256", 512))})
PLANS.update({
    "ling2.5-1t 128k v5p-1024": _1t_128k("v5p-1024", 512, 16, "attention_kernel=flash"),
    # context 16 (the v5p layout) is 8 GiB over an Ironwood device's HBM (NOTES.md); 32 halves the activations
    "ling2.5-1t 128k tpu7x-256": _1t_128k("tpu7x-256", 512, 32, "attention_kernel=flash"),
    "ling2.5-1t 128k h100-512": _1t_128k("h100-512", 512, 16),
    "ling2.5-1t 128k h200-512": _1t_128k("h200-512", 512, 16),
    "ling2.5-1t 128k h100-1024": _1t_128k("h100-1024", 1024, 32),
})
# v6e (32 GiB per chip) multi-slice: 8 slices of 256 joined by fsdp over the data-center network, 2,048 sequences
# of 4K; a device gathers only its own experts' weights (expert parallelism 64 within a slice, 4 each), the
# expert-parallel receive buffers at 1.25x the balanced share. Expert 8, 32 and 64 at 2x are 29, 6.6 and 1.1
# GiB over (NOTES.md).
PLANS["ling2.5-1t v6e-256 x8"] = ("v6e-256", 8, [*_1T, "dcn_fsdp_parallelism=8", "ici_fsdp_parallelism=4",
                                                "ici_expert_parallelism=64", "per_device_batch_size=1",
                                                "gradient_accumulation_steps=1", "moe_ep_capacity_factor=1.25"])
# The flagship pipelined, as GPU clusters train it: the 9 scanned groups of 8 layers over 9 stages (the stage axis
# outermost: whole hosts), each stage's experts over the 8 GPUs of a host (the all-to-all stays on NVLink), fsdp
# across hosts; a stage's weights gathered once per step and held in bfloat16 (`ling2.layers.pipeline`), the
# expert-parallel receive buffers at 1.25x the balanced share. 18 pipeline micro-batches of one sequence per GPU:
# `seqs` sequences of 4K per step, a multiple of 9 x (GPUs / 9) so the batch also splits over the stages outside
# the pipeline.
def _1t_pipelined(topology: str, devices: int, seqs: int, weights: str = "bfloat16") -> tuple:
    return (topology, 1, ["model_name=ling2.5-1t", "remat_policy=full", "mu_dtype=bfloat16",
                          _rules_with(embed=["fsdp", "expert", "stage"]), "ici_stage_parallelism=9",
                          f"ici_fsdp_parallelism={devices // 72}", "ici_expert_parallelism=8",
                          f"per_device_batch_size={seqs / devices}", "gradient_accumulation_steps=1",
                          "pipeline_microbatches=18", f"pipeline_weights_dtype={weights}",
                          "moe_ep_capacity_factor=1.25"])


PLANS.update({
    "ling2.5-1t pipelined f32 h200-576": _1t_pipelined("h200-576", 576, 1152, weights="float32"),
    "ling2.5-1t pipelined h200-576": _1t_pipelined("h200-576", 576, 1152),
    "ling2.5-1t pipelined h200-1152": _1t_pipelined("h200-1152", 1152, 2304),
})
# Expert-parallel exchange (issue 28): "auto" is the ragged all-to-all on TPU, its receive buffers bounded at
# twice the balanced share (the default); these run the padded exchange and the unbounded ragged one beside it.
PLANS.update({f"{name} padded": (PLANS[name][0], 1, [*PLANS[name][2], "moe_ep_all_to_all=padded"])
              for name in ("v5p-64", "v5p-256", "ling2 h100-64", "ling3 h100-64")})
PLANS.update({f"{name} ragged unbounded": (PLANS[name][0], 1, [*PLANS[name][2], "moe_ep_capacity_factor=0"])
              for name in ("v5p-64", "v5p-256")})
BASELINE = {"v5p-64 full logits": "v5p-64", "v5p-64 padded": "v5p-64", "v5p-256 padded": "v5p-256",
            "v5p-64 ragged unbounded": "v5p-64", "v5p-256 ragged unbounded": "v5p-256",
            "ling2 h100-64 padded": "ling2 h100-64", "ling3 h100-64 padded": "ling3 h100-64",
            "ling2.5-1t pipelined h200-576": "ling2.5-1t pipelined f32 h200-576"}


# Compile flags by generation: Ironwood's SparseCore collective programs take this host past 24 GB at the 1T
# model's size (NOTES.md, "Ironwood"), so its plans keep the collectives on the TensorCores.
COMPILE_FLAGS = {"tpu7x": ["--nosparse_core_collectives"]}


def run_plan(name, topology, num_slices, overrides, outdir):
    """Runs the compile binary in a child process; returns its plan (JSON), exit code and peak RSS."""
    out = os.path.join(outdir, name.replace(" ", "_") + ".json")
    cmd = [sys.executable, "-m", "ling2.train.compile", f"--topology={topology}", f"--num_slices={num_slices}",
           f"--out={out}", *COMPILE_FLAGS.get(topology_lib.parse(topology).chip.generation, []), "--", *SEQ,
           *(overrides if any(o.startswith("model_name=") for o in overrides) else ["model_name=ling2", *overrides])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), JAX_PLATFORMS="cpu",
               TPU_STDERR_LOG_LEVEL="0", TPU_MIN_LOG_LEVEL="0")  # libtpu's own HBM report (`libtpu_hbm`)
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    every = list(proc.stdout)
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS (kB on Linux)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in every if not line.startswith(("W1", "I1", "E0"))]  # libtpu's log lines
    print("".join(lines[-25:]), flush=True)
    plan = json.load(open(out)) if os.path.exists(out) else {"error": [x.strip() for x in lines[-3:]]}
    plan.update(libtpu_hbm(every))
    plan.update(name=name, exit_code=proc.returncode, wall_s=time.time() - t0, overrides=overrides,
                host_rss_bytes=usage.ru_maxrss * 1024)
    return plan


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def libtpu_hbm(lines) -> dict:
    """XLA:TPU's own HBM account of the largest program it compiled, in bytes: `libtpu_hlo_temp_bytes` (the
    temporaries' allocation, as its buffer assignment laid it out), `libtpu_program_bytes` (that and the
    program's other HBM), `libtpu_arguments_bytes`. {} where libtpu printed none (other platforms).

    `memory_analysis().temp_size_in_bytes` can exceed this allocation: a program holding one ragged
    all-to-all of 1 GiB reports 3 GiB of temporaries against libtpu's 2 GiB (its buffer assignment's one
    temporary allocation) and XLA's own peak of arguments + outputs + 2 GiB (tools/bench/compile/NOTES.md)."""
    found = {}
    for line in lines:
        m = re.match(r"\s+(HLO temp|program|arguments)\s+([\d.]+)([KMGT]?)B?\b", line)
        if m:
            key = "libtpu_" + m.group(1).replace("HLO ", "hlo_") + "_bytes"
            found[key] = max(found.get(key, 0), int(float(m.group(2)) * _UNITS[m.group(3)]))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="Plan names to run (default: all).")
    ap.add_argument("--out", default="compile_bench.json")
    ap.add_argument("--outdir", default="compile_plans")
    a = ap.parse_args()
    outdir = str(user_path(a.outdir))
    os.makedirs(outdir, exist_ok=True)
    results = []
    for name, (topo, slices, over) in PLANS.items():
        if a.only and name not in a.only:
            continue
        results.append(run_plan(name, topo, slices, over, outdir))
    print(table(results))
    with open(user_path(a.out), "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
                   "load_avg": os.getloadavg(), "plans": results}, f, indent=1)


def table(results) -> str:
    by = {r["name"]: r for r in results}
    cols = ["plan", "mesh", "M x b", "seq", "params", "opt", "temp", "total GiB", "HBM", "fits",
            "compile s", "RSS GB", "RSS lowered", "step s", "MFU", "roofline s", "MFU bound", "ICI GiB",
            "network GiB", "total vs"]
    rows = []
    for r in results:
        if "total_bytes" not in r:
            rows.append([r["name"], "error: " + " ".join(r.get("error", []))[:80]] + [""] * (len(cols) - 2))
            continue
        g = lambda k: f"{r[k] / GiB:.2f}" if k in r else "-"
        base = by.get(BASELINE.get(r["name"], ""))
        rows.append([
            r["name"], " ".join(f"{a} {n}" for a, n in r["mesh"].items() if n > 1) or "1",
            f"{r['gradient_accumulation_steps']} x {r['micro_batch_seqs']}", str(r.get("seq_len", "")),
            g("params_bytes"), g("opt_state_bytes"),
            g("temp_bytes"), g("total_bytes"), g("hbm_bytes"), "yes" if r["fits"] else "no",
            f"{r['compile_s']:.0f}", f"{r['host_rss_bytes'] / 1e9:.2f}" if "host_rss_bytes" in r else "-",
            f"{r['host_peak_rss_lowered_bytes'] / 1e9:.2f}" if "host_peak_rss_lowered_bytes" in r else "-",
            f"{r['step_s_at_peak']:.2f}" if "step_s_at_peak" in r else "-",
            f"{100 * r['mfu_at_peak']:.0f}%" if "mfu_at_peak" in r else "-",
            f"{r['roofline_step_s']:.2f} ({r['roofline_bound']})" if "roofline_step_s" in r else "-",
            f"{100 * r['mfu_roofline']:.0f}%" if "mfu_roofline" in r else "-",
            g("collective_wire_bytes"), g("collective_network_wire_bytes"),
            f"{r['total_bytes'] / base['total_bytes']:.2f}x {base['name']}" if base and "total_bytes" in base else "",
        ])
    w = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(n) for x, n in zip(row, w))
    return "\n".join([fmt(cols), fmt(["-" * n for n in w])] + [fmt(r) for r in rows])


if __name__ == "__main__":
    main()
