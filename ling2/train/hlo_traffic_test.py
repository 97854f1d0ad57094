"""hlo_traffic on programs whose collectives are known by construction (8 fake CPU devices, mesh fsdp 2 x
context 4): what each moves, over which axis, how many times (a scan of 5 runs its body 5 times)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ling2.train import hlo_traffic as H

MESH = {"fsdp": 2, "context": 4}


def compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_collectives_by_kind_axis_and_trip_count():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("fsdp", "context"), axis_types=(AxisType.Explicit,) * 2)

    def body(x):  # per device: x [3, 16] f32
        def step(c, _):
            g = jax.lax.all_gather(c, "context", tiled=True)  # [12, 16]: 4 x 192 B received... buffer 768 B
            s = jax.lax.psum(g, "fsdp")  # all-reduce of 768 B over fsdp
            return s[:3] * 0.5 + jax.lax.ppermute(c, "context", [(i, (i + 1) % 4) for i in range(4)]), None

        y, _ = jax.lax.scan(step, x, None, length=5)
        return y

    f = jax.shard_map(body, mesh=mesh, in_specs=P("fsdp", "context"), out_specs=P("fsdp", "context"))
    x = jax.device_put(jnp.ones((6, 64), jnp.float32), NamedSharding(mesh, P("fsdp", "context")))
    t = H.traffic(compiled_text(f, x), MESH)
    c = t["collectives"]
    assert t["unknown_loops"] == 0
    ag, ar, cp = c[("all-gather", ("context",))], c[("all-reduce", ("fsdp",))], c[("collective-permute", ("context",))]
    assert ag["count"] == ar["count"] == cp["count"] == 5
    assert ag["buffer_bytes"] == 5 * 12 * 16 * 4 and ag["wire_bytes"] == 5 * 12 * 16 * 4 * 3 / 4
    assert ar["buffer_bytes"] == 5 * 12 * 16 * 4 and ar["wire_bytes"] == 5 * 2 * 12 * 16 * 4 * 1 / 2
    assert cp["wire_bytes"] == 5 * 3 * 16 * 4
    assert set(c) == {("all-gather", ("context",)), ("all-reduce", ("fsdp",)), ("collective-permute", ("context",))}
    assert H.by_axis(c)["all-gather over context"] == ag["wire_bytes"]


def test_collectives_spanning_hosts_count_as_network_bytes():
    """With 4 devices per host (partition ids 0-3 and 4-7), the mesh fsdp 2 x context 4 keeps each context group on
    one host and puts each fsdp pair on two: only the fsdp all-reduce crosses the network. With 2 per host, the
    context groups span two hosts as well."""
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("fsdp", "context"), axis_types=(AxisType.Explicit,) * 2)

    def body(x):
        return jax.lax.psum(jax.lax.all_gather(x, "context", tiled=True), "fsdp")

    f = jax.shard_map(body, mesh=mesh, in_specs=P("fsdp", "context"), out_specs=P(), check_vma=False)
    text = compiled_text(f, jax.device_put(jnp.ones((6, 64), jnp.float32), NamedSharding(mesh, P("fsdp", "context"))))
    four, two, none = (H.traffic(text, MESH, host_devices=n)["collectives"] for n in (4, 2, 0))
    ag, ar = ("all-gather", ("context",)), ("all-reduce", ("fsdp",))
    assert four[ar]["network_wire_bytes"] == four[ar]["wire_bytes"] > 0 and four[ag]["network_wire_bytes"] == 0
    assert two[ag]["network_wire_bytes"] == two[ag]["wire_bytes"] > 0
    assert none[ar]["network_wire_bytes"] == none[ag]["network_wire_bytes"] == 0


def test_mesh_form_replica_groups():
    """XLA's mesh form of replica groups (what partially manual shard_maps lower to), against groups written out by
    hand: 24 devices listed as iota [3,2,4] transposed (1,0,2), laid out as mesh (a0 2, a1 1, a2 12), grouped
    along a0; and, without device ids, one group of all devices."""
    rest = "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=12], device_ids=([3,2,4]T(1,0,2)) {'axis_0'}, x=1"
    # iota [3,2,4]T(1,0,2) lists devices (j, i, k) -> 8i + 4j + k for j < 2, i < 3, k < 4: 0-3, 8-11, 16-19, 4-7, ..
    listed = [8 * i + 4 * j + k for j in range(2) for i in range(3) for k in range(4)]
    assert H.groups(rest, 24) == [[listed[c], listed[12 + c]] for c in range(12)]
    assert H.groups(rest, 24)[0] == [0, 4]
    assert H.groups("replica_groups=mesh['axis_0'=6,'axis_1'=1] {'axis_0'}, y", 6) == [list(range(6))]


def test_hbm_bytes_count_loop_bodies_times_their_trips():
    """A loop of N adds of a [256, 256] f32 buffer: about N x 3 x 256 KiB (two reads, one write) or more."""
    x = jnp.ones((256, 256), jnp.float32)

    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: c * 1.0001 + x, x)

    one, ten = (H.traffic(compiled_text(lambda x: f(x, n), x), {"d": 1})["hbm_bytes"] for n in (1, 10))
    assert 10 * 2 * 256 * 1024 <= ten and ten > 5 * one


def test_group_forms():
    assert H._iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert H._iota_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert H.groups("replica_groups={{0,2},{1,3}}, to_apply=%add", 4) == [[0, 2], [1, 3]]
    assert H.axes_of([0, 4], {"fsdp": 2, "context": 4}) == ("fsdp",)
    assert H.axes_of([0, 1, 2, 3], {"fsdp": 2, "context": 4}) == ("context",)
    assert H.shape_bytes("(bf16[2,3]{1,0}, f32[4])") == 2 * 6 + 16


def test_scanned_weights_are_read_one_layer_per_trip():
    """A scan over 16 stacked [128, 128] f32 layers: each trip reads its own layer (64 KiB), not the whole
    1 MiB stack, so the weights add about 16 x 64 KiB, well under 16 x 1 MiB."""
    w = jnp.ones((16, 128, 128), jnp.float32)
    x = jnp.ones((8, 128), jnp.float32)

    def f(w, x):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

    hbm = H.traffic(compiled_text(f, w, x), {"d": 1})["hbm_bytes"]
    assert 16 * 128 * 128 * 4 <= hbm < 4 * 16 * 128 * 128 * 4
