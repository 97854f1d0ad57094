"""Compile-only plan of a training run on a named accelerator topology, from any host.

  bazel run --config=tpu //ling2/train:compile -- --topology=v5p-128 [--num_slices=2] \\
      [--config=FILE] [--out=plan.json] model_name=ling2 key=value ...

Compiles the trainer's own step (`loop.compile_train_step`: the same step function, shardings,
gradient accumulation, MoE + expert parallelism, MTP and remat) for the topology's devices, with
abstract state only (nothing is materialised), and prints per chip: arguments (parameters,
optimizer state, batch), temporaries and outputs; the total against the chip's HBM is XLA's own
peak of live buffers plus the generated code (the parts' sum overstates it: XLA reuses the memory
of donated arguments and of dead buffers for temporaries; this peak is what its own out-of-HBM
check uses), or the sum where XLA reports no peak; compile
time; FLOPs per step from XLA's cost analysis (which counts a loop body once: shown also times
the micro-batches) next to Ling2's own count; the step time Ling2's FLOPs (x 4/3 under full
remat, which runs each forward twice, plus a pipeline's bubble) take at the chip's peak, and the MFU bound
that gives; then the roofline: collective and HBM bytes read from the compiled HLO against the chip's
bandwidths (on GPU clusters, collectives whose groups span hosts at the NIC's speed), and the MFU bound at the
slowest term. The last line is
`<topology>: <X> GiB of <Y> GiB per chip (fits)` or `(does not fit, short by Z GiB)`; exit 0 / 1.
Bad input (unknown topology, a mesh or batch that does not divide the topology, bad config
keys) exits 2 with the error named. On TPUs the plan counts the collectives XLA offloaded to the SparseCores;
`--nosparse_core_collectives` keeps them on the TensorCores (Ironwood's large plans need it on a 24 GB host).
"""

import json
import math
import os
import re
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", None, "Target, e.g. v5p-128, v6e-256, v4-32, v5e-16, h100-8 (see ling2/topology.py).")
flags.DEFINE_integer("num_slices", 1, "Identical TPU slices joined over the data-center network (multi-slice; set "
                     "dcn_*_parallelism to split the mesh over them, default: all over dcn_data).")
flags.DEFINE_string("config", "configs/base.yml", "Root config file (relative: the working directory, then the repository).")
flags.DEFINE_string("out", None, "Write the plan as JSON here.")
flags.DEFINE_bool("sparse_core_collectives", True, "TPU: let XLA run collectives on the chip's SparseCores where it "
                  "offloads them (its default). --nosparse_core_collectives keeps them on the TensorCores: an Ironwood "
                  "(tpu7x) plan compiles its SparseCore collective programs in about twice the host memory and time "
                  "(tools/bench/compile/NOTES.md); the plan is then of that program.")

GiB = 1024**3


class PlanError(ValueError):
    """Bad input to a plan: its message names the flag or config field."""


# libtpu's switches for each kind of collective it can offload to the SparseCores.
_SPARSE_CORE_COLLECTIVES_OFF = tuple(
    f"--xla_tpu_enable_sparse_core_collective_offload_{kind}=false"
    for kind in ("all_gather", "all_reduce", "reduce_scatter", "nd_reduce_scatter", "dense_all_to_all",
                 "ragged_all_to_all"))


def libtpu_init_args(current: str, sparse_core_collectives: bool) -> str:
    """LIBTPU_INIT_ARGS for a plan: the user's own, then the SparseCore collective switches when they are off."""
    return " ".join([current.strip(), *(() if sparse_core_collectives else _SPARSE_CORE_COLLECTIVES_OFF)]).strip()


_SPARSE_CORE_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%(?:all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute)\S* = "
    r'.*async_execution_thread="sparsecore"', re.M)


def count_sparse_core_collectives(hlo_text: str) -> int:
    """The compiled program's collectives that XLA offloaded to the SparseCores (async calls on their thread;
    its other SparseCore work, e.g. scatters and copies, is not counted)."""
    return len(_SPARSE_CORE_COLLECTIVE.findall(hlo_text))


def _shard_bytes(x) -> int:
    shape = x.sharding.shard_shape(x.shape)
    return math.prod(shape) * x.dtype.itemsize


def _tree_bytes(tree) -> int:
    import jax

    return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# XLA:TPU refuses a program over HBM at compile time; these are its messages (sizes in 1024-based units).
_OOM = (re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
        re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"))


def hbm_overflow(msg: str):
    """(what, bytes, available bytes) from XLA:TPU's out-of-memory compile error, or None. `what` is
    "temporaries" or "total"; both count the whole heap XLA planned, the arguments (parameters, optimizer
    state, batch) included: the "HLO temporaries" figure of a program whose arguments alone exceed the
    chip is larger than those arguments (tools/bench/compile/NOTES.md)."""
    for what, pat in zip(("temporaries", "total"), _OOM):
        m = pat.search(msg)
        if m:
            return what, float(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) * _UNITS[m.group(4)]
    return None


def check_plan(cfg, topo, mesh) -> None:
    """PlanError when the batch does not split over the mesh's batch axes."""
    n = mesh.size
    rows = cfg.per_device_batch_size * n
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    if rows != int(rows) or int(rows) < 1 or int(rows) % batch_shards:
        raise PlanError(f"per_device_batch_size: {cfg.per_device_batch_size} x {n} chips = {rows:g} rows per "
                        f"micro-batch, which do not split over data x fsdp x expert = {batch_shards} of {topo.name}'s "
                        f"mesh {dict(mesh.shape)}")


def plan(cfg, topo, log=print) -> dict:
    """Compiles the train step of `cfg` for `topo` and returns the plan (bytes per chip, FLOPs, times)."""
    from ling2.layers.model import count_params, layer_flops_per_token, training_flops_per_token
    from ling2.layers.spec import ModelSpec
    from ling2.train.loop import abstract_batch, compile_train_step, host_peak_rss_bytes
    from ling2.train.runtime import make_mesh
    from ling2.train.state import abstract_state

    try:
        devices = topo.devices()
    except RuntimeError as e:  # the platform's compiler is not installed
        raise PlanError(str(e)) from e
    try:
        mesh = make_mesh(cfg, devices)
    except ValueError as e:
        raise PlanError(f"{e} (topology {topo.name}, {topo.num_slices} slice(s) of {topo.chips_per_slice} chips)") from e
    check_plan(cfg, topo, mesh)
    chips = mesh.size
    seqs = cfg.global_batch_size(chips)
    tokens = seqs * cfg.max_target_length
    out = {"topology": topo.name, "num_slices": topo.num_slices, "chips": chips, "device_kind": topo.chip.device_kind,
           "mesh": dict(mesh.shape), "model_name": cfg.model_name, "params": count_params(ModelSpec.of(cfg))["total"],
           "seq_len": cfg.max_target_length, "global_batch_seqs": seqs, "tokens_per_step": tokens,
           "micro_batch_seqs": cfg.micro_batch_size(chips), "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
           "remat_policy": cfg.remat_policy, "scan_layers": cfg.scan_layers, "loss_vocab_blocks": cfg.loss_vocab_blocks,
           "hbm_bytes": topo.chip.hbm_bytes, "peak_flops": topo.chip.peak_bf16_flops}
    log(f"{topo.name} x{topo.num_slices}: {chips} chips ({topo.chip.device_kind}), mesh {dict(mesh.shape)}; "
        f"{cfg.model_name} {out['params'] / 1e9:.2f}B params; {seqs} x {cfg.max_target_length} tokens per step "
        f"({cfg.gradient_accumulation_steps} micro-batches of {out['micro_batch_seqs']})")
    setup = abstract_state(cfg, mesh)
    state = setup.state
    out["params_bytes"] = _tree_bytes((state.params, state.rest))
    out["opt_state_bytes"] = _tree_bytes((state.opt_state, state.step, state.skipped, state.skipped_total))
    out["batch_bytes"] = _tree_bytes(abstract_batch(cfg, mesh))
    out["host_peak_rss_abstract_bytes"] = host_peak_rss_bytes()
    t0 = time.perf_counter()
    phases = {}
    try:
        compiled = compile_train_step(cfg, mesh, setup, phases)
    except Exception as e:  # noqa: BLE001 - XLA reports a program over HBM as a compile error
        over = hbm_overflow(str(e))
        if over is None:
            raise
        _, used, avail = over
        out.update(phases, compile_s=time.perf_counter() - t0, host_peak_rss_bytes=host_peak_rss_bytes(),
                   total_bytes=int(used), fits=False,
                   xla_oom=str(e).splitlines()[0][:500], xla_available_hbm_bytes=int(avail))
        log(f"XLA: {out['xla_oom']}")
        return out
    out.update(phases, compile_s=time.perf_counter() - t0, host_peak_rss_bytes=host_peak_rss_bytes())
    mem = compiled.memory_analysis()
    field = lambda f: int(getattr(mem, f, 0) or 0)
    for f in ("argument", "output", "temp", "alias", "generated_code"):
        out[f"{f}_bytes"] = field(f"{f}_size_in_bytes")
    out["sum_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
                        + out["generated_code_bytes"])
    out["xla_peak_bytes"] = field("peak_memory_in_bytes")  # 0: not reported (XLA:GPU before the buffers)
    out["total_bytes"] = (out["xla_peak_bytes"] + out["generated_code_bytes"] if out["xla_peak_bytes"]
                          else out["sum_bytes"])
    out["fits"] = out["total_bytes"] <= topo.chip.hbm_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # XLA's cost analysis counts a while loop's body once: x M undoes it for the accumulation loop,
    # but scanned layers, blocked attention, chunked GLA and the vocab-blocked loss are loops too.
    # The projection therefore uses Ling2's count, x 4/3 under full remat (each forward runs twice).
    out["xla_flops_per_chip"] = float(cost.get("flops", 0.0)) if cost else 0.0
    out["xla_flops_per_chip_x_accum"] = out["xla_flops_per_chip"] * cfg.gradient_accumulation_steps
    out["ling2_flops_per_chip"] = training_flops_per_token(ModelSpec.of(cfg), cfg.max_target_length) * tokens / chips
    recompute = 4 / 3 if cfg.remat_policy == "full" else 1.0
    out["step_flops_basis"] = f"ling2 x {recompute:.3g} (remat {cfg.remat_policy})"
    executed = out["ling2_flops_per_chip"] * recompute
    stages = dict(mesh.shape).get("stage", 1)
    if stages > 1:  # every stage computes at every step of the schedule: the bubble's steps too
        spec = ModelSpec.of(cfg)
        piped = sum(layer_flops_per_token(spec, layer, cfg.max_target_length) for layer in spec.plan.layers
                    if layer.stack) * tokens / chips
        P = cfg.pipeline_microbatches
        out["pipeline_bubble"] = (stages - 1) / (P + stages - 1)
        out["pipelined_flops_per_chip"] = piped
        executed += piped * (stages - 1) / P * recompute
        out["step_flops_basis"] += f", + the pipeline bubble ({stages} stages, {P} micro-batches)"
    peak = topo.chip.peak_bf16_flops
    out["step_s_at_peak"] = executed / peak
    out["mfu_at_peak"] = out["ling2_flops_per_chip"] / executed
    hlo = compiled.as_text()
    out.update(roofline(hlo, dict(mesh.shape), topo.chip, out["step_s_at_peak"], cfg))
    if topo.chip.platform == "tpu":
        out["sparse_core_collective_calls"] = count_sparse_core_collectives(hlo)
    out["mfu_roofline"] = out["ling2_flops_per_chip"] / peak / out["roofline_step_s"]
    return out


def roofline(hlo_text: str, mesh_shape: dict, chip, compute_s: float, cfg) -> dict:
    """Bytes the compiled step moves per chip (`hlo_traffic`: collectives by kind and mesh axis, HBM) and the
    step-time bound max(compute, HBM bytes / HBM bandwidth, ICI bytes / ICI bandwidth) from the chip's
    published numbers (`ling2.topology.CHIPS`; an ICI figure of 0 is unpublished and leaves that term out).
    On GPU clusters a collective whose group spans hosts is charged to the network term (bytes / the NIC's
    bandwidth) instead of ICI (NVLink)."""
    from ling2.topology import CHIP_SOURCES, GPUS_PER_HOST
    from ling2.train import hlo_traffic

    network = chip.network_bandwidth
    t = hlo_traffic.traffic(hlo_text, mesh_shape, GPUS_PER_HOST if network else 0)
    wire = sum(v["wire_bytes"] for v in t["collectives"].values())
    across = sum(v["network_wire_bytes"] for v in t["collectives"].values())
    out = {"collectives": [{"kind": k, "axes": list(a), **v} for (k, a), v in
                           sorted(t["collectives"].items(), key=lambda kv: -kv[1]["wire_bytes"])],
           "collective_wire_bytes": wire, "hbm_traffic_bytes": t["hbm_bytes"], "hlo_unknown_loops": t["unknown_loops"],
           "chip_hbm_bandwidth": chip.hbm_bandwidth, "chip_ici_bandwidth": chip.ici_bandwidth,
           "chip_source": CHIP_SOURCES.get(chip.generation, "")}
    terms = {"compute": compute_s, "hbm": t["hbm_bytes"] / chip.hbm_bandwidth if chip.hbm_bandwidth else 0.0,
             "ici": (wire - across) / chip.ici_bandwidth if chip.ici_bandwidth else 0.0}
    if network:
        out.update(collective_network_wire_bytes=across, chip_network_bandwidth=network)
        terms["network"] = across / network
    out["roofline_s"] = terms
    out["roofline_step_s"] = max(terms.values())
    out["roofline_bound"] = max(terms, key=terms.get)
    context = mesh_shape.get("context", 1)
    if context > 1:  # every kernel attends for the queries in the zigzag layout (`ling2.kernels.attention.context`)
        from ling2.kernels.attention.context import key_blocks_per_device

        work = key_blocks_per_device(context)
        out["full_attention_context_layout"] = "zigzag"
        out["full_attention_context_imbalance"] = max(work) / (sum(work) / context)
    return out


def table(p: dict) -> str:
    """The per-chip plan as text (the verdict line is printed apart)."""
    g = lambda b: f"{b / GiB:9.2f} GiB"
    rows = [("compile time (lowering + XLA)", f"{p['compile_s']:9.1f} s"
             + (f"  (lowering {p['lower_s']:.1f} s)" if "lower_s" in p else ""))]
    if "host_peak_rss_bytes" in p:
        rows += [("host peak RSS", g(p["host_peak_rss_bytes"])),
                 ("  with abstract state built", g(p["host_peak_rss_abstract_bytes"]))]
        if "host_peak_rss_lowered_bytes" in p:
            rows += [("  once lowered (before XLA)", g(p["host_peak_rss_lowered_bytes"]))]
    if "argument_bytes" in p:
        other = p["argument_bytes"] - p["params_bytes"] - p["opt_state_bytes"] - p["batch_bytes"]
        rows += [
            ("arguments", g(p["argument_bytes"])),
            ("  parameters", g(p["params_bytes"])),
            ("  optimizer state", g(p["opt_state_bytes"])),
            ("  batch", g(p["batch_bytes"])),
            ("  layout padding (XLA - shapes)", g(other)),
            ("temporaries", g(p["temp_bytes"])),
            ("outputs", g(p["output_bytes"])),
            ("  aliased with arguments (donated)", g(-p["alias_bytes"])),
            ("generated code", g(p["generated_code_bytes"])),
            ("sum of the above (no reuse)", g(p["sum_bytes"])),
            ("XLA's peak of live buffers", g(p["xla_peak_bytes"]) if p["xla_peak_bytes"] else "   not reported"),
            ("total (peak + code, else the sum)", g(p["total_bytes"])),
            ("chip HBM", g(p["hbm_bytes"])),
            ("FLOPs per chip per step, XLA", f"{p['xla_flops_per_chip']:12.4g}  (each loop body once)"),
            (f"  x {p['gradient_accumulation_steps']} micro-batches", f"{p['xla_flops_per_chip_x_accum']:12.4g}"
             + ("  (scanned layers: still one group)" if p["scan_layers"] else "")),
            ("FLOPs per chip per step, Ling2", f"{p['ling2_flops_per_chip']:12.4g}"),
            ("step time at peak", f"{p['step_s_at_peak']:9.3f} s  ({p['step_flops_basis']} FLOPs)"),
            ("MFU at that step time (bound)", f"{100 * p['mfu_at_peak']:9.1f} %"),
        ]
        if "roofline_s" in p:
            r = p["roofline_s"]
            rows += [("HBM traffic per chip (HLO estimate)", g(p["hbm_traffic_bytes"])),
                     ("collective bytes per chip (wire)", g(p["collective_wire_bytes"]))]
            rows += [(f"  {c['kind']} over {'x'.join(c['axes']) or 'none'}", g(c["wire_bytes"])
                      + f"  ({c['count']:.0f} calls)") for c in p["collectives"][:8]]
            rows += [("roofline step: compute / HBM / ICI", f"{r['compute']:9.4g} / {r['hbm']:.4g} / {r['ici']:.4g} s")]
            if "network" in r:
                rows += [("  network (collectives across hosts)", f"{r['network']:9.4g} s  "
                          f"({p['collective_network_wire_bytes'] / GiB:.2f} GiB at "
                          f"{p['chip_network_bandwidth'] / 1e9:.0f} GB/s per GPU)")]
            rows += [
                     ("roofline step estimate", f"{p['roofline_step_s']:9.4g} s  ({p['roofline_bound']}-bound; "
                      f"{p['chip_hbm_bandwidth'] / 1e9:.0f} GB/s HBM, {p['chip_ici_bandwidth'] / 1e9:.0f} GB/s ICI: "
                      f"{p['chip_source']})"),
                     ("MFU bound at the roofline step", f"{100 * p['mfu_roofline']:9.1f} %")]
            if "sparse_core_collective_calls" in p:
                rows += [("collectives run on SparseCores", f"{p['sparse_core_collective_calls']:9d} calls"
                          + ("" if p.get("sparse_core_collectives", True) else "  (off: --nosparse_core_collectives)"))]
            if "full_attention_context_imbalance" in p:
                rows += [("full attention: causal work, max / mean shard",
                          f"{p['full_attention_context_imbalance']:9.3f}  "
                          f"({p.get('full_attention_context_layout', 'contiguous')} layout)")]
    else:
        rows += [("parameters", g(p["params_bytes"])), ("optimizer state", g(p["opt_state_bytes"])),
                 ("batch", g(p["batch_bytes"])), ("total (XLA stopped: out of HBM)", g(p["total_bytes"])),
                 ("chip HBM", g(p["hbm_bytes"]))]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def verdict(p: dict) -> str:
    head = f"{p['topology']}" + (f" x{p['num_slices']}" if p["num_slices"] > 1 else "")
    x, y = p["total_bytes"] / GiB, p["hbm_bytes"] / GiB
    if p["fits"]:
        return f"{head}: {x:.2f} GiB of {y:.2f} GiB per chip (fits)"
    return f"{head}: {x:.2f} GiB of {y:.2f} GiB per chip (does not fit, short by {x - y:.2f} GiB)"


def main(argv) -> int:
    from absl import logging

    from ling2 import topology
    from ling2.config import ConfigError, load_config
    from ling2.config.schema import MESH_AXES
    from ling2.config.paths import check_writable, find_file, replaced, user_path

    logging.set_verbosity(logging.WARNING)
    if FLAGS.num_slices < 1:
        print(f"error: bad flag: --num_slices must be >= 1, got {FLAGS.num_slices}", file=sys.stderr)
        return 2
    if not FLAGS.topology:
        print("error: --topology is required (e.g. --topology=v5p-64)", file=sys.stderr)
        return 2
    try:
        topo = topology.parse(FLAGS.topology, FLAGS.num_slices)
    except ValueError as e:
        print(f"error: --topology: {e}", file=sys.stderr)
        return 2
    if not FLAGS.sparse_core_collectives:
        if topo.chip.platform != "tpu":
            print(f"error: bad flag: --nosparse_core_collectives: {topo.name} is not a TPU topology", file=sys.stderr)
            return 2
        os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args(os.environ.get("LIBTPU_INIT_ARGS", ""), False)
    out = user_path(FLAGS.out) if FLAGS.out else None  # relative to where the user ran bazel, not the runfiles
    if out is not None:
        try:
            check_writable(out)  # before minutes of compiling, not after
        except ValueError as e:
            print(f"error: --out: {e}", file=sys.stderr)
            return 2
    overrides = list(argv[1:])
    try:
        cfg = load_config(*overrides, config_file=find_file(FLAGS.config))
        if topo.num_slices > 1 and all(getattr(cfg, f"dcn_{a}_parallelism") == 1 for a in MESH_AXES):
            cfg = load_config(*overrides, f"dcn_data_parallelism={topo.num_slices}", config_file=find_file(FLAGS.config))
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    try:
        p = plan(cfg, topo)
    except ValueError as e:  # PlanError and the model's own checks name their field
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    p["sparse_core_collectives"] = FLAGS.sparse_core_collectives
    print(table(p))
    if out is not None:
        try:
            with replaced(out) as f:  # whole or not at all
                f.write(json.dumps(p, indent=1) + "\n")
        except OSError as e:
            print(f"error: --out: cannot write {out}: {e}", file=sys.stderr)
            return 2
    print(verdict(p))
    return 0 if p["fits"] else 1


if __name__ == "__main__":
    from ling2.config import cli

    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)
