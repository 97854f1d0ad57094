"""The Ling2 config: Pydantic classes grouped by concern, flattened into one `Config`.

Every field is required here; `configs/base.yml` is the one place defaults live, so a
field missing from it is an error rather than a silent second default. Access is flat
(`cfg.num_experts`), as in MaxText. Values derived from several fields (per-layer types,
head dims) are computed once after validation.
"""

from typing import Any, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from ling2.config import enums as T
from ling2.config.kinds import FULL, KINDS, free_on_resume


MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")


# Keys Ling2 no longer reads, each with what to do instead: a config naming one is refused with this line.
# (A checkpoint's saved config.yml may still hold them, with their one accepted value: dropped on read.)
REMOVED_KEYS = {
    "decoder_block": "there is one decoder stack (the Ling2 hybrid); layer kinds come from the model file's "
                     "layer_types",
    "attention_type": "the full-attention layers are always MLA; which layers are MLA, GLA or KDA comes from "
                      "layer_types and linear_attention_type",
    "opt_type": "the optimizer is always AdamW (adam_* keys, mu_dtype)",
    "enable_dropout": "Ling2 has no dropout (neither has the reference model)",
    "dropout_rate": "Ling2 has no dropout (neither has the reference model)",
}


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, protected_namespaces=(),
                              allow_inf_nan=False)


def _numeric(annotation) -> bool:
    """Whether a field takes numbers and not booleans (int, float, or a union of them with None)."""
    kinds = set(get_args(annotation)) or {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


def _f(description: str, **constraints):
    """A required field with its one-line description (the default lives in configs/base.yml)."""
    return Field(description=description, **constraints)


class Model(_Group):
    model_name: T.ModelName = _f("Model file to load from configs/models/ ('default' loads none).")
    vocab_size: PositiveInt = _f("Rows of the embedding and columns of the lm_head; every token id must be below it.")
    base_emb_dim: PositiveInt = _f("Hidden size E.")
    base_mlp_dim: PositiveInt = _f("Width of the dense SwiGLU MLP of the first (dense) layers.")
    base_num_decoder_layers: PositiveInt = _f("Decoder layers L (MTP layers not included).")
    base_num_query_heads: PositiveInt = _f("Attention heads H of every attention layer (GLA and MLA).")
    base_num_kv_heads: PositiveInt = _f("Key/value heads; must divide base_num_query_heads (Ling2: equal to it).")
    head_dim: PositiveInt = _f("Per-head dim D of the linear-attention layers.")
    normalization_layer_epsilon: float = _f("RMSNorm epsilon of the decoder norms (HF rms_norm_eps).", gt=0)
    logits_via_embedding: bool = _f("Tie lm_head to the embedding (false for Ling2).")
    float32_logits: bool = _f("Compute the output logits in float32 (else in dtype).")
    loss_vocab_blocks: NonNegativeInt = _f(
        "Vocab blocks per tensor shard of the output-head cross-entropy (main loss, MTP, eval): the [B,T,V] logits "
        "are never held and the backward recomputes each block (4/3 of the head's matmul FLOPs); 0: full logits.")
    dtype: T.DType = _f("Activation/compute dtype.")
    weight_dtype: T.DType = _f("Parameter dtype.")
    quantization: T.Quantization = _f(
        "'' (matmuls in dtype) or 'fp8' (MaxText's key): the dense projections and the routed experts' GEMMs take "
        "e4m3 operands (gradients e5m2 or e4m3, see fp8_scaling); master weights, optimizer, router, norms, "
        "embeddings, attention scores and the loss keep their dtypes. Real FP8 GEMMs on Hopper GPUs; an "
        "emulation with the same rounding on CPU and TPU (no FP8 matmul units before TPU7x).")
    fp8_scaling: T.Fp8Scaling = _f(
        "With quantization=fp8: 'tensor' (one fp32 scale per operand from its current amax; e5m2 gradients; "
        "XLA:GPU runs FP8 GEMMs) or 'block' (1x128 activation tiles, 128x128 weight blocks, e4m3 gradients in "
        "1x128 tiles, as DeepSeek-V3 / Ling 2.0; emulated on every platform).")
    init_std: float = _f("Normal init std of every weight (HF initializer_range).", gt=0)
    inhomogeneous_layer_cycle_interval: int = _f(
        "Layer i is MLA when (i+1) % interval == 0; the others are linear attention (linear_attention_type). "
        "A trailing partial group is all MLA with gla (Ling2), all KDA with kda (Ling 3, the reference's rule).")
    first_num_dense_layers: NonNegativeInt = _f("Layers before this index use the dense MLP; the rest MoE.")
    attention_kernel: T.AttentionKernel = _f(
        "MLA attention backend: blocked (default), dot_product (reference), cudnn (GPU), flash (Pallas TPU).")
    attention_block_size: PositiveInt = _f(
        "Query block of attention_kernel=blocked: each block scores only the keys up to its end.")
    scan_layers: bool = _f("Stack repeated layer groups on a leading axis and run them under one lax.scan.")
    remat_policy: T.RematPolicy = _f(
        "Activation recomputation per layer: none, full (recompute all), save_dot (keep weight-matmul outputs).")


class Rope(_Group):
    rope_type: T.RopeType = _f("RoPE frequencies: default, or yarn (scaled by rope_factor).")
    rope_max_timescale: float = _f("RoPE theta (HF rope_theta).", gt=0)
    max_position_embeddings: PositiveInt = _f("Longest position the model is configured for (HF max_position_embeddings).")
    original_max_position_embeddings: PositiveInt = _f("Yarn: the context length before scaling.")
    rope_factor: float = _f("Yarn scaling factor (ignored by rope_type=default).", gt=0)
    beta_fast: float = _f("Yarn: rotations below which dims are interpolated.")
    beta_slow: float = _f("Yarn: rotations above which dims are extrapolated.")
    mscale: float = _f("Yarn: attention-amplitude mscale.")
    mscale_all_dim: float = _f("Yarn: mscale of the MLA softmax scale (0: none).")
    partial_rotary_factor: float = _f("Fraction of head_dim that is rotated.", gt=0, le=1)


class LinearAttention(_Group):
    linear_attention_type: str = _f(
        "Linear-attention kind of the hybrid: gla (Ling2, BailingMoeV2_5) or kda (Ling 3, Kimi Delta Attention).")
    use_qk_norm: bool = _f("RMSNorm over D on q and k of GLA layers.")
    use_linear_silu: bool = _f("SiLU on the fused qkv projection of GLA layers.")
    group_norm_size: PositiveInt = _f(
        "NUMBER of groups G of the GLA output GroupRMSNorm: H*D is split into G groups of H*D/G. "
        "G=1 is plain RMSNorm over H*D.")
    gla_slope_layer_offset: int = _f(
        "Slope uses (layer_idx + offset): -1 is the HF reference's (layer_idx - 1); 0 is vLLM's layer_idx.")
    gla_chunk_size: PositiveInt = _f("Tokens per chunk of the chunked GLA kernels (a multiple of 8).")
    gla_backend: T.GlaBackend = _f("GLA kernel: auto (pallas_tpu on TPU, pallas_gpu on GPU, chunked elsewhere), "
                                   "chunked, pallas_tpu, pallas_gpu, or the oracles naive/quadratic.")
    kda_conv_kernel_size: PositiveInt = _f(
        "KDA: taps K of the depthwise causal short conv over [q | k | v] (HF short_conv_kernel_size).")
    kda_safe_gate: bool = _f(
        "KDA forget gate: true g = kda_lower_bound * sigmoid(exp(A_log) * f) (bounded); false g = -exp(A_log) * "
        "softplus(f) (HF kda_safe_gate).")
    kda_lower_bound: float = _f("KDA safe gate: the lower bound of the per-token log decay (HF kda_lower_bound).", lt=0)
    kda_chunk_size: PositiveInt = _f("KDA: tokens per chunk of the chunked kernels (a power of two >= 16).")
    kda_backend: T.KdaBackend = _f("KDA kernel: auto (pallas_tpu on TPU, pallas_gpu on GPU, chunked elsewhere), "
                                   "chunked, pallas_tpu, pallas_gpu, or the oracle naive.")


class Mla(_Group):
    q_lora_rank: NonNegativeInt = _f("Rank of the q down-projection; 0 means a single q projection.")
    kv_lora_rank: PositiveInt = _f("Rank of the compressed KV latent (cached per token when decoding).")
    qk_nope_head_dim: PositiveInt = _f("Per-head q/k dims without RoPE.")
    qk_rope_head_dim: PositiveInt = _f("Per-head q/k dims with RoPE (k's are shared by all heads).")
    v_head_dim: PositiveInt = _f("Per-head value dim.")
    mla_interleaved_rope: bool = _f("De-interleave the rope dims (even, then odd) before rotate-half.")
    mla_output_gate: bool = _f(
        "Multiply each head's attention output by sigmoid(x W_g) (W_g [E, H]) before the output projection (Ling 3).")


class MoE(_Group):
    num_experts: PositiveInt = _f("Routed experts per MoE layer.")
    num_experts_per_tok: PositiveInt = _f("Routed experts each token is sent to (top-k).")
    base_moe_mlp_dim: PositiveInt = _f("Width of each routed SwiGLU expert.")
    capacity_factor: float = _f("<= 0: dropless. > 0: the dense path drops tokens past capacity.")
    sparse_matmul: bool = _f("True: sort + grouped matmul (dropless). False: dense einsum with capacity.")
    moe_gmm_backend: T.GmmBackend = _f(
        "Dropless grouped matmul: 'ragged_dot', 'tiled' (fast on CPU), 'blocked' (batched matmuls over "
        "expert-pure row blocks; XLA:GPU runs ragged_dot dense over the experts), 'pallas_gpu' (Pallas Triton "
        "grouped matmul reading each expert's weights in place; interpreted on CPU), 'megablox' (Pallas TPU "
        "kernels; interpreted elsewhere), or 'auto' (tiled on CPU, megablox on TPU, pallas_gpu on CUDA GPUs).")
    moe_ep_all_to_all: T.EpAllToAll = _f(
        "Expert-parallel token exchange: 'ragged' (jax.lax.ragged_all_to_all: each peer gets exactly its rows; "
        "TPU and GPU), 'padded' (all_to_all of a worst-case [n, rows] buffer per peer; any platform), 'emulated' "
        "(the ragged exchange's offsets carried out by padded collectives: for testing it where ragged cannot "
        "run), or 'auto' (padded on CPU, ragged elsewhere).")
    moe_ep_capacity_factor: float = _f(
        "Ragged exchange's receive buffer per device: this factor x the balanced share (the rows a device "
        "sends); <= 0: room for every row. A layer whose routing sends some device more rows runs that "
        "step's exchange in rounds of at most this many rows per receiver: no token is dropped, no buffer "
        "grows.")
    load_balance_loss_weight: NonNegativeFloat = _f("Switch-style auxiliary load-balancing loss weight; 0 skips it.")
    moe_z_loss_weight: NonNegativeFloat = _f("ST-MoE router z-loss weight; 0 skips the computation.")


class DeepSeekMoE(_Group):
    shared_experts: NonNegativeInt = _f("Shared (always-on) experts per MoE layer, added unweighted.")
    moe_shared_expert_dim: NonNegativeInt = _f("Shared expert width; 0 falls back to base_moe_mlp_dim.")
    routed_scaling_factor: float = _f("Multiplies the routed experts' weights.", gt=0)
    n_routing_groups: PositiveInt = _f("Expert groups of group-limited routing (1: no groups).")
    topk_routing_group: PositiveInt = _f("Groups kept per token (by the sum of each group's top-2 scores).")
    routed_score_func: T.ScoreFunc = _f("Router score: sigmoid or softmax.")
    routed_bias: bool = _f("Add a selection-only expert bias (loss-free balancing).")
    routed_bias_update_rate: NonNegativeFloat = _f("Step of the once-per-optimizer-step expert bias update.")
    routed_bias_dtype: T.DTypeOrDefault = _f("Dtype of the expert bias; '' follows weight_dtype.")
    enable_routed_bias_grad: bool = _f("False: the bias takes no gradient, only loss-free updates.")
    routed_bias_zero_mean_update: bool = _f("Recentre the bias to zero mean after each update.")
    norm_topk_prob: bool = _f("Normalise top-k softmax weights to sum 1 (sigmoid weights: sigmoid_renormalize).")
    sigmoid_renormalize: bool = _f(
        "Divide the chosen experts' sigmoid weights by their sum before routed_scaling_factor (HF norm_topk_prob, "
        "Ling 3 moe_renormalize); false keeps the raw sigmoid scores. The BailingMoeV2_5 gate renormalises iff "
        "top-k > 1.")


class Mtp(_Group):
    mtp_num_layers: NonNegativeInt = _f("Multi-token-prediction depths K (depth k predicts the token k+1 ahead).")
    mtp_loss_scaling_factor: NonNegativeFloat = _f("Weight of the mean MTP loss added to the main loss.")
    mtp_hidden_pre_norm: bool = _f("Feed MTP the main hidden state before the final norm (HF: after).")


class Data(_Group):
    dataset_type: str = _f("'mmap' (Megatron .bin/.idx) or 'synthetic'.")
    data_path: str = _f("Megatron-style: a prefix, or 'w1 prefix1 w2 prefix2 ...'.")
    data_split: str = _f("Train/valid/test weights of the sequences, e.g. '969,30,1' (Megatron's --split).")
    data_seed: int = _f("Seed of the Megatron document and sample shuffles (numpy's RandomState: [0, 2^32)).",
                        ge=0, le=2**32 - 1)
    max_target_length: PositiveInt = _f("Sequence length S.")
    add_extra_token_to_sequence: bool = _f("Samples hold S + 1 tokens so targets are inputs shifted by one (Megatron).")
    blend_per_split: list[str] = _f(
        "Megatron's blend_per_split: [train, valid, test] data_path strings ('' for none) used instead of data_path "
        "and data_split; [] to use data_path.")
    drop_last_partial_validation_sequence: bool = _f(
        "Drop the last, partial validation sample (Megatron's default); false pads it.")
    exact_sample_count: bool = _f(
        "Count keep-partial samples with an exact integer ceil; false uses Megatron's float32 (differs past 2^24 tokens).")
    blend_cache_dir: str = _f("Cache directory for generated index .npy files; '' disables caching.")
    blend_index_dir: str = _f(
        "Directory of prebuilt index .npy files (Megatron's cache) to load instead of building; a set for the same "
        "dataset built for another request is an error.")
    reset_attention_mask: bool = _f("Each document in a packed sample gets its own segment id.")
    reset_position_ids: bool = _f("Positions restart at 0 after each EOD.")
    eod_mask_loss: bool = _f("Exclude positions whose input token is EOD from the loss.")
    grain_worker_count: NonNegativeInt = _f("Grain worker processes reading batches (0: in the trainer process).")


class Tokenizer(_Group):
    tokenizer_path: str = _f("tokenizer.json of the data (recorded with the run; not read by the trainer).")
    pad_id: int = _f("Padding id (masked from the loss, as Megatron); -1 means none.")
    bos_id: int = _f("BOS id inserted between documents when add_bos; -1 means none.")
    eod_id: int = _f("End-of-document id: documents in a packed sample are split after it.")
    add_bos: bool = _f("Insert bos_id at the start of every document that begins inside a sample.")


class Optimizer(_Group):
    learning_rate: float = _f("Peak learning rate.", gt=0)
    lr_schedule: T.LrSchedule = _f(
        "Decay after the linear warmup: cosine, wsd (warmup-stable-decay), constant, or wsm (warmup-stable-merge: "
        "constant, the decay emulated by merging checkpoints: //ling2/checkpoint:merge, merge_window).")
    warmup_steps_fraction: float = _f("Fraction of `steps` spent warming up linearly from 0.", ge=0, le=1)
    final_lr_fraction: float = _f("Learning rate at the end of the decay, as a fraction of the peak.", ge=0, le=1)
    wsd_decay_steps_fraction: float = _f("lr_schedule=wsd: fraction of `steps` spent decaying.", ge=0, le=1)
    adam_b1: float = _f("Adam beta1.", ge=0, lt=1)
    adam_b2: float = _f("Adam beta2.", ge=0, lt=1)
    adam_eps: float = _f("Adam epsilon.", gt=0)
    mu_dtype: T.DTypeOrDefault = _f(
        "Dtype of Adam's first moment; '' follows weight_dtype. bfloat16 halves it (MaxText's mu_dtype); the "
        "second moment and the update stay in weight_dtype.")
    adam_weight_decay: NonNegativeFloat = _f("Decoupled weight decay of matrices (not norms, biases or the embedding).")
    weight_decay_embeddings: bool = _f("Also decay the token embedding.")
    gradient_clipping_threshold: NonNegativeFloat = _f("Global-norm gradient clipping; 0 disables it.")
    calculate_per_token_loss: bool = _f(
        "Gradient accumulation: True divides by all tokens across micro-batches; "
        "False averages each micro-batch, then micro-batches equally.")


class Training(_Group):
    steps: PositiveInt = _f("Optimizer steps to train (the schedule's length; an int32 on the device).", le=2**31 - 1)
    per_device_batch_size: float = _f("Sequences per device per micro-batch (may be < 1 under model parallelism).", gt=0)
    gradient_accumulation_steps: PositiveInt = _f("Micro-batches per optimizer step.")
    seed: int = _f("Seed of the parameter initialisation (a JAX key: a 64-bit integer).", ge=-2**63, le=2**63 - 1)
    eval_interval: NonNegativeInt = _f("Evaluate on the valid split every this many steps; 0 never.")
    eval_steps: NonNegativeInt = _f("Validation batches per evaluation.")
    merge_window: NonNegativeInt = _f(
        "WSM: also evaluate the merge of the newest this many checkpoints (eval/merged_loss; the training "
        "state is untouched); 0: off.")
    merge_every: NonNegativeInt = _f("WSM: evaluate the merged model every this many steps (0: at each eval_interval).")
    merge_shape: T.MergeShape = _f("WSM: the decay shape the merge weights emulate: uniform (= linear), cosine, 1-sqrt.")


class Mesh(_Group):
    ici_stage_parallelism: int = _f(
        "Size of the stage axis (pipeline parallelism): the scanned layer groups split into this many consecutive "
        "stages, one per shard (the 'layers' rule); outside them the axis splits the batch. -1 fills.")
    pipeline_microbatches: PositiveInt = _f(
        "With stages > 1: pipeline micro-batches each micro-batch's rows split into (GPipe schedule; the bubble is "
        "(stages - 1) / (pipeline_microbatches + stages - 1) of the pipelined layers' time).")
    pipeline_weights_dtype: T.DTypeOrDefault = _f(
        "With stages > 1: dtype a stage holds its weights in, gathered for the whole step, and sums their gradients "
        "over its micro-batches in; '' keeps weight_dtype (exact against no pipeline). bfloat16 halves both, the "
        "bulk of a stage's memory, as Megatron-LM's bf16 parameters with --main-grads-dtype bf16: the layers then "
        "compute from bfloat16-rounded weights (routers and norms included) and the optimizer still updates the "
        "weight_dtype master copy.")
    ici_data_parallelism: int = _f("Size of the mesh's data axis (pure data parallelism); -1 fills the remaining devices.")
    ici_fsdp_parallelism: int = _f("Size of the fsdp axis (parameters sharded, batch split); -1 fills.")
    ici_expert_parallelism: int = _f("Size of the expert axis (experts sharded, batch split); -1 fills.")
    ici_context_parallelism: int = _f(
        "Size of the context axis: each sequence split into this many contiguous shards (context "
        "parallelism; the activation_length rule); -1 fills.")
    ici_tensor_parallelism: int = _f("Size of the tensor axis (heads, MLP width, vocab sharded); -1 fills.")
    dcn_data_parallelism: int = _f(
        "Multi-slice: slices along the data axis (over the data-center network); the mesh's data axis is "
        "dcn x ici, slices outermost. The dcn_* sizes multiply to the number of slices; -1 fills.")
    dcn_stage_parallelism: int = _f("Multi-slice: slices along the stage axis (see dcn_data_parallelism); -1 fills.")
    dcn_fsdp_parallelism: int = _f("Multi-slice: slices along the fsdp axis (see dcn_data_parallelism); -1 fills.")
    dcn_expert_parallelism: int = _f("Multi-slice: slices along the expert axis (see dcn_data_parallelism); -1 fills.")
    dcn_context_parallelism: int = _f("Multi-slice: slices along the context axis (see dcn_data_parallelism); -1 fills.")
    dcn_tensor_parallelism: int = _f("Multi-slice: slices along the tensor axis (see dcn_data_parallelism); -1 fills.")
    logical_axis_rules: list[tuple[str, Optional[list[str]]]] = _f(
        "Logical axis name -> mesh axes (null: replicated), for parameters and activations.")


class Checkpointing(_Group):
    load_parameters_path: str = _f(
        "Initial weights from a converter checkpoint (hf_to_ling2 --out) or a trainer step directory; "
        "used only when the run has no checkpoint of its own to resume.")
    enable_checkpointing: bool = _f("Save checkpoints in run_dir/checkpoints and resume from the latest.")
    async_checkpointing: bool = _f("Write checkpoints on a background thread (the loop waits only for a copy).")
    checkpoint_period: PositiveInt = _f("Save every this many steps (and at the end, and on SIGTERM/SIGINT).")
    max_checkpoints_to_keep: PositiveInt = _f("Older checkpoints beyond this many are deleted.")
    hf_source_config: dict[str, Any] = _f(
        "The Hugging Face config.json this model was converted from ({} for a Ling2-native model): ling2_to_hf "
        "writes back its fields Ling2 does not model (dropouts, use_cache, bos_token_id, ...) and keeps its "
        "spelling of those it does while they still mean the same.")


class Logging(_Group):
    log_period: PositiveInt = _f("Log metrics every this many steps.")
    log_router_stats: bool = _f("Add per-layer router statistics (load, violation) to the metrics.")
    profiler: T.Profiler = _f(
        "'' (off) or 'xplane': a JAX trace of profile_steps train steps from profile_start_step, in "
        "run_dir/profile (TensorBoard's profile plugin or xprof); each step is annotated 'train' with its number.")
    profile_start_step: NonNegativeInt = _f(
        "profiler: trace from the step after this many (the first step of a run compiles; a resumed run past it "
        "traces nothing).")
    profile_steps: PositiveInt = _f("profiler: train steps traced.")


GROUPS = (Model, Rope, LinearAttention, Mla, MoE, DeepSeekMoE, Mtp, Data, Tokenizer, Optimizer, Training, Mesh,
           Checkpointing, Logging)


class Config(*GROUPS):
    """The resolved config. Build it with `ling2.config.load_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, protected_namespaces=(),
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data):
        """YAML's true and false are not numbers (pydantic would take `steps: true` as 1)."""
        if isinstance(data, dict):
            for k, v in data.items():
                field = cls.model_fields.get(k)
                if isinstance(v, bool) and field is not None and _numeric(field.annotation):
                    raise ValueError(f"{k}: expected a number, got {str(v).lower()}")
        return data

    @model_validator(mode="after")
    def _check(self) -> "Config":
        def need(ok: bool, field: str, msg: str):
            if not ok:
                raise ValueError(f"{field}: {msg}")

        linear = [k for k, v in KINDS.items() if v.role == "linear"]
        need(self.linear_attention_type in linear, "linear_attention_type",
             f"unknown kind {self.linear_attention_type!r} (one of {', '.join(linear)})")
        need(self.inhomogeneous_layer_cycle_interval >= 1, "inhomogeneous_layer_cycle_interval",
             f"must be >= 1, got {self.inhomogeneous_layer_cycle_interval}")
        need(self.lr_schedule != "wsd" or self.warmup_steps_fraction + self.wsd_decay_steps_fraction <= 1 + 1e-9,
             "wsd_decay_steps_fraction", f"{self.wsd_decay_steps_fraction} + warmup_steps_fraction="
             f"{self.warmup_steps_fraction} exceed the run (1): the decay would stop short of final_lr_fraction")
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
        KINDS[self.linear_attention_type].validate(self, need)
        if self.rope_type == "default":
            need(self.max_target_length <= self.max_position_embeddings, "max_target_length",
                 f"{self.max_target_length} exceeds max_position_embeddings={self.max_position_embeddings} with "
                 "rope_type 'default' (no rope scaling); shorten it or set rope_type: yarn")
        need(self.dataset_type in ("mmap", "synthetic"), "dataset_type",
             f"must be 'mmap' or 'synthetic', got {self.dataset_type!r}")
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
        for net in ("ici", "dcn"):
            for a in MESH_AXES:
                v = getattr(self, f"{net}_{a}_parallelism")
                need(v == -1 or v >= 1, f"{net}_{a}_parallelism", f"must be -1 (fill) or >= 1, got {v}")
            fills = [a for a in MESH_AXES if getattr(self, f"{net}_{a}_parallelism") == -1]
            need(len(fills) <= 1, f"{net}_*_parallelism", f"at most one axis may be -1, got {fills}")
        for logical, axes in self.logical_axis_rules:
            for a in axes or ():
                need(a in MESH_AXES, "logical_axis_rules", f"rule {logical!r} names unknown mesh axis {a!r}")
        if self.merge_window:
            need(bool(self.merge_every or self.eval_interval), "merge_window",
                 "needs merge_every or eval_interval to say when to evaluate the merge")
            need(self.enable_checkpointing, "merge_window", "merges saved checkpoints: needs enable_checkpointing")
        ici, dcn = self.ici_context_parallelism, self.dcn_context_parallelism
        if ici != -1 and dcn != -1:
            problem = self.context_problem(ici * dcn)
            need(problem is None, "ici_context_parallelism", problem)
        self._derive()
        return self

    def _derive(self) -> None:
        L, k = self.base_num_decoder_layers, self.inhomogeneous_layer_cycle_interval
        lin = self.linear_attention_type
        tail = L if KINDS[lin].trailing_group_linear else (L // k) * k
        types = tuple(FULL if (i + 1) % k == 0 or i >= tail else lin for i in range(L))
        object.__setattr__(self, "_layer_types", types)
        mlps = tuple("dense" if i < self.first_num_dense_layers else "moe" for i in range(L))
        object.__setattr__(self, "_mlp_types", mlps)

    # Derived values (computed once above, or trivially from fields).
    @property
    def layer_types(self) -> tuple[T.LayerType, ...]:
        """Per-layer attention kind (`ling2.config.kinds`): the full kind or `linear_attention_type`."""
        return self._layer_types

    @property
    def mlp_types(self) -> tuple[T.MlpType, ...]:
        """Per-layer MLP type: 'dense' or 'moe'."""
        return self._mlp_types

    @property
    def qk_head_dim(self) -> int:
        """MLA q/k head dim: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head, as the linear kind shares them with the full kind (`ling2.config.kinds`)."""
        return KINDS[self.linear_attention_type].rotary_dim(self)

    @property
    def shared_expert_dim(self) -> int:
        """Width of the shared expert(s): moe_shared_expert_dim, or base_moe_mlp_dim when that is 0."""
        return self.moe_shared_expert_dim or self.base_moe_mlp_dim

    @property
    def routed_bias_dtype_resolved(self) -> str:
        return self.routed_bias_dtype or self.weight_dtype

    def context_problem(self, context: int) -> Optional[str]:
        """Why a context axis of `context` shards (ici x dcn) cannot split this run's sequences, or None: each
        shard must hold whole chunks of the linear-attention kernel."""
        field = KINDS[self.linear_attention_type].chunk_field
        chunk = getattr(self, field) if field else 1
        if context > 1 and self.max_target_length % (context * chunk):
            return (f"context parallelism {context} needs max_target_length ({self.max_target_length}) to be a "
                    f"multiple of context x {field} = {context} x {chunk}")
        T = self.max_target_length
        if context > 1 and T % (2 * context):
            return (f"context parallelism {context} needs max_target_length ({T}) to be a multiple of 2 x context "
                    f"(each shard holds two chunks of the balanced attention layout)")
        if context > 1 and self.attention_kernel == "flash" and ((T // (2 * context)) % 128 or T % (context * context)):
            return (f"context parallelism {context} with attention_kernel=flash needs max_target_length ({T}) / "
                    f"(2 x context) to be a multiple of 128 (splash attention's query blocks: each shard holds two "
                    f"chunks of the balanced layout) and max_target_length a multiple of context x context")
        return None

    def global_batch_size(self, num_devices: int) -> int:
        """Sequences per optimizer step across all micro-batches."""
        return int(self.per_device_batch_size * num_devices) * self.gradient_accumulation_steps

    def micro_batch_size(self, num_devices: int) -> int:
        return int(self.per_device_batch_size * num_devices)


FIELD_GROUPS: dict[str, type[BaseModel]] = {f: g for g in GROUPS for f in g.model_fields}

# What resuming a run with a changed value does (`resume_class`):
#   "fixed": refused. The weights, their layout, the data order or the batch shape would no longer be the
#            checkpoint's (model shape, numerics that define the model, data, tokens, batch per device).
#   "warn":  allowed with a warning: the optimizer and its schedule, loss weights, compute dtype, the seed,
#            the step count; the run continues from the checkpoint under the new values.
#   "free":  allowed silently: how the same maths runs (kernels, remat, mesh layout), evaluation,
#            checkpointing and logging. A mesh change must keep the global batch (checked on its own).
RESUME_FIXED, RESUME_WARN, RESUME_FREE = "fixed", "warn", "free"
RESUME_GROUPS: dict[type[BaseModel], str] = {
    Model: RESUME_FIXED, Rope: RESUME_FIXED, LinearAttention: RESUME_FIXED, Mla: RESUME_FIXED, MoE: RESUME_FIXED,
    DeepSeekMoE: RESUME_FIXED, Mtp: RESUME_FIXED, Data: RESUME_FIXED, Tokenizer: RESUME_FIXED,
    Optimizer: RESUME_WARN, Training: RESUME_WARN, Mesh: RESUME_FREE, Checkpointing: RESUME_FREE,
    Logging: RESUME_FREE,
}
RESUME_FIELDS: dict[str, str] = {
    # kernels and memory: the same model, computed another way
    **free_on_resume(), "remat_policy": RESUME_FREE, "moe_gmm_backend": RESUME_FREE,
    "scan_layers": RESUME_FREE, "loss_vocab_blocks": RESUME_FREE,  # checkpoints re-lay out; nothing saved changes
    "moe_ep_all_to_all": RESUME_FREE, "moe_ep_capacity_factor": RESUME_FREE,
    "grain_worker_count": RESUME_FREE, "blend_cache_dir": RESUME_FREE,
    # training hyperparameters outside the optimizer group
    "dtype": RESUME_WARN, "quantization": RESUME_WARN, "fp8_scaling": RESUME_WARN, "float32_logits": RESUME_WARN, "load_balance_loss_weight": RESUME_WARN,
    "moe_z_loss_weight": RESUME_WARN, "routed_bias_update_rate": RESUME_WARN, "mtp_loss_scaling_factor": RESUME_WARN,
    "tokenizer_path": RESUME_WARN, "pipeline_weights_dtype": RESUME_WARN,
    # the batch shape of a step
    "per_device_batch_size": RESUME_FIXED, "gradient_accumulation_steps": RESUME_FIXED,
    "eval_interval": RESUME_FREE, "eval_steps": RESUME_FREE, "merge_window": RESUME_FREE, "merge_every": RESUME_FREE,
    "merge_shape": RESUME_FREE,
}


def resume_class(field: str) -> str:
    """"fixed", "warn" or "free": what resuming a checkpoint with a changed `field` does (see above)."""
    return RESUME_FIELDS.get(field, RESUME_GROUPS[FIELD_GROUPS[field]])
