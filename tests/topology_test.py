"""Topology names -> slice shapes, without libtpu (topology_tpu_compile_test asks libtpu).

Reference: the slice shapes in Cloud TPU's v4 / v5p / v5e / v6e configuration tables and
MaxText's accelerator_to_spec_map (written out by hand here), and the chip table's sources.
"""

import pytest

from ling2 import topology

GiB = 1024**3


@pytest.mark.parametrize("name, shape, chips, wrap", [
    ("v4-8", (2, 2, 1), 4, (False, False, False)),
    ("v4-32", (2, 2, 4), 16, (False, False, False)),
    ("v4-128", (4, 4, 4), 64, (True, True, True)),
    ("v5p-8", (2, 2, 1), 4, (False, False, False)),
    ("v5p-64", (2, 4, 4), 32, (False, False, False)),
    ("v5p-128", (4, 4, 4), 64, (True, True, True)),
    ("v5p-256", (4, 4, 8), 128, (True, True, True)),
    ("v5p-384", (4, 4, 12), 192, (True, True, True)),
    ("v5p-768", (4, 8, 12), 384, (True, True, True)),
    ("v5p-2048", (8, 8, 16), 1024, (True, True, True)),
    ("v5p-4096", (8, 16, 16), 2048, (True, True, True)),
    ("v5p-12288", (16, 16, 24), 6144, (True, True, True)),
    ("v5p-17920", (16, 20, 28), 8960, (True, True, True)),
    ("v5e-1", (1, 1), 1, (False, False, False)),
    ("v5e-16", (4, 4), 16, (False, False, False)),
    ("v5e-256", (16, 16), 256, (True, True, False)),
    ("v6e-64", (8, 8), 64, (False, False, False)),
    ("v6e-128", (8, 16), 128, (False, True, False)),
    ("v5litepod-32", (4, 8), 32, (False, False, False)),
])
def test_names_to_slice_shapes(name, shape, chips, wrap):
    t = topology.parse(name)
    assert (t.shape, t.chips_per_slice, t.num_devices, t.wrap) == (shape, chips, chips, wrap)
    assert t.topology_name == t.chip.generation + ":" + "x".join(map(str, shape))


def test_name_counts_cores_for_v4_v5p_and_chips_for_v5e_v6e():
    assert topology.parse("v5p-128").chips_per_slice == 64 and topology.CHIPS["v5p"].cores_per_chip == 2
    assert topology.parse("v4-64").chips_per_slice == 32
    assert topology.parse("v5e-64").chips_per_slice == 64 and topology.parse("v6e-64").chips_per_slice == 64


def test_multi_slice_multiplies_devices():
    t = topology.parse("v5p-64", num_slices=4)
    assert (t.num_slices, t.chips_per_slice, t.num_devices) == (4, 32, 128)


def test_every_whole_cube_count_is_a_cube_multiple():
    counts = topology.all_counts("v5p", 17920)
    assert counts[:5] == [8, 16, 32, 64, 128] and counts[-1] == 17920 and len(counts) == 4 + 17920 // 128
    for n in counts[4:]:
        a, b, c = topology.parse(f"v5p-{n}").shape
        assert a * b * c == n // 2 and a % 4 == b % 4 == c % 4 == 0 and a <= b <= c


def test_chip_table():
    """Cloud TPU system-architecture pages: HBM and peak bf16 per chip; H100 SXM datasheet."""
    got = {g: (c.hbm_bytes, c.peak_bf16_flops, c.device_kind) for g, c in topology.CHIPS.items()}
    assert got == {
        "v4": (32 * GiB, 275e12, "TPU v4"),
        "v5e": (16 * GiB, 197e12, "TPU v5 lite"),
        "v5p": (95 * GiB, 459e12, "TPU v5"),
        "v6e": (32 * GiB, 918e12, "TPU v6 lite"),
        "h100": (84_942_979_072, 989e12, "NVIDIA H100 80GB HBM3"),
        "h200": (143_771 * 2**20, 989e12, "NVIDIA H200"),  # nvidia-smi on the H200 this project was lent
        "tpu7x": (96 * GiB, 1153.5e12, "TPU7x"),  # Ironwood's 192 GB and 2,307 bf16 TFLOP/s over 2 devices
    }


def test_ironwood_names_count_chips_and_give_two_devices_each():
    assert topology.parse("tpu7x-4").topology_name == "tpu7x:2x2x1"
    t = topology.parse("tpu7x-256")
    assert (t.shape, t.chips_per_slice, t.num_devices, t.wrap) == ((4, 8, 8), 256, 512, (True, True, True))
    assert topology.parse("tpu7x-64", num_slices=2).num_devices == 256
    for bad in ("tpu7x-2", "tpu7x-100", "tpu7x-9280"):
        with pytest.raises(ValueError, match="tpu7x-64k"):
            topology.parse(bad)


def test_gpu_names():
    assert topology.parse("h100-8").topology_name == "1x1x8"
    assert topology.parse("h100-32").topology_name == "4x1x8"  # 4 hosts, each its own NVLink domain
    assert topology.parse("h100-2").num_devices == 2
    assert topology.parse("h200-256").topology_name == "32x1x8"
    with pytest.raises(ValueError, match="h100-16"):
        topology.parse("h100-8", num_slices=2)


@pytest.mark.parametrize("bad", ["v5p-100", "v5p-7", "v5e-2", "v6e-512", "v4-8194", "v7-8", "h100-12", "tpu", "",
                                 "h100-0", "h200-0", "v4-0", "v5p-0", "tpu7x-0", "v6e-0"])
def test_unknown_names_list_the_known_ones(bad):
    with pytest.raises(ValueError) as e:
        topology.parse(bad)
    assert repr(bad) in str(e.value) and "v5p-8" in str(e.value) and "v6e-256" in str(e.value)


@pytest.mark.parametrize("slices", [0, -1, 1.5])
def test_bad_num_slices(slices):
    with pytest.raises(ValueError, match="num_slices"):
        topology.parse("v5p-8", num_slices=slices)


@pytest.mark.parametrize("name, config", [("v6e-4", "--config=tpu"), ("h100-8", "--config=cuda")])
def test_without_the_platform_venv_the_error_names_it(name, config):
    """This test runs in the cpu venv: neither libtpu nor JAX's CUDA plugin is installed."""
    with pytest.raises(RuntimeError, match=config):
        topology.devices(name)


def test_a_count_with_leading_zeros_is_named_as_written_without_them():
    """v5p-08 is v5p-8 (the number is read as a number): its name is the canonical one."""
    assert topology.parse("v5p-08").name == "v5p-8" and topology.parse("h100-016").name == "h100-16"
