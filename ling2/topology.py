"""Accelerator topologies by their user-facing names, as compile-only JAX devices on any host.

Names follow Cloud TPU / MaxText usage:
  v4-N, v5p-N   N counts TensorCores, 2 per chip, so N/2 chips (v5p-128: 64 chips, 4x4x4).
                JAX sees one device per chip (megacore). 4, 8, 16, 32 chips, then any multiple
                of 64 chips (whole 4x4x4 cubes, shaped as close to a cube as the count allows).
  v5e-N, v6e-N  N counts chips (one TensorCore each): 1, 4, 8, 16, 32, 64, 128, 256 (2D).
  tpu7x-N       Ironwood, N chips (3D: 4, 8, 16, 32, then whole 4x4x4 cubes); JAX sees two devices per chip.
  h100-N, h200-N  N NVIDIA H100 / H200 SXM GPUs: 1, 2, 4, 8 on one host, or 8 per host (N a multiple of 8).
`num_slices` > 1 asks for that many identical TPU slices joined over the data-center network
(multi-slice; each device has a `slice_index`). `devices()` runs the real topology code of
libtpu (`jax[tpu]`) or of JAX's CUDA plugin (`jax[cuda12]`), with no accelerator attached:
`jax.jit(f).lower(...).compile()` on those devices runs the target's compiler.
"""

import dataclasses
import functools
import glob
import os
import re

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator generation: what JAX calls its devices, HBM per device, dense bf16 peak."""

    generation: str
    platform: str  # "tpu" or "cuda"
    device_kind: str  # jax.Device.device_kind
    hbm_bytes: int
    peak_bf16_flops: float
    cores_per_chip: int  # TensorCores per chip (what a v4/v5p name counts)
    hbm_bandwidth: float = 0.0  # bytes/s per chip
    ici_bandwidth: float = 0.0  # bytes/s per chip, bidirectional, all links (0: not published)
    devices_per_chip: int = 1  # JAX devices per chip (Ironwood: its two TensorCores are two devices; then the
    #                            HBM, peak and bandwidths above are per device, half the chip's)
    network_bandwidth: float = 0.0  # bytes/s per device, one way, between hosts (0: ICI spans the whole slice)


# Cloud TPU system-architecture pages (docs.cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}: peak bf16, HBM
# capacity and bandwidth, bidirectional ICI bandwidth per chip; the v4 page gives no per-chip ICI figure);
# NVIDIA H100 SXM5 datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 900 GB/s NVLink) with the device
# memory XLA's H100 target spec reports. Between GPU hosts (GPUS_PER_HOST each): one 400 Gb/s InfiniBand
# NIC per GPU (ConnectX-7, as in DGX H100 / H200), 50 GB/s each way.
CHIPS = {
    "v4": Chip("v4", "tpu", "TPU v4", 32 * GiB, 275e12, 2, 1200e9, 0.0),
    "v5e": Chip("v5e", "tpu", "TPU v5 lite", 16 * GiB, 197e12, 1, 819e9, 400e9),
    "v5p": Chip("v5p", "tpu", "TPU v5", 95 * GiB, 459e12, 2, 2765e9, 1200e9),
    "v6e": Chip("v6e", "tpu", "TPU v6 lite", 32 * GiB, 918e12, 1, 1638e9, 800e9),
    "h100": Chip("h100", "cuda", "NVIDIA H100 80GB HBM3", 84_942_979_072, 989e12, 1, 3.35e12, 900e9,
                 network_bandwidth=50e9),
    "h200": Chip("h200", "cuda", "NVIDIA H200", 150_754_820_096, 989e12, 1, 4.8e12, 900e9, network_bandwidth=50e9),
    # Ironwood: per chip 192 GB HBM3e at 7.37 TB/s, 4,614 TFLOP/s FP8 (bf16 taken as half), 1.2 TB/s ICI,
    # shown to JAX as two devices
    "tpu7x": Chip("tpu7x", "tpu", "TPU7x", 96 * GiB, 4614e12 / 4, 2, 7.37e12 / 2, 1.2e12 / 2, devices_per_chip=2),
}
CHIP_SOURCES = {"v4": "https://cloud.google.com/tpu/docs/v4", "v5e": "https://cloud.google.com/tpu/docs/v5e",
                "v5p": "https://cloud.google.com/tpu/docs/v5p", "v6e": "https://cloud.google.com/tpu/docs/v6e",
                "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
                "h200": "NVIDIA H200 Tensor Core GPU datasheet (SXM); memory as nvidia-smi reported a lent H200",
                "tpu7x": "https://cloud.google.com/tpu/docs/tpu7x (per chip; here per device, half)"}
_ALIASES = {"v5litepod": "v5e"}
_CUBE_CHIPS = 64  # a 4x4x4 cube: v4 / v5p slices this size and up are whole cubes, wrapped
_MAX_CHIPS = {"v4": 4096, "v5p": 8960, "tpu7x": 9216}
_CHIPS_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
GPUS_PER_HOST = 8

# XLA's GPU target description (GpuTargetConfigProto, text format) of an H100 SXM 80GB: what the
# CUDA plugin compiles for when no GPU is attached.
_H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# An H200 SXM: the H100's Hopper die (sm_90, 132 SMs) with 141 GB of HBM3e at 4.8 TB/s; the memory size is
# what nvidia-smi reported on the H200 this project was lent (143,771 MiB).
_H200_TARGET = (_H100_TARGET.replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
                .replace("device_memory_size: 84942979072", "device_memory_size: 150754820096")
                .replace('"NVIDIA H100 80GB HBM3"', '"NVIDIA H200"'))
_GPU_TARGETS = {"h100": _H100_TARGET, "h200": _H200_TARGET}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A parsed topology. `shape`: chips per slice along each ICI axis (TPU), or (hosts, GPUs per host)."""

    name: str
    chip: Chip
    shape: tuple
    num_slices: int = 1
    wrap: tuple = (False, False, False)

    @property
    def chips_per_slice(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def num_devices(self) -> int:
        """JAX devices in all slices (one per chip: v4 / v5p run as megacore; two per Ironwood chip)."""
        return self.chips_per_slice * self.num_slices * self.chip.devices_per_chip

    @property
    def topology_name(self) -> str:
        """libtpu's name of one slice ("v5p:4x4x4"), or the CUDA plugin's "partitions x hosts x GPUs"."""
        if self.chip.platform == "cuda":
            hosts, per_host = self.shape
            return f"{hosts}x1x{per_host}"
        return f"{self.chip.generation}:" + "x".join(map(str, self.shape))

    def devices(self) -> list:
        """The compile-only devices of this topology (needs the platform's venv: --config=tpu / cuda)."""
        from jax.experimental import topologies

        if self.chip.platform == "cuda":
            return _cuda_devices(self)
        # libtpu guards the chips with a lock file; describing a topology touches none.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        if not _tpu_host():
            # On a host with no TPU, libtpu's probes of its own host (the metadata server, then the accelerator
            # type and worker hostnames) fail, print warnings and an INVALID_ARGUMENT line, and matter to nothing
            # compile-only: describe this host as one worker of the target generation instead.
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{self.chip.generation}-8")
            os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
            os.environ.setdefault("TPU_WORKER_ID", "0")
        megacore = self.chip.cores_per_chip == 2 and self.chip.devices_per_chip == 1
        kwargs = {"chip_config_name": "megacore"} if megacore else {}
        if self.chips_per_slice == 1:
            kwargs["chips_per_host_bounds"] = (1, 1, 1)
        try:
            desc = topologies.get_topology_desc(topology_name=self.topology_name, platform="tpu",
                                                num_slices=self.num_slices, wrap=self.wrap, **kwargs)
        except RuntimeError as e:
            if "TPU support not installed" in str(e):
                raise RuntimeError(f"topology {self.name}: libtpu is not installed; use the tpu venv "
                                   f"(./bazelw --config=tpu ...)") from e
            raise
        return list(desc.devices)


def _tpu_host() -> bool:
    """Whether this host has TPU chips (TPU VMs expose them as /dev/accel* or /dev/vfio/N)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _cuda_devices(topo: Topology) -> list:
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(topo.chip.generation, "cuda", target_config=_GPU_TARGETS[topo.chip.generation],
                                            topology=topo.topology_name)
    except NotImplementedError as e:
        raise RuntimeError(f"topology {topo.name}: JAX's CUDA plugin is not loaded. Use the cuda venv "
                           "(./bazelw --config=cuda ...), and on a host without a GPU set JAX_PLATFORMS=cpu "
                           "(else the plugin stops at its driver check).") from e
    return list(desc.devices)


def _cubes(chips: int) -> tuple:
    """Whole-cube 3D shape for `chips` (a multiple of 64): the factorisation into multiples of 4
    with the smallest longest side, then the largest shortest side (Cloud's shapes: 4x8x12 for
    384 chips, 8x8x16 for 1024, 16x20x28 for 8960)."""
    m = chips // _CUBE_CHIPS
    best = None
    for a in range(1, m + 1):
        for b in range(a, m // a + 1):
            c, r = divmod(m, a * b)
            if r or c < b:
                continue
            key = (c, -a)
            if best is None or key < best[0]:
                best = (key, (4 * a, 4 * b, 4 * c))
    return best[1]


def _shape(generation: str, count: int):
    """(chips-per-slice shape, wrap) for a name's number, or None when no such slice exists."""
    chip = CHIPS[generation]
    if count < 1:
        return None
    if chip.platform == "cuda":
        if count in (1, 2, 4, 8):
            return (1, count), None
        if count % GPUS_PER_HOST == 0:
            return (count // GPUS_PER_HOST, GPUS_PER_HOST), None
        return None
    if chip.devices_per_chip == 2:  # named by chips, 3D
        count *= 2
    if chip.cores_per_chip == 1:
        shape = _CHIPS_2D.get(count)
        return None if shape is None else (shape, tuple(d == 16 for d in shape) + (False,))
    if count % 2:
        return None
    chips = count // 2
    if chips in _SMALL_3D:
        return _SMALL_3D[chips], (False, False, False)
    if chips % _CUBE_CHIPS or chips > _MAX_CHIPS[generation]:
        return None
    return _cubes(chips), (True, True, True)


def known_names() -> list:
    """Every accepted name pattern, for error messages."""
    out = []
    for gen, chip in CHIPS.items():
        if chip.platform == "cuda":
            out.append(f"{gen}-1/2/4/8 or {gen}-8k (8 per host)")
        elif chip.cores_per_chip == 1:
            out.append(", ".join(f"{gen}-{n}" for n in _CHIPS_2D))
        elif chip.devices_per_chip == 2:
            small = ", ".join(f"{gen}-{c}" for c in _SMALL_3D)
            out.append(f"{small}, {gen}-{_CUBE_CHIPS}k (k cubes, up to {gen}-{_MAX_CHIPS[gen]})")
        else:
            small = ", ".join(f"{gen}-{2 * c}" for c in _SMALL_3D)
            out.append(f"{small}, {gen}-{2 * _CUBE_CHIPS}k (k cubes, up to {gen}-{2 * _MAX_CHIPS[gen]})")
    return out


def parse(name: str, num_slices: int = 1) -> Topology:
    """`v5p-128` (and `num_slices`) -> Topology; ValueError naming the name and the known ones."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    gen = _ALIASES.get(m.group(1), m.group(1)) if m else None
    found = _shape(gen, int(m.group(2))) if gen in CHIPS else None
    if found is None:
        raise ValueError(f"unknown topology {name!r}; known: " + "; ".join(known_names()))
    if not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"topology {name}: num_slices={num_slices!r} must be a positive integer")
    chip = CHIPS[gen]
    if chip.platform == "cuda" and num_slices != 1:
        raise ValueError(f"topology {name}: num_slices applies to TPU slices; for more GPUs name more "
                         f"({gen}-{int(m.group(2)) * num_slices})")
    shape, wrap = found
    return Topology(f"{gen}-{int(m.group(2))}", chip, shape, num_slices, wrap or (False, False, False))


@functools.lru_cache(maxsize=None)
def _devices_cached(name: str, num_slices: int) -> tuple:
    return tuple(parse(name, num_slices).devices())


def devices(name: str, num_slices: int = 1) -> list:
    """Compile-only devices of a named topology (cached per name and slice count)."""
    return list(_devices_cached(name, num_slices))


def all_counts(generation: str, up_to: int) -> list:
    """The numbers a name of this generation may carry, up to `up_to`."""
    return [n for n in range(1, up_to + 1) if _shape(generation, n) is not None]
