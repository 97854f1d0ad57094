"""Enumerations and literal types shared by the config schema."""

import enum
from typing import Literal


ModelName = Literal["default", "ling2", "ling2-tiny", "ling2-small", "ling2-micro", "ling2-1gpu", "ling2.5-1t", "ling3", "ling3-tiny",
                    "ling3-small", "ling3-1gpu"]

DType = Literal["float32", "bfloat16", "float16", "float64"]
Profiler = Literal["", "xplane"]
DTypeOrDefault = Literal["", "float32", "bfloat16", "float16", "float64"]
ScoreFunc = Literal["sigmoid", "softmax"]
RopeType = Literal["default", "yarn"]
RematPolicy = Literal["none", "full", "save_dot"]
AttentionKernel = Literal["blocked", "dot_product", "cudnn", "flash"]
GmmBackend = Literal["auto", "ragged_dot", "tiled", "blocked", "pallas_gpu", "megablox"]
EpAllToAll = Literal["auto", "ragged", "padded", "emulated"]
GlaBackend = Literal["auto", "chunked", "naive", "quadratic", "pallas_tpu", "pallas_gpu"]
LrSchedule = Literal["cosine", "wsd", "constant", "wsm"]
MergeShape = Literal["uniform", "linear", "cosine", "1-sqrt"]
LayerType = str  # an attention kind: a key of ling2.config.kinds.KINDS
KdaBackend = Literal["auto", "chunked", "naive", "pallas_tpu", "pallas_gpu"]
MlpType = Literal["dense", "moe"]
Quantization = Literal["", "fp8"]
Fp8Scaling = Literal["tensor", "block"]
