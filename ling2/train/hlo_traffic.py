"""Bytes a compiled step moves, read from its optimized HLO text: collectives by kind and mesh axis, and an
estimate of HBM traffic, each counted as many times as it runs (loop bodies times their trip counts).

Collectives: all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute (their async -start
forms included). Each is charged to the mesh axes its replica groups (or permute pairs) span: the
partition ids of an SPMD program index the mesh's devices in order, so a group's members differ in
exactly those coordinates. Wire bytes per chip use the ring algorithms' counts for a group of n:
all-gather out x (n-1)/n, reduce-scatter out x (n-1), all-reduce 2 x bytes x (n-1)/n, all-to-all
bytes x (n-1)/n, collective-permute its buffer. A ragged all-to-all moves rows decided at run time: it is
charged the smaller of its operand and its output buffer, x (n-1)/n as all-to-all. For the MoE exchange that
is exactly the rows each device sends on average (every routed row moves once, whatever the routing; a
skewed routing loads some links more). A conditional counts its first branch (for the bounded ragged MoE
exchange: its single round, which `moe_ep` lists first and which runs unless the routing overflows the bound).

HBM: every top-level instruction (a fusion is one) reads its operands and writes its result once; bitcasts,
tuples, parameters, constants and control flow move nothing themselves; a dynamic slice reads its slice
(a scanned layer's weights out of their stack) and a dynamic update writes its update in place. This is
XLA's cost model for bytes accessed, applied with loop trip counts (XLA's `cost_analysis` counts a loop
body once). It is an estimate: it ignores what on-chip memory saves between ops.

Trip counts are XLA's `known_trip_count` where it states one, else read from the loop's condition
`i < N` on a counter from 0 (what `lax.scan` and `fori_loop` lower to); a loop whose count cannot be
read counts once and is reported.
"""

import dataclasses
import math
import re
from collections import defaultdict

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
               "c64": 8, "c128": 16}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain"}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (arrays and tuples of them; layouts ignored)."""
    return sum(DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _ARRAY.findall(shape))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    rest: str  # operands and attributes, as written


def parse_computations(text: str) -> tuple[dict, str]:
    """({computation name: [Instr]}, the entry computation's name)."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(Instr(m.group(2), m.group(3), m.group(4), m.group(5)))
    if entry is None:
        raise ValueError("hlo_traffic: no ENTRY computation in the HLO text")
    return comps, entry


def _attr(rest: str, key: str):
    m = re.search(rf"\b{key}=%?([\w.\-]+)", rest)
    return m.group(1) if m else None


def trip_count(while_rest: str, cond: list, comps: dict) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` when it states one, else N of its condition
    `counter < N` (a compare LT, possibly wrapped in a fusion, against the condition's one integer
    constant); None when neither can be read."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_rest)
    if m:
        return int(m.group(1))
    root = cond[-1] if cond else None
    if root is None:
        return None
    if root.op == "fusion":
        inner = comps.get(_attr(root.rest, "calls"), [])
        is_lt = bool(inner) and inner[-1].op == "compare" and "direction=LT" in inner[-1].rest
    else:
        is_lt = root.op == "compare" and "direction=LT" in root.rest
    consts = [re.match(r"\s*(-?\d+)\s*\)", i.rest) for i in cond if i.op == "constant" and i.shape.startswith("s32[]")]
    consts = [int(c.group(1)) for c in consts if c]
    return consts[0] if is_lt and len(consts) == 1 else None


def _iota_groups(spec: str) -> list[list[int]]:
    """Groups of XLA's iota form `[G,S]<=[d0,d1,..]T(perm)`."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = list(range(math.prod(dims)))
    if m.group(3):
        import numpy as np

        ids = np.arange(math.prod(dims)).reshape(dims).transpose([int(x) for x in m.group(3).split(",")]).ravel()
        ids = [int(x) for x in ids]
    size = out_shape[-1]
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def _mesh_groups(sizes: str, iota: str | None, perm: str | None, axes: str) -> list[list[int]]:
    """Groups of XLA's mesh form `mesh['a0'=n0,'a1'=n1,..], device_ids=([d0,..]T(perm)) {'a1',..}`: the devices
    (listed in mesh order by the iota, default 0..N-1) laid out on the named axes, one group per combination of
    the axes not in braces."""
    import numpy as np

    names = re.findall(r"'([^']+)'=", sizes)
    shape = [int(x) for x in re.findall(r"=(\d+)", sizes)]
    ids = np.arange(math.prod(shape))
    if iota:
        ids = ids.reshape([int(x) for x in iota.split(",")])
        if perm:
            ids = ids.transpose([int(x) for x in perm.split(",")])
    ids = ids.reshape(shape)
    inner = [names.index(a) for a in re.findall(r"'([^']+)'", axes)]
    outer = [i for i in range(len(shape)) if i not in inner]
    size = math.prod(shape[i] for i in inner)
    return [[int(x) for x in g] for g in ids.transpose(outer + inner).reshape(-1, size)]


def groups(rest: str, num_devices: int) -> list[list[int]]:
    """Replica groups (or permute pairs) of a collective's attributes."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*"
                  r"\{([^}]*)\}", rest)
    if m:
        return _mesh_groups(*m.groups())
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
    if m:
        return _iota_groups(m.group(1))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?)*)\}", rest)
    if m and m.group(1).strip():
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1) + "}")]
    return [list(range(num_devices))]


def axes_of(group: list[int], mesh_shape: dict) -> tuple[str, ...]:
    """The mesh axes along which the members of `group` (partition ids in mesh order) differ."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = [tuple(int(c) for c in _unravel(d, sizes)) for d in group]
    return tuple(n for k, n in enumerate(names) if len({c[k] for c in coords}) > 1)


def _unravel(i: int, sizes: list[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(i % s)
        i //= s
    return out[::-1]


def wire_bytes(kind: str, buffer: float, n: int) -> float:
    """Bytes one chip sends for a collective of `kind` over a group of n, by ring algorithms."""
    if n <= 1:
        return 0.0
    if kind == "all-gather":
        return buffer * (n - 1) / n
    if kind == "reduce-scatter":
        return buffer * (n - 1)
    if kind == "all-reduce":
        return 2 * buffer * (n - 1) / n
    if kind in ("all-to-all", "ragged-all-to-all"):
        return buffer * (n - 1) / n
    return buffer  # collective-permute


def _operands(i: Instr) -> list[str]:
    return re.findall(r"%([\w.\-]+)", i.rest.split("), ")[0])


def _fusion_bytes(body: list, operands: list, out: float) -> tuple[list, float]:
    """A fusion's operand and output bytes as its kernel touches them: an operand only dynamically sliced
    inside (a layer's weights out of a scanned stack) reads its slices; a fusion whose root updates a
    slice in place writes that slice, and its buffer operand is not read."""
    shapes = {i.name: i.shape for i in body}
    params = {}
    for i in body:
        if i.op == "parameter":
            m = re.match(r"\s*(\d+)\)", i.rest)
            if m:
                params[i.name] = int(m.group(1))
    users = defaultdict(list)
    for i in body:
        for o in _operands(i):
            users[o].append(i)
    operands = list(operands)
    for name, k in params.items():
        us = users.get(name, [])
        if k < len(operands) and us and all(u.op == "dynamic-slice" and _operands(u)[:1] == [name] for u in us):
            operands[k] = sum(shape_bytes(u.shape) for u in us)
    root = body[-1] if body else None
    if root is not None and root.op == "dynamic-update-slice":
        ops = _operands(root)
        if len(ops) > 1:
            out = shape_bytes(shapes.get(ops[1], ""))
            if ops[0] in params and params[ops[0]] < len(operands):
                operands[params[ops[0]]] = 0
    return operands, out


def traffic(text: str, mesh_shape: dict, host_devices: int = 0) -> dict:
    """{"collectives": {(kind, axes): {"count", "buffer_bytes", "wire_bytes", "network_wire_bytes"}}, "hbm_bytes",
    "hbm_read_bytes", "unknown_loops"} per chip per execution of the program in `text` (hbm_bytes: reads and
    writes; hbm_read_bytes: the reads alone); `mesh_shape` {axis: size} in mesh order. With `host_devices` (GPUs:
    consecutive partition ids share a host in groups of that size) a collective whose group spans hosts counts
    its wire bytes in network_wire_bytes as well: its ring runs at the speed of its host-to-host links."""
    comps, entry = parse_computations(text)
    n_dev = math.prod(mesh_shape.values())
    coll = defaultdict(lambda: {"count": 0.0, "buffer_bytes": 0.0, "wire_bytes": 0.0, "network_wire_bytes": 0.0})
    totals = {"hbm_bytes": 0.0, "hbm_read_bytes": 0.0, "unknown_loops": 0}

    def walk(name: str, times: float, fused: bool):
        instrs = comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        done_of = {}
        for i in instrs:
            if i.op.endswith("-done"):
                src = re.match(r"\s*%([\w.\-]+)", i.rest)
                if src:
                    done_of[src.group(1)] = i.shape
        for i in instrs:
            base = i.op[:-len("-start")] if i.op.endswith("-start") else i.op
            if i.op == "while":
                cond, body = _attr(i.rest, "condition"), _attr(i.rest, "body")
                n = trip_count(i.rest, comps.get(cond, []), comps)
                if n is None:
                    totals["unknown_loops"] += 1
                    n = 1
                walk(body, times * n, False)
                continue
            if i.op in ("call", "async-start"):
                walk(_attr(i.rest, "calls") or _attr(i.rest, "to_apply"), times, fused)
                continue
            if i.op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", i.rest)
                                                       or re.search(r"(true_computation=.*)", i.rest)).group(1))
                for b in branches[:1]:  # one branch runs; the first stands for them
                    walk(b, times, fused)
                continue
            if base in KINDS and not i.op.endswith("-done"):
                shape = done_of.get(i.name, i.shape) if i.op.endswith("-start") else i.shape
                buf = shape_bytes(shape)
                if base == "ragged-all-to-all":
                    buf = min(buf, shape_bytes(shapes.get(_operands(i)[0], shape)))
                g = groups(i.rest, n_dev)
                axes = axes_of(g[0], mesh_shape) if g and g[0] else ()
                size = len(g[0]) if base != "collective-permute" else 2
                rec = coll[(base, axes)]
                rec["count"] += times
                rec["buffer_bytes"] += times * buf
                wire = times * wire_bytes(base, buf, size)
                rec["wire_bytes"] += wire
                if host_devices and g and g[0] and len({d // host_devices for d in g[0]}) > 1:
                    rec["network_wire_bytes"] += wire
            if fused or i.op in _NO_TRAFFIC or i.op.endswith("-done") or i.op.endswith("-update"):
                continue
            operands = [shape_bytes(shapes.get(o, "")) for o in _operands(i)]
            out = shape_bytes(i.shape)
            if i.op == "dynamic-slice":
                operands[0] = out
            elif i.op == "dynamic-update-slice":
                operands[0], out = 0, operands[1]
            elif i.op == "fusion":
                operands, out = _fusion_bytes(comps.get(_attr(i.rest, "calls"), []), operands, out)
            totals["hbm_bytes"] += times * (out + sum(operands))
            totals["hbm_read_bytes"] += times * sum(operands)

    walk(entry, 1.0, False)
    return {"collectives": dict(coll), **totals}


def by_axis(collectives: dict) -> dict:
    """{"kind over axes": wire bytes} sorted by bytes, e.g. "all-gather over context"."""
    out = {f"{k} over {'x'.join(a) or 'none'}": v["wire_bytes"] for (k, a), v in collectives.items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
