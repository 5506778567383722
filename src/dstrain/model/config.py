"""The GPT's configuration, without torch: a recipe, `dstrain estimate` and the
commands' argument checks read it without importing the model (dstrain.model.gpt builds it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from dstrain.errors import DstrainError
from dstrain.ranges import Range

FLAVOURS = ("gpt2", "llama")
# The published families of the llama flavour, each exported as its own transformers class (dstrain.model.hf.families).
FAMILIES = (
    *("llama", "mistral", "qwen2", "qwen3", "olmo2", "mixtral", "qwen3_moe"),
    *("smollm3", "phi3", "gemma2", "gemma3", "gpt_oss"),
    *("olmo3", "llama4"),  # issue 50's families
    *("deepseek_v3", "deepseek_v2", "glm4_moe"),  # DeepSeekMoE (model.moe), with latent attention (model.mla)
)


@dataclass
class RopeScaling:
    """RoPE scaling as transformers defines it (its `rope_parameters` without rope_theta; see
    transformers.modeling_rope_utils). Unscaled RoPE ("default") is model.rope_scaling: null."""

    type: Literal["linear", "llama3", "yarn", "longrope"]  # transformers' rope_type
    factor: Annotated[float, Range(gt=0)]  # context extension factor (positions / factor for linear)
    original_max_position_embeddings: Annotated[int, Range(ge=1)] | None = None  # llama3, yarn: pretraining length
    low_freq_factor: Annotated[float, Range(gt=0)] = 1.0  # llama3: wavelengths above orig/low are divided by factor
    high_freq_factor: Annotated[float, Range(gt=0)] = 4.0  # llama3: wavelengths below orig/high are kept
    beta_fast: Annotated[float, Range(gt=0)] = 32.0  # yarn: rotations where extrapolation starts
    beta_slow: Annotated[float, Range(gt=0)] = 1.0  # yarn: rotations where interpolation ends
    attention_factor: Annotated[float, Range(gt=0)] | None = None  # yarn: cos/sin scale; None = 0.1 ln(factor) + 1
    mscale: float | None = None  # yarn (DeepSeek form): with mscale_all_dim, attention_factor = ratio of the two
    mscale_all_dim: float | None = None  # yarn: see mscale
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    # --- longrope (Phi-3.5, Phi-4-mini): per-frequency divisors, the long ones past original_max_position_embeddings
    long_factor: list[float] | None = None  # longrope: rotary_dim/2 divisors when the batch's positions exceed it
    short_factor: list[float] | None = None  # longrope: rotary_dim/2 divisors otherwise; None: init_from's config.json

    def __post_init__(self) -> None:
        if self.type in ("llama3", "yarn", "longrope") and self.original_max_position_embeddings is None:
            raise DstrainError(
                f"model.rope_scaling.original_max_position_embeddings: {self.type} needs it; "
                f"set the pretraining context length"
            )


@dataclass
class MoEConfig:
    """A mixture of experts in place of the MLP of every `every`-th block (model.moe in a recipe).

    Router: Mixtral's, exactly (HF MixtralTopKRouter): logits = x @ router, softmax over all experts in fp32, the
    top_k largest probabilities renormalised to sum to 1 weigh the chosen experts' outputs. Dropless: every token
    reaches its top_k experts (DeepSpeed's dispatch buffer is sized to the busiest expert), so nothing is dropped.
    Each expert is the flavour's own MLP (SwiGLU for llama) of width d_expert.
    """

    num_experts: Annotated[int, Range(ge=2)] = 8  # experts per MoE layer
    top_k: Annotated[int, Range(ge=1)] = 2  # experts each token is sent to (must not exceed num_experts)
    every: Annotated[int, Range(ge=1)] = 1  # blocks every-1, 2*every-1, ... are MoE (1 = all; Mixtral export needs 1)
    d_expert: Annotated[int, Range(ge=1)] | None = None  # hidden width of each expert's MLP; None = the flavour's d_ff
    aux_loss_coef: Annotated[float, Range(ge=0)] = (
        0.01  # weight of the load-balancing loss (HF Mixtral's router_aux_loss_coef), mean over MoE layers
    )
    # batch: Mixtral's load-balancing loss over the micro-batch's tokens; sequence: DeepSeek-V3's (eq. 17-20), per
    # packed sample N_r/(K_r T) * sum_i count_i * P_i, averaged over the samples (docs/moe.md "Router losses")
    aux_loss_kind: Literal["batch", "sequence"] = "batch"
    z_loss_coef: Annotated[float, Range(ge=0)] = 0.001  # weight of the router z-loss mean(logsumexp(logits)^2)
    norm_topk_prob: bool = True  # renormalise the top_k probabilities to sum to 1 (Mixtral yes; Qwen3-MoE's flag)
    dense_layers: list[Annotated[int, Range(ge=0)]] = field(
        default_factory=list
    )  # blocks (0-based) kept dense whatever `every` says (Qwen3-MoE's mlp_only_layers)
    # --- GPT-OSS's experts, each a small feature of its own ---
    router_bias: bool = False  # a bias on the router's logits (GPT-OSS)
    expert_bias: bool = False  # biases on each expert's gate, up and down projections (GPT-OSS)
    swiglu_limit: Annotated[float, Range(gt=0)] | None = (
        None  # GPT-OSS's clamped SwiGLU: gate clamped <= limit, up to +-limit, gate*sigmoid(alpha*gate)*(up+1)
    )
    swiglu_alpha: Annotated[float, Range(gt=0)] = 1.702  # the clamped SwiGLU's sigmoid slope (with swiglu_limit)
    # --- DeepSeekMoE (DeepSeek-V2/V3, Moonlight, GLM-4.5): docs/moe.md; model/moe.py's deepseek_route ---
    scoring: Literal["softmax", "sigmoid"] = (
        "softmax"  # expert scores: softmax over experts, or each expert's sigmoid (DeepSeek-V3) plus a balancing bias
    )
    router_fp32: bool = False  # router logits computed in fp32 from fp32 weights and inputs (DeepSeek, GLM-4.5)
    n_group: Annotated[int, Range(ge=1)] = 1  # expert groups; a token's experts come from its topk_group best groups
    topk_group: Annotated[int, Range(ge=1)] = 1  # groups a token may route to (group-limited routing)
    routed_scaling_factor: Annotated[float, Range(gt=0)] = 1.0  # the routed experts' weights multiplied by this
    n_shared_experts: Annotated[int, Range(ge=0)] = 0  # experts every token runs through: one MLP this many wide
    bias_update_rate: Annotated[float, Range(ge=0)] = 0.0  # loss-free balancing: train/features/balancing.py; 0 = off
    # --- Llama 4's experts (transformers' Llama4TextMoe; model/moe.py's llama4_route) ---
    input_scaling: bool = False  # the chosen expert's sigmoid(logit) scales its input, not its output (top_k 1)

    def __post_init__(self) -> None:
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise DstrainError(
                f"model.moe.n_group: {self.n_group} groups (topk_group {self.topk_group}) do not split "
                f"num_experts={self.num_experts}; pick a divisor of num_experts and topk_group <= n_group"
            )
        if self.bias_update_rate and self.scoring != "sigmoid":
            raise DstrainError("model.moe.bias_update_rate: the balancing bias needs scoring: sigmoid; set it to 0")
        if self.input_scaling and (self.top_k != 1 or self.scoring != "softmax" or self.n_group > 1):
            raise DstrainError(
                "model.moe.input_scaling: Llama 4's routing is top-1 by the raw logits (top_k: 1, scoring: softmax, "
                "n_group: 1); set those or remove input_scaling"
            )
        if self.top_k > self.num_experts:
            raise DstrainError(
                f"model.moe.top_k: {self.top_k} exceeds num_experts={self.num_experts}; set top_k <= num_experts"
            )


@dataclass
class MLAConfig:
    """DeepSeek's multi-head latent attention (model.mla; DeepSeek-V2 section 2.1): keys and values from one low-rank
    latent of kv_lora_rank per token, queries through one of q_lora_rank (or a plain projection), each head's query and
    key a part without RoPE (qk_nope_head_dim) and a rotated part (qk_rope_head_dim, the key's shared by all heads),
    values v_head_dim wide. RoPE (and its YaRN scaling) acts on the qk_rope_head_dim part only."""

    kv_lora_rank: Annotated[int, Range(ge=1)]  # width of the compressed key/value latent (RMSNorm-ed)
    q_lora_rank: Annotated[int, Range(ge=1)] | None = None  # width of the compressed query; None = plain q_proj
    qk_nope_head_dim: Annotated[int, Range(ge=1)] = 128  # per head: query/key dimensions without RoPE
    qk_rope_head_dim: Annotated[int, Range(ge=2)] = 64  # per head: query/key dimensions RoPE rotates
    v_head_dim: Annotated[int, Range(ge=1)] = 128  # per head: value dimensions (o_proj takes n_head * v_head_dim)
    rope_interleave: bool = True  # how the transformers checkpoint lays out the rotated rows (DeepSeek-V3: pairs);
    # dstrain de-interleaves them on import and computes rotate_half RoPE (model/hf/mla_rows.py)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, d: int, heads: int) -> int:
        """Parameters of one latent attention: its projections and the latents' norms (model/mla.py)."""
        q = self.q_lora_rank
        query = d * heads * self.qk_head_dim if q is None else d * q + q + q * heads * self.qk_head_dim
        kv = (d + 1 + heads * (self.qk_nope_head_dim + self.v_head_dim)) * self.kv_lora_rank + d * self.qk_rope_head_dim
        return query + kv + heads * self.v_head_dim * d


@dataclass
class GPTConfig:
    flavour: str = "gpt2"  # architecture family: "gpt2" or "llama" (see module docstring)
    vocab_size: Annotated[int, Range(ge=1)] = 50304  # rows of the token embedding / columns of the logits
    max_seq_len: Annotated[int, Range(ge=1)] = (
        1024  # longest sequence; size of gpt2's position table, HF max_position_embeddings
    )
    n_layer: Annotated[int, Range(ge=1)] = 12  # number of transformer blocks
    n_head: Annotated[int, Range(ge=1)] = 12  # query heads; must divide d_model
    n_kv_head: Annotated[int, Range(ge=1)] | None = (
        None  # key/value heads (grouped-query attention, llama only); None = n_head
    )
    d_model: Annotated[int, Range(ge=1)] = 768  # residual stream width
    d_ff: Annotated[int, Range(ge=1)] | None = (
        None  # MLP hidden width; None = 4*d_model (gpt2), 8/3*d_model up to a multiple of 64 (llama)
    )
    tie_embeddings: bool | None = None  # share lm_head.weight with the token embedding; None = gpt2 yes, llama no
    norm_eps: Annotated[float, Range(gt=0)] = 1e-5  # epsilon of LayerNorm (gpt2) / RMSNorm (llama)
    rope_theta: Annotated[float, Range(gt=0)] = 10000.0  # RoPE base wavelength (llama only)
    init_std: Annotated[float, Range(gt=0)] = (
        0.02  # std of the normal init; o_proj/down_proj use init_std / sqrt(2 * n_layer)
    )
    doc_masking: bool = False  # attend only within the current document (segments start where position_ids == 0)
    moe: MoEConfig | None = None  # mixture of experts in place of the MLPs (see MoEConfig); None = dense
    # --- features of published llama-flavour families (model/hf/families.py maps each family onto them) ---
    family: str | None = None  # transformers class export writes (FAMILIES); None = llama, or mixtral with moe
    d_head: Annotated[int, Range(ge=2)] | None = None  # width of one head; None = d_model / n_head (Qwen3: 128)
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj only (Qwen2/2.5)
    o_bias: bool = False  # a bias on the attention's o_proj too (GPT-OSS, with qkv_bias)
    qk_norm: Literal["head", "projection", "l2"] | None = (
        None  # RMSNorm of q and k before RoPE: per head over d_head (Qwen3), or over the whole projection (OLMo 2);
        # l2: per head without a weight, after RoPE, on the blocks with RoPE only (Llama 4's use_qk_norm)
    )
    norm_placement: Literal["pre", "post", "sandwich"] = (
        "pre"  # pre: x + f(norm(x)); post: x + norm(f(x)) (OLMo 2); sandwich: x + norm(f(norm(x))) (Gemma 3)
    )
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma)
    scale_embeddings: bool = False  # token embeddings multiplied by sqrt(d_model) (Gemma)
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"  # the gated MLP's activation: SwiGLU, or GeGLU (Gemma)
    query_pre_attn_scalar: Annotated[float, Range(gt=0)] | None = (
        None  # attention scores scaled by query_pre_attn_scalar**-0.5 (Gemma); None = head_dim**-0.5
    )
    attn_softcap: Annotated[float, Range(gt=0)] | None = (
        None  # attention scores capped to c*tanh(s/c) before the mask (Gemma 2's attn_logit_softcapping)
    )
    logit_softcap: Annotated[float, Range(gt=0)] | None = (
        None  # output logits capped to c*tanh(z/c) (Gemma 2's final_logit_softcapping)
    )
    partial_rotary_factor: Annotated[float, Range(gt=0, le=1)] = (
        1.0  # share of each head's dimensions RoPE rotates, the first ones (Phi-3/4: partial rotary)
    )
    rope_local_theta: Annotated[float, Range(gt=0)] | None = (
        None  # RoPE base of the local (sliding_attention) blocks, unscaled (Gemma 3); None = rope_theta and scaling
    )
    # --- per-block attention kinds (docs/published-models.md): global, local within a window, without RoPE ---
    sliding_window: Annotated[int, Range(ge=1)] | None = (
        None  # window W of the local blocks: a query attends to itself and the W-1 tokens before it; None = no window
    )
    layer_types: list[Literal["full_attention", "sliding_attention", "chunked_attention"]] | None = (
        None  # each block's attention, as transformers names it; None = every block local if sliding_window is set
    )
    # --- Llama 4's attention (issue 50) ---
    attention_chunk: Annotated[int, Range(ge=1)] | None = (
        None  # chunk C of the chunked_attention blocks: a query attends to the keys of its own C-token chunk only
    )
    attn_temperature_floor: Annotated[int, Range(ge=1)] | None = (
        None  # Llama 4's temperature tuning on blocks without RoPE: q times 1 + attn_temperature_scale *
        # ln(1 + floor((position + 1) / attn_temperature_floor)); None = off
    )
    attn_temperature_scale: Annotated[float, Range(ge=0)] = 0.1  # the strength of that tuning (Llama 4's attn_scale)
    nope_layers: list[Annotated[int, Range(ge=0)]] = field(default_factory=list)  # blocks (0-based) without RoPE
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (GPT-OSS's sinks)
    rope_scaling: RopeScaling | None = None  # RoPE scaling (Llama 3.x: llama3); None = unscaled
    mla: MLAConfig | None = None  # multi-head latent attention in every block (DeepSeek-V2/V3); None = q/k/v heads

    @classmethod
    def from_dict(cls, fields: dict) -> GPTConfig:
        """The config of dataclasses.asdict(config) (a record, a recipe.yaml), nested sections rebuilt."""
        values = dict(fields)
        if isinstance(values.get("moe"), dict):
            values["moe"] = MoEConfig(**values["moe"])
        if isinstance(values.get("mla"), dict):
            values["mla"] = MLAConfig(**values["mla"])
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)

    def is_moe_block(self, index: int) -> bool:
        """Block `index` (0-based) holds a mixture of experts: every moe.every-th block, the last of each run."""
        return self.moe is not None and (index + 1) % self.moe.every == 0 and index not in self.moe.dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layer))

    @property
    def expert_dim(self) -> int:
        """moe.d_expert with None resolved to the flavour's MLP width."""
        return self.ff_dim if self.moe is None or self.moe.d_expert is None else self.moe.d_expert

    def __post_init__(self) -> None:
        def bad(key: str, problem: str, fix: str) -> DstrainError:
            return DstrainError(f"model.{key}: {problem}; {fix}")

        if self.flavour not in FLAVOURS:
            raise bad("flavour", f"{self.flavour!r} is not a known flavour", f"use one of {', '.join(FLAVOURS)}")
        for key in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                raise bad(key, f"{getattr(self, key)!r} is not a positive integer", "set a positive integer")
        if self.mla is not None and (self.flavour != "llama" or self.qk_norm or self.qkv_bias or self.n_kv_head):
            raise bad("mla", "latent attention has its own heads, no n_kv_head, qk_norm nor qkv_bias", "remove them")
        if self.mla is None and self.d_head is None and self.d_model % self.n_head:
            raise bad("n_head", f"{self.n_head} does not divide d_model={self.d_model}", "pick a divisor of d_model")
        if self.family is not None and self.family not in FAMILIES:
            raise bad("family", f"{self.family!r} is not a known family", f"use one of {', '.join(FAMILIES)}")
        if self.flavour == "gpt2" and (self.family or self.d_head or self.qkv_bias or self.qk_norm):
            raise bad("flavour", "family, d_head, qkv_bias and qk_norm need flavour 'llama'", "set flavour: llama")
        if self.flavour == "gpt2" and (self.norm_placement != "pre" or self.sliding_window or self.rope_scaling):
            raise bad("flavour", "norm_placement, sliding_window, rope_scaling need 'llama'", "set flavour: llama")
        if self.n_kv_head is not None and (self.n_kv_head <= 0 or self.n_head % self.n_kv_head):
            raise bad("n_kv_head", f"{self.n_kv_head} does not divide n_head={self.n_head}", "pick a divisor of n_head")
        if self.flavour == "gpt2" and self.kv_heads != self.n_head:
            raise bad(
                "n_kv_head", "grouped-query attention needs flavour 'llama'", "remove n_kv_head or set it to n_head"
            )
        if self.flavour == "llama" and self.mla is None and self.head_dim % 2:
            raise bad("n_head", f"RoPE needs an even head size, got {self.head_dim}", "change n_head or d_head")
        if self.d_ff is not None and self.d_ff <= 0:
            raise bad("d_ff", f"{self.d_ff} is not positive", "set a positive integer or remove it")
        if self.moe is not None and self.n_moe_layers == 0:
            raise bad("moe.every", f"{self.moe.every} exceeds n_layer={self.n_layer}", "set every <= n_layer")
        self._check_layer_kinds(bad)

    def _check_layer_kinds(self, bad) -> None:
        gemma = (self.norm_unit_offset, self.scale_embeddings, self.mlp_activation != "silu", self.rope_local_theta)
        if self.flavour == "gpt2" and (self.layer_types or self.nope_layers or self.attention_sinks or any(gemma)):
            raise bad("flavour", "layer kinds, sinks and the Gemma features need 'llama'", "set flavour: llama")
        if self.flavour == "gpt2" and (self.query_pre_attn_scalar or self.partial_rotary_factor != 1.0):
            raise bad("flavour", "query_pre_attn_scalar and partial_rotary_factor need 'llama'", "set flavour: llama")
        if self.flavour == "gpt2" and (self.attn_softcap or self.logit_softcap or self.attn_temperature_floor):
            raise bad(
                "flavour", "attn_softcap, logit_softcap, attn_temperature_floor need 'llama'", "set flavour: llama"
            )
        if self.flavour == "llama" and self.rotary_dim % 2:
            raise bad("partial_rotary_factor", f"rotates {self.rotary_dim} dimensions, an odd number", "change it")
        if self.layer_types is not None and len(self.layer_types) != self.n_layer:
            raise bad("layer_types", f"{len(self.layer_types)} kinds for n_layer={self.n_layer}", "give one per block")
        if self.layer_types and "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise bad("layer_types", "sliding_attention blocks need a window", "set model.sliding_window")
        if self.layer_types and "chunked_attention" in self.layer_types and self.attention_chunk is None:
            raise bad("layer_types", "chunked_attention blocks need a chunk size", "set model.attention_chunk")
        if self.attention_chunk is not None and "chunked_attention" not in (self.layer_types or []):
            raise bad("attention_chunk", "no block is chunked_attention", "list them in model.layer_types or remove it")
        outside = [i for i in self.nope_layers if i >= self.n_layer]
        if outside:
            raise bad("nope_layers", f"block {outside[0]} does not exist (n_layer={self.n_layer})", "use 0..n_layer-1")

    def window(self, index: int) -> int | None:
        """The attention window of block `index` (0-based): sliding_window on a local block, None on a global one."""
        local = self.layer_types is None or self.layer_types[index] == "sliding_attention"
        return self.sliding_window if local else None

    def chunk(self, index: int) -> int | None:
        """The attention chunk of block `index`: attention_chunk on a chunked_attention block (Llama 4), else None."""
        return self.attention_chunk if self.layer_types and self.layer_types[index] == "chunked_attention" else None

    def uses_rope(self, index: int) -> bool:
        """Whether block `index` rotates q and k (the llama flavour, but not the nope_layers)."""
        return self.flavour == "llama" and index not in self.nope_layers

    @property
    def head_dim(self) -> int:
        """d_head with None resolved (with model.mla: the query/key head, nope and rope parts together)."""
        if self.mla is not None:
            return self.mla.qk_head_dim
        return self.d_model // self.n_head if self.d_head is None else self.d_head

    @property
    def resolved_family(self) -> str:
        """family with None resolved: gpt2, llama or mixtral."""
        if self.family is not None:
            return self.family
        return "gpt2" if self.flavour == "gpt2" else "mixtral" if self.moe is not None else "llama"

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_heads(self) -> int:
        """n_kv_head with None resolved."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ff_dim(self) -> int:
        """d_ff with None resolved to the flavour's default."""
        if self.d_ff is not None:
            return self.d_ff
        if self.flavour == "gpt2":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / (3 * 64))

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model can take: gpt2's learned position table; None for llama (RoPE)."""
        return self.max_seq_len if self.flavour == "gpt2" else None

    @property
    def tied(self) -> bool:
        """tie_embeddings with None resolved to the flavour's default."""
        return self.flavour == "gpt2" if self.tie_embeddings is None else self.tie_embeddings


def kv_cache_refusal(config: GPTConfig) -> str | None:
    """Why this model cannot decode with the cache (None: it can). The cached attention is plain causal attention with
    GQA; the per-block masks and score transforms of some families are not in it."""
    parts = {
        "model.moe (experts)": config.moe is not None,
        "model.mla (latent attention)": config.mla is not None,
        "layer_types/sliding_window (local attention)": any(
            config.window(i) is not None or config.chunk(i) is not None for i in range(config.n_layer)
        ),
        "attention_sinks": config.attention_sinks,
        "attn_softcap": config.attn_softcap is not None,
        "attn_temperature_floor": config.attn_temperature_floor is not None,
    }
    named = [name for name, present in parts.items() if present]
    if not named:
        return None
    return f"decoding with the KV cache supports dense causal attention; this model has {', '.join(named)}"
