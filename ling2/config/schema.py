"""The Ling2 config: Pydantic classes grouped by concern, flattened into one `Config`.

Every field is required here; `configs/base.yml` is the one place defaults live, so a
field missing from it is an error rather than a silent second default. Access is flat
(`cfg.num_experts`), as in MaxText. Values derived from several fields (per-layer types,
head dims) are computed once after validation.
"""

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from ling2.config import enums as T


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, protected_namespaces=())


class Model(_Group):
    model_name: T.ModelName = Field(description="Model file to load from configs/models/ ('default' loads none).")
    decoder_block: T.DecoderBlockType
    vocab_size: PositiveInt
    base_emb_dim: PositiveInt = Field(description="Hidden size E.")
    base_mlp_dim: PositiveInt = Field(description="Width of the dense SwiGLU MLP in the first dense layers.")
    base_num_decoder_layers: PositiveInt
    base_num_query_heads: PositiveInt
    base_num_kv_heads: PositiveInt
    head_dim: PositiveInt = Field(description="Per-head dim D of the linear-attention layers.")
    mlp_activations: list[str]
    normalization_layer_epsilon: float = Field(gt=0)
    logits_via_embedding: bool = Field(description="Tie lm_head to the embedding (false for Ling2).")
    float32_logits: bool
    enable_dropout: bool
    dropout_rate: NonNegativeFloat
    dtype: T.DType = Field(description="Activation/compute dtype.")
    weight_dtype: T.DType = Field(description="Parameter dtype.")
    init_std: float = Field(gt=0, description="Normal init std (HF initializer_range).")
    inhomogeneous_layer_cycle_interval: int = Field(
        description="Layer i is MLA when (i+1) % interval == 0 (and every layer of a trailing partial group); others are GLA."
    )
    first_num_dense_layers: NonNegativeInt = Field(description="Layers before this index use the dense MLP; the rest MoE.")
    attention_type: str = Field(description="Full-attention flavour of the hybrid ('mla').")
    attention_kernel: T.AttentionKernel = Field(description="MLA attention backend.")
    attention_block_size: PositiveInt = Field(
        description="Query block of attention_kernel=blocked: each block scores only the keys up to its end."
    )
    scan_layers: bool
    remat_policy: T.RematPolicy


class Rope(_Group):
    rope_type: T.RopeType
    rope_min_timescale: PositiveInt
    rope_max_timescale: float = Field(gt=0, description="RoPE theta.")
    max_position_embeddings: PositiveInt
    original_max_position_embeddings: PositiveInt
    rope_factor: float = Field(gt=0, description="Yarn scaling factor.")
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    partial_rotary_factor: float = Field(gt=0, le=1, description="Fraction of head_dim that is rotated.")


class LinearAttention(_Group):
    use_qk_norm: bool
    use_linear_silu: bool = Field(description="SiLU on the fused qkv projection of GLA layers.")
    group_norm_size: PositiveInt = Field(
        description="NUMBER of groups G of the GLA output GroupRMSNorm: H*D is split into G groups of H*D/G. "
        "G=1 is plain RMSNorm over H*D."
    )
    gla_slope_layer_offset: int = Field(
        description="Slope uses (layer_idx + offset): -1 is the HF reference's (layer_idx - 1); 0 is vLLM's layer_idx."
    )
    gla_chunk_size: PositiveInt
    gla_backend: T.GlaBackend


class Mla(_Group):
    q_lora_rank: NonNegativeInt = Field(description="0 means a single q projection.")
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt
    mla_interleaved_rope: bool = Field(description="De-interleave the rope dims (even, then odd) before rotate-half.")


class MoE(_Group):
    num_experts: PositiveInt
    num_experts_per_tok: PositiveInt
    base_moe_mlp_dim: PositiveInt = Field(description="Width of each routed SwiGLU expert.")
    capacity_factor: float = Field(description="<= 0: dropless. > 0: dense path drops tokens past capacity.")
    sparse_matmul: bool = Field(description="True: sort + grouped matmul (dropless). False: dense einsum with capacity.")
    moe_gmm_backend: T.GmmBackend = Field(
        description="Dropless grouped matmul: 'ragged_dot', 'tiled' (fast on CPU), or 'auto' (tiled on CPU only).")
    load_balance_loss_weight: NonNegativeFloat
    moe_z_loss_weight: NonNegativeFloat = Field(description="ST-MoE router z-loss weight; 0 skips the computation.")


class DeepSeekMoE(_Group):
    shared_experts: NonNegativeInt
    moe_shared_expert_dim: NonNegativeInt = Field(description="Shared expert width; 0 falls back to base_moe_mlp_dim.")
    routed_scaling_factor: float = Field(gt=0)
    n_routing_groups: PositiveInt
    topk_routing_group: PositiveInt
    routed_score_func: T.ScoreFunc
    routed_bias: bool = Field(description="Add a selection-only expert bias (loss-free balancing).")
    routed_bias_update_rate: NonNegativeFloat
    routed_bias_dtype: T.RoutedBiasDType = Field(description="Dtype of the expert bias; '' follows weight_dtype.")
    enable_routed_bias_grad: bool = Field(description="False: the bias takes no gradient, only loss-free updates.")
    routed_bias_zero_mean_update: bool = Field(description="Recentre the bias to zero mean after each update.")
    norm_topk_prob: bool = Field(description="Normalise top-k softmax weights (sigmoid weights are always normalised).")


class Mtp(_Group):
    mtp_num_layers: NonNegativeInt
    mtp_loss_scaling_factor: NonNegativeFloat
    mtp_hidden_pre_norm: bool = Field(description="Feed MTP the main hidden state before the final norm (HF: after).")


class Data(_Group):
    dataset_type: str = Field(description="'mmap' (Megatron .bin/.idx) or 'synthetic'.")
    data_path: str = Field(description="Megatron-style: a prefix, or 'w1 prefix1 w2 prefix2 ...'.")
    data_split: str
    data_seed: int
    max_target_length: PositiveInt = Field(description="Sequence length S.")
    max_prefill_predict_length: PositiveInt
    add_extra_token_to_sequence: bool
    blend_per_split: list[str] = Field(
        description="Megatron's blend_per_split: [train, valid, test] data_path strings ('' for none) used "
        "instead of data_path and data_split; [] to use data_path.")
    drop_last_partial_validation_sequence: bool = Field(
        description="Drop the last, partial validation sample (Megatron's default); false pads it.")
    exact_sample_count: bool = Field(
        description="Count keep-partial samples with an exact integer ceil; false uses Megatron's float32 "
        "(differs past 2^24 tokens).")
    blend_cache_dir: str = Field(description="Cache directory for generated index .npy files; '' disables caching.")
    blend_index_dir: str = Field(
        description="Directory of prebuilt index .npy files (Megatron's cache) to load instead of building; "
        "a set for the same dataset built for another request is an error.")
    reset_attention_mask: bool = Field(description="Each document in a packed sample gets its own segment id.")
    reset_position_ids: bool
    eod_mask_loss: bool = Field(description="Exclude positions whose input token is EOD from the loss.")
    mmap_split_sentences: bool = Field(description="Data was preprocessed with sentence splitting.")
    grain_worker_count: NonNegativeInt


class Tokenizer(_Group):
    tokenizer_path: str
    pad_id: int = Field(description="Padding id (masked from the loss, as Megatron); -1 means none.")
    bos_id: int = Field(description="BOS id inserted between documents when add_bos; -1 means none.")
    eod_id: int = Field(description="End-of-document id: separates documents in packed samples.")
    add_bos: bool


class Optimizer(_Group):
    opt_type: str
    learning_rate: float = Field(gt=0)
    lr_schedule: T.LrSchedule
    warmup_steps_fraction: float = Field(ge=0, le=1)
    final_lr_fraction: float = Field(ge=0, le=1)
    wsd_decay_steps_fraction: float = Field(ge=0, le=1)
    adam_b1: float
    adam_b2: float
    adam_eps: float = Field(gt=0)
    adam_weight_decay: NonNegativeFloat
    weight_decay_embeddings: bool
    gradient_clipping_threshold: NonNegativeFloat
    calculate_per_token_loss: bool = Field(
        description="Gradient accumulation: True divides by all tokens across micro-batches; "
        "False averages each micro-batch, then micro-batches equally."
    )


class Training(_Group):
    steps: PositiveInt
    per_device_batch_size: float = Field(gt=0)
    gradient_accumulation_steps: PositiveInt
    seed: int
    eval_interval: NonNegativeInt
    eval_steps: NonNegativeInt


class Mesh(_Group):
    mesh_axes: list[str]
    ici_data_parallelism: int = Field(description="-1 fills the remaining devices.")
    ici_fsdp_parallelism: int
    ici_expert_parallelism: int
    ici_tensor_parallelism: int
    logical_axis_rules: list[tuple[str, Optional[list[str]]]]


class Checkpointing(_Group):
    load_parameters_path: str = Field(
        description="Initial weights from a converter checkpoint (hf_to_ling2 --out) or a trainer step directory; "
        "used only when the run has no checkpoint of its own to resume.")
    enable_checkpointing: bool
    async_checkpointing: bool
    checkpoint_period: PositiveInt
    max_checkpoints_to_keep: PositiveInt


class Logging(_Group):
    log_period: PositiveInt
    log_router_stats: bool


GROUPS = (Model, Rope, LinearAttention, Mla, MoE, DeepSeekMoE, Mtp, Data, Tokenizer, Optimizer, Training, Mesh,
           Checkpointing, Logging)


class Config(*GROUPS):
    """The resolved config. Build it with `ling2.config.load_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, protected_namespaces=())

    @model_validator(mode="after")
    def _check(self) -> "Config":
        def need(ok: bool, field: str, msg: str):
            if not ok:
                raise ValueError(f"{field}: {msg}")

        need(self.inhomogeneous_layer_cycle_interval >= 1, "inhomogeneous_layer_cycle_interval",
             f"must be >= 1, got {self.inhomogeneous_layer_cycle_interval}")
        need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        need(self.num_experts % self.n_routing_groups == 0, "n_routing_groups",
             f"{self.n_routing_groups} does not divide num_experts={self.num_experts}")
        need(self.topk_routing_group <= self.n_routing_groups, "topk_routing_group",
             f"{self.topk_routing_group} exceeds n_routing_groups={self.n_routing_groups}")
        if self.n_routing_groups > 1:
            need(self.num_experts // self.n_routing_groups >= 2, "n_routing_groups",
                 "group scores sum each group's top-2 experts, so every group needs >= 2 experts")
            need(self.num_experts_per_tok <= self.topk_routing_group * (self.num_experts // self.n_routing_groups),
                 "num_experts_per_tok", "exceeds the experts in the kept groups")
        need(self.first_num_dense_layers <= self.base_num_decoder_layers, "first_num_dense_layers",
             f"{self.first_num_dense_layers} exceeds base_num_decoder_layers={self.base_num_decoder_layers}")
        need(self.base_num_query_heads % self.base_num_kv_heads == 0, "base_num_kv_heads",
             "must divide base_num_query_heads")
        hd = self.base_num_query_heads * self.head_dim
        need(hd % self.group_norm_size == 0, "group_norm_size",
             f"{self.group_norm_size} groups do not divide num_query_heads*head_dim={hd}")
        rot = self.head_dim * self.partial_rotary_factor
        need(rot == int(rot) and int(rot) % 2 == 0, "partial_rotary_factor",
             f"head_dim*partial_rotary_factor={rot} must be an even integer")
        need(int(rot) == self.qk_rope_head_dim, "qk_rope_head_dim",
             f"must equal head_dim*partial_rotary_factor={rot} (both rotary tables share it)")
        need(self.attention_type == "mla", "attention_type", f"only 'mla' is supported, got {self.attention_type!r}")
        need(self.dataset_type in ("mmap", "synthetic"), "dataset_type",
             f"must be 'mmap' or 'synthetic', got {self.dataset_type!r}")
        need(self.opt_type == "adamw", "opt_type", f"only 'adamw' is supported, got {self.opt_type!r}")
        V = self.vocab_size
        need(0 <= self.eod_id < V, "eod_id", f"{self.eod_id} is outside the vocabulary [0, vocab_size={V})")
        for name in ("pad_id", "bos_id"):
            v = getattr(self, name)
            need(v == -1 or 0 <= v < V, name, f"{v} is outside the vocabulary [0, vocab_size={V}) (-1 means none)")
        need(not self.add_bos or self.bos_id >= 0, "add_bos", "needs a bos_id (got -1)")
        need(len(self.blend_per_split) in (0, 3), "blend_per_split",
             f"want [] or 3 entries [train, valid, test], got {len(self.blend_per_split)}")
        need(not (self.blend_per_split and self.data_path), "blend_per_split",
             "cannot be used with data_path (as Megatron's blend and blend_per_split); set data_path ''")
        for name in ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_expert_parallelism", "ici_tensor_parallelism"):
            v = getattr(self, name)
            need(v == -1 or v >= 1, name, f"must be -1 (fill) or >= 1, got {v}")
        fills = [n for n in ("data", "fsdp", "expert", "tensor") if getattr(self, f"ici_{n}_parallelism") == -1]
        need(len(fills) <= 1, "ici_*_parallelism", f"at most one axis may be -1, got {fills}")
        need(self.mesh_axes == ["data", "fsdp", "expert", "tensor"], "mesh_axes",
             f"must be [data, fsdp, expert, tensor], got {self.mesh_axes}")
        for logical, axes in self.logical_axis_rules:
            for a in axes or ():
                need(a in self.mesh_axes, "logical_axis_rules", f"rule {logical!r} names unknown mesh axis {a!r}")
        self._derive()
        return self

    def _derive(self) -> None:
        L, k = self.base_num_decoder_layers, self.inhomogeneous_layer_cycle_interval
        tail = (L // k) * k
        types = tuple("mla" if (i + 1) % k == 0 or i >= tail else "gla" for i in range(L))
        object.__setattr__(self, "_layer_types", types)
        mlps = tuple("dense" if i < self.first_num_dense_layers else "moe" for i in range(L))
        object.__setattr__(self, "_mlp_types", mlps)

    # Derived values (computed once above, or trivially from fields).
    @property
    def layer_types(self) -> tuple[T.LayerType, ...]:
        """Per-layer attention type: 'mla' or 'gla'."""
        return self._layer_types

    @property
    def mlp_types(self) -> tuple[T.MlpType, ...]:
        """Per-layer MLP type: 'dense' or 'moe'."""
        return self._mlp_types

    @property
    def emb_dim(self) -> int:
        return self.base_emb_dim

    @property
    def mlp_dim(self) -> int:
        return self.base_mlp_dim

    @property
    def num_decoder_layers(self) -> int:
        return self.base_num_decoder_layers

    @property
    def num_query_heads(self) -> int:
        return self.base_num_query_heads

    @property
    def num_kv_heads(self) -> int:
        return self.base_num_kv_heads

    @property
    def qk_head_dim(self) -> int:
        """MLA q/k head dim: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head (GLA and MLA share it)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_expert_dim(self) -> int:
        """Width of the shared expert(s): moe_shared_expert_dim, or base_moe_mlp_dim when that is 0."""
        return self.moe_shared_expert_dim or self.base_moe_mlp_dim

    @property
    def routed_bias_dtype_resolved(self) -> str:
        return self.routed_bias_dtype or self.weight_dtype

    def global_batch_size(self, num_devices: int) -> int:
        """Sequences per optimizer step across all micro-batches."""
        return int(self.per_device_batch_size * num_devices) * self.gradient_accumulation_steps

    def micro_batch_size(self, num_devices: int) -> int:
        return int(self.per_device_batch_size * num_devices)


FIELD_GROUPS: dict[str, type[BaseModel]] = {f: g for g in GROUPS for f in g.model_fields}
