"""Small frozen specs: each model module's slice of the config, derived once from the flat Config.

A spec's fields are named as the Config fields (or derived properties) they copy (`SOURCE` names
the few read from a base_* key), so
`GLASpec.of(cfg)` is the GLA layer's whole view of a run's settings and its signature says what it
reads. Specs are frozen and hashable (lists become tuples), so modules keep them as static fields.
The YAML keys users write are the Config's; specs add no names of their own.

Two kinds of setting are kept apart: what the model computes (widths, kinds, routing, dtypes: the
module specs' own fields) and how this run computes it (`RunSpec`: kernels, chunking, remat, scan,
loss blocking, FP8, and the mesh with its logical-axis rules). Every module spec carries the run's
one `RunSpec` as `run`; `ling2.layers.spec.ModelSpec` puts them together for the whole model.
"""

import dataclasses


def _frozen(x):
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    return x


# Spec fields read from a Config field of another name: MaxText's base_* keys, whose values the modules
# use as they are.
SOURCE = {"emb_dim": "base_emb_dim", "num_query_heads": "base_num_query_heads",
          "num_decoder_layers": "base_num_decoder_layers"}


@dataclasses.dataclass(frozen=True)
class Spec:
    @classmethod
    def of(cls, cfg, mesh=None):
        """This spec's fields read from `cfg` (a Config); a `run` field is `RunSpec.of(cfg, mesh)`."""
        return cls(**{f.name: RunSpec.of(cfg, mesh) if f.name == "run" else
                      _frozen(getattr(cfg, SOURCE.get(f.name, f.name))) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """How a run computes the model, never what: a checkpoint written under one RunSpec loads under any other.

    `mesh_shape` ((mesh axis, size), ...) is the mesh the run's activations are split over, () on one device;
    with `logical_axis_rules` it is all a layer knows of the mesh (`ling2.layers.sharding`)."""
    attention_kernel: str
    attention_block_size: int
    gla_backend: str
    gla_chunk_size: int
    kda_backend: str
    kda_chunk_size: int
    moe_gmm_backend: str
    moe_ep_all_to_all: str
    moe_ep_capacity_factor: float
    quantization: str
    fp8_scaling: str
    remat_policy: str
    scan_layers: bool
    loss_vocab_blocks: int
    logical_axis_rules: tuple
    pipeline_microbatches: int
    pipeline_weights_dtype: str
    mesh_shape: tuple = ()

    @classmethod
    def of(cls, cfg, mesh=None):
        """`cfg`'s run settings on `mesh` (a jax Mesh, or None for one device)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "mesh_shape"]
        shape = () if mesh is None else tuple((str(a), int(n)) for a, n in dict(mesh.shape).items())
        return cls(**{n: _frozen(getattr(cfg, n)) for n in names}, mesh_shape=shape)


@dataclasses.dataclass(frozen=True)
class PlanSpec(Spec):
    """The decoder's layer pattern and MTP depths (`ling2.layers.plan`)."""
    num_decoder_layers: int
    inhomogeneous_layer_cycle_interval: int
    first_num_dense_layers: int
    layer_types: tuple
    mlp_types: tuple
    mtp_num_layers: int


@dataclasses.dataclass(frozen=True)
class WeightsSpec(Spec):
    """What every module with weights reads: width, dtypes, init and norm epsilon, and the run's settings."""
    emb_dim: int
    dtype: str
    weight_dtype: str
    init_std: float
    normalization_layer_epsilon: float
    run: RunSpec


@dataclasses.dataclass(frozen=True)
class RopeSpec(Spec):
    """RoPE / YaRN frequencies and scaling (`ling2.layers.yarn`)."""
    rotary_dim: int
    rope_type: str
    rope_max_timescale: float
    rope_factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclasses.dataclass(frozen=True)
class EmbedSpec(WeightsSpec):
    vocab_size: int
    float32_logits: bool


@dataclasses.dataclass(frozen=True)
class MLASpec(WeightsSpec, RopeSpec):
    num_query_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    qk_head_dim: int
    v_head_dim: int
    mla_interleaved_rope: bool
    mla_output_gate: bool


@dataclasses.dataclass(frozen=True)
class GLASpec(WeightsSpec, RopeSpec):
    num_query_heads: int
    head_dim: int
    num_decoder_layers: int
    use_qk_norm: bool
    use_linear_silu: bool
    group_norm_size: int
    gla_slope_layer_offset: int


@dataclasses.dataclass(frozen=True)
class KDASpec(WeightsSpec):
    num_query_heads: int
    head_dim: int
    kda_conv_kernel_size: int
    kda_safe_gate: bool
    kda_lower_bound: float


@dataclasses.dataclass(frozen=True)
class RouterSpec(WeightsSpec):
    """Routing and the loss-free expert bias."""
    num_experts: int
    num_experts_per_tok: int
    routed_score_func: str
    n_routing_groups: int
    topk_routing_group: int
    sigmoid_renormalize: bool
    norm_topk_prob: bool
    routed_scaling_factor: float
    routed_bias: bool
    routed_bias_dtype_resolved: str
    enable_routed_bias_grad: bool
    routed_bias_update_rate: float
    routed_bias_zero_mean_update: bool


@dataclasses.dataclass(frozen=True)
class MoESpec(RouterSpec):
    base_moe_mlp_dim: int
    shared_experts: int
    shared_expert_dim: int
    capacity_factor: float
    sparse_matmul: bool
    load_balance_loss_weight: float
    moe_z_loss_weight: float
