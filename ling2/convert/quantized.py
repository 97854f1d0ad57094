"""Reading FP8 Hugging Face checkpoints as the weights they stand for.

Large MoE releases ship float8 weights with scales beside them: DeepSeek-V3 and the "fp8" quantization method
(`<module>.weight_scale_inv`, one scale per 128 x 128 block), and compressed-tensors' float-quantized format
(Ring-1T-FP8, Ring-2.5-1T: `<module>.weight_scale`, one per tensor, output channel, input group or block).
Either way a float8 `<module>.weight` [out, in] stands for weight x scale, the scale repeated over its tensor,
row, group or block; this is what the serving stacks (transformers' FineGrainedFP8, vLLM, SGLang) compute.
`Dequantized` wraps a ShardedReader so the converter sees float32 weights and no scale tensors: a
checkpoint converts, and generates, as its higher-precision original would up to the float8 rounding.
"""

import math

import numpy as np

from ling2.checkpoint.safetensors_io import SafetensorsError, ShardedReader, count_beyond, overflow_limit

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # weight_scale_inv (fp8), weight_scale (compressed-tensors)
HIDDEN_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")  # activation scales: serving only


class Scheme:
    """How a checkpoint's scales cover its weights: strategy 'tensor', 'channel' (one per output row), 'group'
    (group_size input columns each) or 'block' ([rows, columns] blocks)."""

    def __init__(self, strategy: str, block=None, group_size=None):
        self.strategy, self.block, self.group_size = strategy, block, group_size

    def expected(self, shape) -> tuple:
        out, inp = shape
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (out, 1)
        if self.strategy == "group":
            return (out, math.ceil(inp / self.group_size))
        return (math.ceil(out / self.block[0]), math.ceil(inp / self.block[1]))

    def fits(self, scale_shape, shape) -> bool:
        """Whether a scale of `scale_shape` covers a weight of `shape` this way (a tensor scale of any rank, a
        channel scale as [out] or [out, 1], group and block scales exactly)."""
        want = self.expected(shape)
        if self.strategy in ("tensor", "channel"):
            return math.prod(scale_shape) == math.prod(want) and len(scale_shape) <= 2 and (
                    not scale_shape or scale_shape[0] == want[0] or self.strategy == "tensor")
        return tuple(scale_shape) == want

    def expand(self, scale, shape):
        """The scale repeated over the weight it covers: [out, in] float32 (or broadcastable to it)."""
        out, inp = shape
        s = scale.astype(np.float32)
        if self.strategy == "tensor":
            return s.reshape(())
        if self.strategy == "channel":
            return s.reshape(out, 1)
        rows, cols = (1, self.group_size) if self.strategy == "group" else self.block
        return np.repeat(np.repeat(s, rows, axis=0)[:out], cols, axis=1)[:, :inp]


def scheme(hf: dict):
    """The Scheme a config.json's quantization_config describes, None for an unquantized checkpoint; ValueError
    naming the field for a quantization Ling2 does not read."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not _pair(block):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        return Scheme("block", block=tuple(block))
    if method == "compressed-tensors":
        if q.get("format") != "float-quantized":  # naive-quantized keeps quantized values in a 16-bit dtype
            raise ValueError(f"quantization_config.format {q.get('format')!r} is not read (float-quantized is)")
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups must name at least one group")
        schemes = set()
        for name, g in groups.items():
            w = (g or {}).get("weights") if isinstance(g, dict) else None
            if not isinstance(w, dict):
                raise ValueError(f"quantization_config.config_groups.{name}.weights must be a JSON object")
            where = f"quantization_config.config_groups.{name}.weights"
            if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("symmetric") is False:
                raise ValueError(f"{where}: only symmetric 8-bit float weights are read, got type {w.get('type')!r}, "
                                 f"num_bits {w.get('num_bits')!r}, symmetric {w.get('symmetric')!r}")
            strategy = w.get("strategy")
            if strategy == "block":
                if not _pair(w.get("block_structure")):
                    raise ValueError(f"{where}.block_structure must be two positive integers, "
                                     f"got {w.get('block_structure')!r}")
                schemes.add(("block", tuple(w["block_structure"]), None))
            elif strategy == "group":
                if not isinstance(w.get("group_size"), int) or w["group_size"] < 1:
                    raise ValueError(f"{where}.group_size must be a positive integer, got {w.get('group_size')!r}")
                schemes.add(("group", None, w["group_size"]))
            elif strategy in ("tensor", "channel"):
                schemes.add((strategy, None, None))
            else:
                raise ValueError(f"{where}.strategy {strategy!r} is not read (tensor, channel, group, block are)")
        if len(schemes) > 1:
            raise ValueError("quantization_config.config_groups: the groups' weight schemes differ: "
                             + ", ".join(sorted(map(str, schemes))))
        strategy, block, group = schemes.pop()
        return Scheme(strategy, block=block, group_size=group)
    raise ValueError(f"quantization_config.quant_method {method!r} is not read (fp8 and compressed-tensors are)")


def _pair(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v)


class Dequantized:
    """A ShardedReader whose float8 weights read as float32 weight x scale (see the module doc), with the scale
    tensors and activation scales out of sight. A float8 tensor without its scale, or a scale of the wrong shape,
    is a SafetensorsError naming the file and both tensors."""

    def __init__(self, reader: ShardedReader, how: Scheme):
        self.reader, self.how, self.dir = reader, how, reader.dir
        self.scales = {}
        for n in reader.names():
            if reader.dtype(n).name not in FLOAT8:
                continue
            found = [n + s for s in SCALE_SUFFIXES if n.endswith(".weight") and n + s in reader.entries]
            if not found or len(reader.shape(n)) != 2:
                why = ("without its scale (" + " or ".join(n + s for s in SCALE_SUFFIXES) + ")" if not found
                       else f"of shape {reader.shape(n)}; float8 weights are [out, in]")
                raise SafetensorsError(f"{reader.path(n)}: tensor {n} is {reader.dtype(n).name} {why}")
            if not how.fits(reader.shape(found[0]), reader.shape(n)):
                raise SafetensorsError(f"{reader.path(found[0])}: scale {found[0]} has shape {reader.shape(found[0])}, "
                                       f"the {how.strategy} scheme of {n} {reader.shape(n)} needs "
                                       f"{how.expected(reader.shape(n))}")
            self.scales[n] = found[0]

    @property
    def map_pages(self):
        return self.reader.map_pages

    @map_pages.setter
    def map_pages(self, value):
        self.reader.map_pages = value

    def names(self) -> list[str]:
        return [n for n in self.reader.names() if not n.endswith(HIDDEN_SUFFIXES)]

    def shape(self, name: str) -> tuple:
        return self.reader.shape(name)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self.scales else self.reader.dtype(name)

    def path(self, name: str):
        return self.reader.path(name)

    def read(self, name: str, index: tuple = (), copy: bool = True) -> np.ndarray:
        if name not in self.scales:
            return self.reader.read(name, index, copy)
        shape = self.reader.shape(name)
        w = self.reader.read(name).astype(np.float32) * self.how.expand(self.reader.read(self.scales[name]), shape)
        return w[index] if index else w

    def nonfinite(self, name: str, cast=None):
        """As ShardedReader.nonfinite, on the weight x scale values (float8 NaN, a scale that is not finite, or a
        product beyond `cast`'s range)."""
        if name not in self.scales:
            return self.reader.nonfinite(name, cast)
        w = self.read(name)
        count, first = count_beyond(w, overflow_limit(w.dtype, cast or w.dtype))
        if count == 0:
            return None
        return count, tuple(int(j) for j in np.unravel_index(first, w.shape)), float(w.reshape(-1)[first])
