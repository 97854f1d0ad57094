"""Where a traced step's device time goes (issue 36): a per-kernel table of a JAX profiler trace.

    python -m tools.bench.gpu.trace TRACE_DIR [--steps N] [--csv FILE] [--json FILE] [--top 40] \\
        [--planes REGEX] [--lines REGEX]

TRACE_DIR is what `jax.profiler.trace(TRACE_DIR)` wrote (`plugins/profile/<run>/<host>.xplane.pb`: the newest
run's files are read) or one `.xplane.pb`, parsed by JAX's own `jax.profiler.ProfileData`. The events read:
  GPU  (the default when the trace has a `/device:GPU:<i>` plane) those planes' `Stream #<id>(...)` lines: one
       event per kernel, memcpy or memset on a CUDA stream, named as the kernel: a library's own (cuBLAS `nvjet_*`,
       `sm90_xmma_gemm_*`; cuDNN; CUB), a fusion's for XLA's generated kernels (identical fusions share one:
       kernel `loop_add_fusion` runs HLO `loop_add_fusion.1`, `.2`, ...), the `name=` of a pallas_call (`__<n>`
       added when repeated). Its `hlo_op` stat is the thunk that launched it: the HLO op (`loop_add_fusion.2`,
       `custom-call.115`, `copy.198`), but `command_buffer_<n>` for every kernel of a CUDA graph
       (XLA_FLAGS=--xla_gpu_enable_command_buffer= traces without them).
  CPU  (otherwise) `/host:CPU`: the events carrying an `hlo_op` stat (XLA:CPU's executed thunks, on its client's
       worker threads), innermost only (a while or conditional's event encloses its body's). Name = HLO op.
--planes / --lines override the choice (regexes on plane and line names); the JSON records what was read.

One row per event name: count, total_us, mean_us (device microseconds), share (of the rows' summed time, so
streams that overlap each count), category (`CATEGORIES`, from the name, else from the HLO op), the HLO op
and module most often seen (`+k` when it launched from k more). busy_us: the union of the event intervals of
a plane (overlapping streams or threads count once), averaged over the planes read; wall_us: the first
event's start to the last one's end; busy_fraction = busy_us / wall_us. With --steps N also per step.
"""

import argparse
import csv
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

CATEGORIES = ("GEMM", "Pallas/Triton", "cuDNN", "sort", "gather/scatter", "other fusion", "copy", "other")

# First match wins (case-insensitive search); cuDNN's names hold "gemm"-like words, XLA's Triton GEMMs
# "triton", so the order matters.
_RULES = (
    ("cuDNN", r"cudnn|flash_[fb]prop|fmha|sdpa"),
    ("copy", r"memcpy|memset|(^|[_.\-])copy([_.\-\d]|$)"),
    ("sort", r"sort|radix|cub::"),
    ("gather/scatter", r"gather|scatter"),
    ("GEMM", r"gemm|gemv|xmma|nvjet|cutlass|cublas|matmul|(^|[_.\-])dot([_.\-\d]|$)"),
    ("Pallas/Triton", r"triton|pallas|mosaic|^ling2_|(^|_)kernel(_+\d+)*$"),
    ("other fusion", r"fusion|(^|[_.\-])reduce|^wrapped_|^(loop|input)_"),
)
_COMPILED = tuple((cat, re.compile(rx, re.IGNORECASE)) for cat, rx in _RULES)

GPU_PLANES = r"^/device:GPU:\d+$"
CPU_PLANES = r"^/host:CPU$"
STREAM_LINES = r"^Stream #"


class Event(NamedTuple):
    name: str
    hlo_op: str
    hlo_module: str
    start_ns: float
    end_ns: float
    plane: int  # index into the planes read


def category(name: str, hlo_op: str = "") -> str:
    """The kernel's category by its name, else by the HLO op that launched it, else "other"."""
    for text in (name, hlo_op):
        for cat, rx in _COMPILED:
            if text and rx.search(text):
                return cat
    return "other"


def union_ns(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def xplane_files(path) -> list[Path]:
    """The .xplane.pb files of the newest run under a trace folder (or the one file given)."""
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(p.rglob("*.xplane.pb")) if p.is_dir() else []
    if not files:
        raise SystemExit(f"trace: no *.xplane.pb under {p} (expected {p}/plugins/profile/<run>/<host>.xplane.pb, "
                         "as jax.profiler.trace writes)")
    runs = sorted({f.parent for f in files}, key=lambda d: (d.name, str(d)))  # run folders: named by start time
    if len(runs) > 1:
        print(f"trace: {len(runs)} runs under {p}; reading the newest, {runs[-1]}", file=sys.stderr)
    return [f for f in files if f.parent == runs[-1]]


def _stat(event, keys=("hlo_op", "hlo_module")) -> dict:
    out = {}
    for k, v in event.stats:
        if k in keys and v is not None:
            out[k] = str(v)
    return out


def _innermost(events: list[Event]) -> list[Event]:
    """Drops the events of one thread that enclose another (control flow around its body's ops)."""
    events = sorted(events, key=lambda e: (e.start_ns, -e.end_ns))
    return [e for e, nxt in zip(events, events[1:] + [None])
            if nxt is None or not (nxt.start_ns < e.end_ns and nxt.end_ns <= e.end_ns)]


def read_events(files, planes: str | None = None, lines: str | None = None) -> tuple[list[Event], list[dict]]:
    """The selected events of `files` and, per plane read, {file, plane, kind, lines: {name: events}}.

    planes: regex on plane names (default GPU_PLANES if any plane matches, else CPU_PLANES). A `/device:` plane
    gives all events of its lines matching `lines` (default STREAM_LINES); any other plane gives the innermost
    events with an `hlo_op` stat of its lines matching `lines` (default all)."""
    from jax.profiler import ProfileData

    data = []
    for f in files:
        try:
            data.append((str(f), ProfileData.from_file(str(f))))
        except Exception as e:  # the C++ reader's errors name no file
            raise SystemExit(f"trace: cannot read {f}: {e}") from e
    names = [(f, p.name) for f, pd in data for p in pd.planes]
    if planes is None:
        planes = GPU_PLANES if any(re.search(GPU_PLANES, n) for _, n in names) else CPU_PLANES
    events, chosen = [], []
    for f, pd in data:
        for plane in pd.planes:
            if not re.search(planes, plane.name):
                continue
            device = plane.name.startswith("/device:")
            line_rx = lines if lines is not None else (STREAM_LINES if device else "")
            info = {"file": f, "plane": plane.name, "kind": "device" if device else "host_xla_ops", "lines": {}}
            idx = len(chosen)
            for line in plane.lines:
                if not re.search(line_rx, line.name):
                    continue
                got = []
                for e in line.events:
                    st = _stat(e)
                    if device or "hlo_op" in st:
                        got.append(Event(e.name, st.get("hlo_op", ""), st.get("hlo_module", ""),
                                         e.start_ns, e.end_ns, idx))
                if not device:
                    got = _innermost(got)
                if got:
                    info["lines"][line.name] = len(got)
                    events += got
            if info["lines"]:
                chosen.append(info)
    if not events:
        raise SystemExit(f"trace: no events in planes /{planes}/ lines /{lines or 'default'}/ of "
                         f"{', '.join(str(f) for f in files)}; its planes: {sorted({n for _, n in names})}")
    return events, chosen


def _most_common(counter: Counter) -> str:
    if not counter:
        return ""
    (top, _), more = counter.most_common(1)[0], len(counter) - 1
    return f"{top} +{more}" if more else top


def summarize(events: list[Event], planes: list[dict], steps: int | None = None) -> dict:
    """The table (rows by total time, descending), the category totals and busy vs wall time."""
    by_name = defaultdict(list)
    for e in events:
        by_name[e.name].append(e)
    kernel_ns = sum(e.end_ns - e.start_ns for e in events)
    rows = []
    for name, evs in by_name.items():
        total = sum(e.end_ns - e.start_ns for e in evs)
        ops = Counter(e.hlo_op for e in evs if e.hlo_op)
        mods = Counter(e.hlo_module for e in evs if e.hlo_module)
        row = {"name": name, "category": category(name, ops.most_common(1)[0][0] if ops else ""),
               "count": len(evs), "total_us": total / 1e3, "mean_us": total / 1e3 / len(evs),
               "share": total / kernel_ns if kernel_ns else 0.0,
               "hlo_op": _most_common(ops), "hlo_module": _most_common(mods)}
        if steps:
            row.update(count_per_step=len(evs) / steps, us_per_step=total / 1e3 / steps)
        rows.append(row)
    rows.sort(key=lambda r: (-r["total_us"], r["name"]))
    cats = {c: {"category": c, "count": 0, "total_us": 0.0, "share": 0.0} for c in CATEGORIES}
    for r in rows:
        c = cats[r["category"]]
        c["count"] += r["count"]
        c["total_us"] += r["total_us"]
        c["share"] += r["share"]
    for i, p in enumerate(planes):
        p["busy_us"] = union_ns((e.start_ns, e.end_ns) for e in events if e.plane == i) / 1e3
    busy = sum(p["busy_us"] for p in planes) / len(planes)
    wall = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) / 1e3
    out = {"planes": planes, "events": len(events), "kernel_us": kernel_ns / 1e3, "busy_us": busy, "wall_us": wall,
           "busy_fraction": busy / wall if wall else 0.0, "steps": steps,
           "categories": sorted(cats.values(), key=lambda c: -c["total_us"]), "rows": rows}
    if steps:
        out.update(busy_per_step_us=busy / steps, wall_per_step_us=wall / steps)
    return out


def read(trace, steps: int | None = None, planes: str | None = None, lines: str | None = None) -> dict:
    """`summarize` of a trace folder or .xplane.pb, with the files read."""
    files = xplane_files(trace)
    events, read_planes = read_events(files, planes, lines)
    return {"trace": str(trace), "files": [str(f) for f in files], **summarize(events, read_planes, steps)}


ROW_COLUMNS = ("name", "category", "count", "total_us", "mean_us", "share", "hlo_op", "hlo_module",
               "count_per_step", "us_per_step")


def write_csv(result: dict, path) -> None:
    cols = [c for c in ROW_COLUMNS if c in result["rows"][0]]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["rows"])


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "~"


def report(result: dict, top: int) -> str:
    """The top rows and the category summary as text."""
    steps = result["steps"]
    per = f"; per step busy {result['busy_per_step_us']:.1f} us, wall {result['wall_per_step_us']:.1f} us" \
        if steps else ""
    head = [f"trace {result['trace']}: {result['events']} events on "
            + ", ".join(f"{p['plane']} [{len(p['lines'])} lines]" for p in result["planes"]),
            f"busy {result['busy_us']:.1f} us of wall {result['wall_us']:.1f} us "
            f"({100 * result['busy_fraction']:.1f}%); kernels summed {result['kernel_us']:.1f} us{per}", ""]
    n = "/step" if steps else ""
    lines = [f"{'kernel':60s} {'category':>14s} {'count' + n:>11s} {'us' + n:>12s} {'mean us':>10s} {'share':>6s}"
             "  hlo_op"]
    for r in result["rows"][:top]:
        cnt, us = (r["count_per_step"], r["us_per_step"]) if steps else (r["count"], r["total_us"])
        lines.append(f"{_short(r['name'], 60):60s} {r['category']:>14s} {cnt:>11.4g} {us:>12.1f} "
                     f"{r['mean_us']:>10.2f} {100 * r['share']:>5.1f}%  {_short(r['hlo_op'], 40)}")
    lines += ["", f"{'category':14s} {'count':>8s} {'total us':>12s} {'share':>6s}"]
    lines += [f"{c['category']:14s} {c['count']:>8d} {c['total_us']:>12.1f} {100 * c['share']:>5.1f}%"
              for c in result["categories"] if c["count"]]
    return "\n".join(head + lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="the folder jax.profiler.trace wrote, or one .xplane.pb")
    p.add_argument("--steps", type=int, default=None, help="steps the trace holds (adds per-step figures)")
    p.add_argument("--csv", default="", help="write every row here")
    p.add_argument("--json", default="", help="write the whole result here")
    p.add_argument("--top", type=int, default=40, help="rows printed")
    p.add_argument("--planes", default=None, help=f"regex of planes to read (default {GPU_PLANES!r} if the trace "
                   f"has one, else {CPU_PLANES!r})")
    p.add_argument("--lines", default=None, help=f"regex of their lines (default {STREAM_LINES!r} on device "
                   "planes, all lines' XLA-op events on host planes)")
    a = p.parse_args(argv)
    from ling2.config.paths import user_path

    result = read(user_path(a.trace), a.steps, a.planes, a.lines)
    print(report(result, a.top))
    if a.csv:
        write_csv(result, user_path(a.csv))
        print(f"wrote {user_path(a.csv)}")
    if a.json:
        with open(user_path(a.json), "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {user_path(a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
