"""Compile-only memory plans of the one-GPU proxies' training gradient (issue 36): what XLA:GPU plans for
`tools.bench.gpu.mfu`'s whole step (jit(grad) of the trainer's objective, no optimizer) on one H100, by rows per
step and remat policy, from any host (the cuda venv; no GPU needed).

    JAX_PLATFORMS=cpu <cuda venv>/bin/python3 -m tools.bench.gpu.plans \\
        [--models ling2-1gpu,ling3-1gpu] [--rows 1,2,4,8,16] [--seq 4096] [--out tools/bench/gpu/plans_1gpu.json]

Per model: remat_policy none over the rows, stopping after the first that does not fit the H200; when none does not
fit 8 rows on the H100, the same for save_dot, then full, from the first row count none does not fit the H100 up.
Each row records XLA's memory analysis (`planned_bytes`: arguments + outputs + temporaries - aliased) and whether
that fits an H100 (XLA's H100 target: 84,942,979,072 bytes) and an H200 (139 GiB of the board's 143,771 MiB: what
the lent H200 machines offer). `ling2.topology` has no H200 target, so both verdicts read the H100 compile. A
training run adds Adam's two fp32 moments (`adam_bytes`, not compiled here). The JSON is rewritten after every
compile; `--resume` keeps its rows and plans the rest. JAX's cuDNN attention asks the local GPU whether it is a
Hopper before it takes MLA's 192-wide heads; a GPU-less host has none to ask, so the plans answer as the H100
target would (`answer_cudnn_checks_as_hopper`), or, with `--host_cudnn_checks`, as the host does (MLA then runs
`blocked`, as on pre-Hopper GPUs).
"""

import argparse
import json
import os
import resource
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2.config.paths import replaced
from ling2.layers.spec import ModelSpec
from tools.bench.gpu import mfu
from tools.bench.report import host_facts, planned_bytes, results_path

H100_BYTES = 84_942_979_072
H200_BYTES = 139 * 2**30
GiB = 2**30
CHEAPER_REMATS = ("save_dot", "full")
TRITON = '"__gpu$xla.gpu.triton"'  # a Pallas GPU (Triton) kernel call in compiled XLA:GPU HLO (jax 0.10)
CUDNN_ATTENTION = '"__cudnn$fmha'  # cuDNN fused attention, forward and backward


def answer_cudnn_checks_as_hopper() -> None:
    """JAX's cuDNN attention asks the local GPU's compute capability, which a GPU-less host lacks, and then admits
    head dims up to 128 only; answer 9.0, the H100 target's, so MLA's 192-wide heads take cuDNN as on the device."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    target = (9, 0)
    cc = lambda c: tuple(int(x) for x in c.split("."))  # noqa: E731
    fa.check_compute_capability = lambda c: target >= cc(c)
    fa.is_cuda_compute_capability_equal = lambda c: target == cc(c)


def _on(device, tree):
    """`tree`'s arrays as ShapeDtypeStructs replicated on `device`."""
    sharding = NamedSharding(Mesh(np.array([device]), ("d",)), P())
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def plan(model: str, rows: int, seq: int, remat_policy: str, device, as_hopper: bool = True) -> dict:
    """XLA:GPU's memory plan of `model`'s gradient step at [rows, seq] under `remat_policy`, for `device`;
    `as_hopper`: whether `answer_cudnn_checks_as_hopper` is in force (it must be before the first plan)."""
    from ling2.layers.model import count_params

    cfg = mfu.load(model, seq, {"remat_policy": remat_policy})
    graphdef, params, rest = mfu.split_abstract(cfg)
    params, rest = _on(device, params), _on(device, rest)
    mb = _on(device, mfu.batch_struct(rows, seq))
    n_params = count_params(ModelSpec.of(cfg))["total"]
    row = {"model": model, "rows": rows, "seq": seq, "tokens": rows * seq, "remat_policy": remat_policy,
           "attention_kernel": cfg.attention_kernel, "moe_gmm_backend": cfg.moe_gmm_backend,
           "params": n_params, "adam_bytes": 2 * 4 * n_params, "cudnn_checks_as_hopper": as_hopper}
    t0 = time.perf_counter()
    lowered = mfu.grad_step(graphdef, cfg, rows, seq).lower(params, rest, mb)
    row["lower_s"] = time.perf_counter() - t0
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a program XLA refuses is a row too
        row.update(compile_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {str(e)[:600]}",
                   fits_h100=False, fits_h200=False)
        return row
    row["compile_s"] = time.perf_counter() - t0
    row["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = compiled.memory_analysis()
    for f in ("argument", "output", "temp", "alias", "generated_code"):
        row[f"{f}_bytes"] = int(getattr(mem, f"{f}_size_in_bytes", 0) or 0)
    row["xla_peak_bytes"] = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    row["planned_bytes"] = planned_bytes(mem)
    text = compiled.as_text()
    row["triton_calls"] = text.count(TRITON)
    row["cudnn_attention_calls"] = text.count(CUDNN_ATTENTION)
    row["mla_attention"] = "cudnn" if row["cudnn_attention_calls"] else "blocked"
    row["fits_h100"] = row["planned_bytes"] <= H100_BYTES
    row["fits_h200"] = row["planned_bytes"] <= H200_BYTES
    return row


def sweep(models, rows_list, seq, device, save, done=(), as_hopper: bool = True, log=print) -> list:
    """Every plan the module doc names, in order (the cheaper policies from the first row count `none` does not
    fit the H100 up); `done`: rows already planned, kept and not compiled again; `save(rows)` after each."""
    out = list(done)
    have = {(r["model"], r["rows"], r["remat_policy"], r["cudnn_checks_as_hopper"]): r for r in out}

    def one(model, rows, policy):
        r = have.get((model, rows, policy, as_hopper))
        if r is None:
            r = plan(model, rows, seq, policy, device, as_hopper)
            out.append(r)
            save(out)
            log(f"{model} rows={rows} remat={policy} MLA {r.get('mla_attention')}: "
                + (r["error"][:200] if "error" in r else
                   f"{r['planned_bytes'] / GiB:.2f} GiB planned (temp {r['temp_bytes'] / GiB:.2f}), "
                   f"H100 {'fits' if r['fits_h100'] else 'no'}, H200 {'fits' if r['fits_h200'] else 'no'}, "
                   f"compile {r['compile_s']:.0f} s"))
        return r

    def policy_sweep(model, policy, rows_from):
        planned = []
        for rows in [n for n in rows_list if n >= rows_from]:
            planned.append(one(model, rows, policy))
            if not planned[-1]["fits_h200"]:
                break
        return planned

    for model in models:
        none = policy_sweep(model, "none", 0)
        if not any(r["rows"] == 8 and r["fits_h100"] for r in none):
            short = min([r["rows"] for r in none if not r["fits_h100"]] or [8])
            for policy in CHEAPER_REMATS:
                policy_sweep(model, policy, short)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="ling2-1gpu,ling3-1gpu")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", default="", help="default: tools/bench/gpu/plans_1gpu.json of the repository")
    p.add_argument("--resume", action="store_true", help="keep the rows --out already holds; plan only the rest")
    p.add_argument("--extra", default="", help="more plans after the sweep: model:rows:remat_policy, comma-separated")
    p.add_argument("--host_cudnn_checks", action="store_true",
                   help="let JAX's cuDNN checks ask this GPU-less host (MLA's 192-wide heads then run blocked)")
    a = p.parse_args(argv)
    a.out = results_path(a.out, "gpu", "plans_1gpu.json")
    from ling2 import topology

    as_hopper = not a.host_cudnn_checks
    if as_hopper:
        answer_cudnn_checks_as_hopper()
    device = topology.devices("h100-1")[0]
    record = {**host_facts(), "target": "h100-1 (ling2.topology; XLA:GPU compile-only)",
              "h100_bytes": H100_BYTES, "h200_bytes": H200_BYTES, "rows": []}

    def save(rows):
        record["rows"] = rows
        with replaced(a.out) as fh:
            json.dump(record, fh, indent=2)

    done = []
    if a.resume and os.path.exists(a.out):
        with open(a.out) as fh:
            done = [r for r in json.load(fh)["rows"] if "error" not in r]
        for r in done:
            r.setdefault("cudnn_checks_as_hopper", False)
            r.setdefault("mla_attention", "cudnn" if r["cudnn_attention_calls"] else "blocked")
            r.update(fits_h100=r["planned_bytes"] <= H100_BYTES, fits_h200=r["planned_bytes"] <= H200_BYTES)
    rows = sweep([m for m in a.models.split(",") if m], [int(r) for r in a.rows.split(",")], a.seq, device, save, done,
                 as_hopper)
    have = {(r["model"], r["rows"], r["remat_policy"], r["cudnn_checks_as_hopper"]) for r in rows}
    for model, n, policy in (x.split(":") for x in a.extra.split(",") if x):
        if (model, int(n), policy, as_hopper) not in have:
            rows.append(plan(model, int(n), a.seq, policy, device, as_hopper))
            save(rows)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
