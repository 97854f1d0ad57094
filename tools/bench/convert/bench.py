"""Benchmark of the checkpoint converter: throughput against a file copy, and peak memory.

One run: writes a random HF checkpoint of --model (bailing layout, sharded safetensors, written
through the converter's own PlannedWriter), copies its shards with shutil.copyfile (the
reference GB/s for the same bytes), then runs hf_to_ling2 and ling2_to_hf, each in its own
subprocess (a fresh python, like the CLI), --repeats times interleaved, each right after removing
its previous output and os.sync() (so one phase's writeback does not throttle the next), done
by the child once imported, as the copy does them just before copying: on this VM, memory
freed a second or more earlier is handed back to the host and costs ~0.5 GB/s to touch again
(7.5 GB/s when reused at once), so a delay between the two would slow only the conversions;
the best time of each is reported. A child times only the conversion (imports and
startup excluded, as for the copy) and reports its peak RSS (VmHWM) and its RSS right
before converting (python + jax + numpy, no tensors). All files are in the page cache for
both the copy and the conversions. The round trip is checked tensor by tensor. A conversion's
time is everything convert_hf_to_ling2 / convert_ling2_to_hf do: loading the config, the leaf
shapes (the abstract model, ling2.layers.model.abstract_model; also timed alone beforehand, "shapes"),
planning, every write and closing the files (like the copy, no fsync); "stream" is the ratio
of that time less "shapes".

Memory target: peak RSS <= 3x the largest single layer's bytes, a "layer" being one unit of
the HF checkpoint: decoder layer i (every model.layers.{i}.* tensor, MTP layers included), or
a top-level tensor on its own (the embedding, lm_head, the final norm). Both the absolute
peak and the peak above the pre-conversion RSS are reported against it.

  ./bazelw run //tools/bench/convert:bench -- [--model ling2-small] [--scan_layers] [--dtype fp32] [--out FILE]
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ling2.config.paths import user_path


def _status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process. VmHWM starts afresh at exec, whereas
    ru_maxrss keeps the forking parent's peak on Linux, which would count the bench's own memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(args) -> None:
    """Runs one conversion in this (fresh) process and prints a JSON line of its numbers."""
    from ling2.checkpoint.state import CONFIG_NAME, model_leaves, read_config
    from ling2.convert import convert, hf_config
    from ling2.layers.model import abstract_model

    read_config(args.cfg)  # imports and config loading stay outside the timing
    shutil.rmtree(args.dst, ignore_errors=True)  # as the copy: its previous output removed, then synced
    os.sync()
    before = _status_bytes("VmRSS")
    t0 = time.perf_counter()  # the config and leaf shapes alone, for the table (the conversion does them again)
    if args.child == "hf_to_ling2":
        hf = convert.read_hf_config(args.src)
        model_leaves(hf_config.load_ling2_config(hf, hf_config.detect_layout(hf), {
            "scan_layers": args.scan_layers, "weight_dtype": convert.DTYPES[args.dtype]}))
    else:
        model_leaves(read_config(Path(args.src) / CONFIG_NAME))
    shapes = time.perf_counter() - t0
    abstract_model.cache_clear()  # the timed conversion traces the model again
    t0, c0 = time.perf_counter(), os.times()
    if args.child == "hf_to_ling2":
        convert.convert_hf_to_ling2(args.src, args.dst, scan_layers=args.scan_layers, dtype=args.dtype,
                                    progress=False)
    else:
        convert.convert_ling2_to_hf(args.src, args.dst, shard_bytes=args.shard_mb << 20, progress=False)
    seconds, c1 = time.perf_counter() - t0, os.times()
    peak = _status_bytes("VmHWM")
    cpu = c1.user - c0.user + c1.system - c0.system
    print("RESULT " + json.dumps({"seconds": seconds, "shapes_seconds": shapes, "cpu_seconds": cpu,
                                 "rss_before": before, "peak_rss": peak}))


def write_hf(directory: Path, cfg, dtype, shard_bytes: int, seed: int = 0) -> dict:
    """A random HF checkpoint of `cfg`; returns {unit: bytes} (units as in the module doc)."""
    from ling2.checkpoint.safetensors_io import PlannedWriter
    from ling2.convert import convert, hf_config

    specs = convert.hf_specs(cfg, "bailing", dtype)
    writer = PlannedWriter(directory, specs, shard_bytes)
    rng = np.random.default_rng(seed)
    units = {}
    for name, shape, dt in specs:
        writer.add(name, rng.standard_normal(shape, np.float32).astype(dt))
        m = re.match(r"model\.layers\.(\d+)\.", name)
        unit = f"layer {m.group(1)}" if m else name
        units[unit] = units.get(unit, 0) + int(np.prod(shape)) * np.dtype(dt).itemsize
    writer.close()
    (directory / "config.json").write_text(json.dumps(hf_config.config_to_hf(cfg, "bailing")))
    return units


def run_child(kind, src, dst, args, cfg_path) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--src", str(src), "--dst", str(dst),
           "--cfg", str(cfg_path), "--dtype", args.dtype, "--shard_mb", str(args.shard_mb)]
    cmd += ["--scan_layers"] if args.scan_layers else []
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if out.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{out.stderr[-4000:]}")
    res = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    res["wall_seconds"] = time.perf_counter() - t0
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ling2-small")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="Ling2 config overrides")
    p.add_argument("--scan_layers", action="store_true")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 (HF tensors and Ling2 parameters)")
    p.add_argument("--shard_mb", type=int, default=256, help="HF shard size (input and output)")
    p.add_argument("--repeats", type=int, default=3, help="timings are the best of this many (peak RSS: the worst)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--out", default="", help="JSON path (relative: the working directory; default: "
                   "tools/bench/convert/results_cpu.json in the workspace)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0

    from ling2.config import load_config, to_yaml
    from ling2.checkpoint.safetensors_io import ShardedReader
    from ling2.convert import convert

    wd = Path(args.workdir or tempfile.mkdtemp(prefix="ling2_bench_convert_"))
    wd.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(convert.jax.numpy.dtype(convert.DTYPES[args.dtype]))
    cfg = load_config(model_name=args.model, weight_dtype=convert.DTYPES[args.dtype], *args.set)
    cfg_path = wd / "ling2.yml"
    cfg_path.write_text(to_yaml(cfg))
    try:
        units = write_hf(wd / "hf", cfg, dtype, args.shard_mb << 20)
        files = sorted(f for f in (wd / "hf").iterdir() if f.suffix == ".safetensors")
        nbytes = sum(f.stat().st_size for f in files)
        copies, fwds, bwds = [], [], []
        for _ in range(args.repeats):  # interleaved, each after a sync, so writeback of one does not slow the next
            shutil.rmtree(wd / "copy", ignore_errors=True)
            (wd / "copy").mkdir()
            os.sync()
            t0 = time.perf_counter()
            for f in files:
                shutil.copyfile(f, wd / "copy" / f.name)
            copies.append(time.perf_counter() - t0)
            for kind, src, dst, out in (("hf_to_ling2", "hf", "l2", fwds), ("ling2_to_hf", "l2", "hf2", bwds)):
                out.append(run_child(kind, wd / src, wd / dst, args, cfg_path))
        shutil.rmtree(wd / "copy")
        copy_s = min(copies)
        fwd, bwd = (min(rs, key=lambda r: r["seconds"]) | {"peak_rss": max(r["peak_rss"] for r in rs),
                                                           "stream_seconds": min(r["seconds"] - r["shapes_seconds"]
                                                                                 for r in rs),
                                                           "all_seconds": [r["seconds"] for r in rs]}
                    for rs in (fwds, bwds))
        a, b = ShardedReader(wd / "hf"), ShardedReader(wd / "hf2")
        assert a.names() == b.names(), "round trip changed the tensor names"
        for n in a.names():
            x, y = a.read(n), b.read(n)  # the expert biases come back in fp32 (routed_bias_dtype) from bf16
            assert np.array_equal(x.astype(np.float32), y.astype(np.float32)), f"round trip changed {n}"
    finally:
        if args.workdir is None:
            shutil.rmtree(wd, ignore_errors=True)

    unit, unit_bytes = max(units.items(), key=lambda kv: kv[1])
    layer = max((kv for kv in units.items() if kv[0].startswith("layer ")), key=lambda kv: kv[1])
    largest_tensor = max(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in convert.hf_specs(cfg, "bailing", dtype))
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    rows = []
    for name, r in (("hf_to_ling2", fwd), ("ling2_to_hf", bwd)):
        rows.append({"direction": name, "seconds": r["seconds"], "all_seconds": r["all_seconds"], "wall_seconds_with_startup": r["wall_seconds"],
                     "shapes_seconds": r["shapes_seconds"], "cpu_seconds": r["cpu_seconds"],
                     "stream_seconds": r["stream_seconds"],
                     "gb_per_s": gbps(r["seconds"]), "ratio_to_copy": gbps(r["seconds"]) / gbps(copy_s),
                     "stream_ratio_to_copy": copy_s / r["stream_seconds"],
                     "peak_rss_bytes": r["peak_rss"], "rss_before_bytes": r["rss_before"],
                     "peak_over_layer": r["peak_rss"] / unit_bytes,
                     "peak_above_before_over_layer": (r["peak_rss"] - r["rss_before"]) / unit_bytes})
    result = {
        "benchmark": "convert", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": args.model, "overrides": args.set, "scan_layers": args.scan_layers, "dtype": args.dtype,
        "checkpoint_bytes": nbytes, "num_tensors": len(a.names()), "num_shards": len(files),
        "copy_seconds": copy_s, "all_copy_seconds": copies, "repeats": args.repeats, "copy_gb_per_s": gbps(copy_s),
        "largest_layer": {"unit": unit, "bytes": unit_bytes,
                          "counted": "largest of: each decoder/MTP layer's HF tensors summed, and each top-level "
                                     "tensor (embedding, lm_head, final norm) alone",
                          "largest_decoder_layer": layer[0], "largest_decoder_layer_bytes": layer[1],
                          "largest_single_tensor_bytes": largest_tensor},
        "targets": {"ratio_to_copy_min": 0.5, "peak_rss_over_layer_max": 3.0},
        "rows": rows,
    }
    mb = lambda x: f"{x / 1e6:.0f} MB"  # noqa: E731
    print(f"\n{args.model} ({args.dtype}, scan_layers={args.scan_layers}): {mb(nbytes)} in {len(files)} shards, "
          f"{len(a.names())} tensors; largest layer {unit} = {mb(unit_bytes)} "
          f"(largest decoder layer {layer[0]} = {mb(layer[1])})")
    print(f"{'':14}{'seconds':>9}{'GB/s':>8}{'vs copy':>9}{'shapes s':>9}{'CPU s':>7}{'stream vs copy':>16}{'peak RSS':>10}"
          f"{'RSS before':>12}{'peak/layer':>12}{'(peak-before)/layer':>21}")
    print(f"{'file copy':14}{copy_s:9.2f}{gbps(copy_s):8.2f}{1.0:9.2f}")
    for r in rows:
        print(f"{r['direction']:14}{r['seconds']:9.2f}{r['gb_per_s']:8.2f}{r['ratio_to_copy']:9.2f}"
              f"{r['shapes_seconds']:9.2f}{r['cpu_seconds']:7.2f}{r['stream_ratio_to_copy']:16.2f}"
              f"{mb(r['peak_rss_bytes']):>10}{mb(r['rss_before_bytes']):>12}{r['peak_over_layer']:12.2f}"
              f"{r['peak_above_before_over_layer']:21.2f}")
    if args.out:
        out = user_path(args.out)
    else:
        out = Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", ".")) / "tools/bench/convert/results_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
