"""Small random transformers models of every published family dstrain converts, built from their own config classes
(never downloaded), shared by tests/test_families.py (logits, export, generate) and tests/test_family_configs.py
(RoPE frequencies, published sizes, refusals)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

VOCAB = 101
ATOL = 1e-5
LENGTH = 48  # tokens of the parity inputs: more than the windows of the windowed families
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}  # Phi-3/4: half of each head
LONGROPE = {  # Phi-4-mini's form at a small size: half of each 8-wide head rotated, 2 factors each
    "rope_type": "longrope",
    "rope_theta": 1e4,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.7],
    "long_factor": [2.5, 9.0],
    "original_max_position_embeddings": 16,
}
LOCAL_ROPE = {"rope_type": "default", "rope_theta": 100.0}  # Gemma 3's local blocks: their own base, unscaled
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)
DEEPSEEK = dict(  # MLA and DeepSeekMoE at a small size: a dense first block, 4 groups of 2 experts, 2 shared
    num_hidden_layers=3,
    num_key_value_heads=4,  # latent attention: one key per head (transformers' configs say num_attention_heads)
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    eos_token_id=None,  # the class's eos 1: a greedy run would stop where ours goes on
)
DEEPSEEK_YARN = YARN_ROPE | {"mscale": 0.9, "mscale_all_dim": 0.7}  # DeepSeek's attention-scale correction
# family test id -> (transformers config class, what sets the family apart, at a small size)
FAMILIES = {
    "llama3": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=16, head_dim=16, rope_parameters=LINEAR_ROPE)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_parameters=YARN_ROPE)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
    "qwen2-windowed": (  # block 0 global, block 1 local (max_window_layers)
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "olmo2": (transformers.Olmo2Config, dict(pad_token_id=None, eos_token_id=1)),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            router_aux_loss_coef=0.02,
        ),
    ),
    "qwen3_moe-sparse-step": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2),
    ),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "smollm3": (transformers.SmolLM3Config, dict(num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=None)),
    "phi3": (
        transformers.Phi3Config,
        dict(pad_token_id=None, sliding_window=16, rope_parameters=PARTIAL_ROPE),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={"full_attention": LINEAR_ROPE, "sliding_attention": LOCAL_ROPE},
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # low enough to cap these small random scores and logits
            final_logit_softcapping=1.5,
        ),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            num_hidden_layers=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            swiglu_limit=1.0,  # low enough that the clamps act on these small random weights
            rope_parameters=YARN_ROPE | {"truncate": False},
        ),
    ),
    # --- issue 50's families ---
    "phi3-longrope": (  # Phi-3.5 / Phi-4-mini: long factors past 16 positions (the 48 tokens), short ones below
        transformers.Phi3Config,
        dict(pad_token_id=None, original_max_position_embeddings=16, rope_parameters=LONGROPE),
    ),
    "llama4": (  # Llama 4 text, dense: 16-token chunks on the RoPE blocks, block 3 without RoPE and temperature-tuned
        transformers.Llama4TextConfig,
        dict(
            num_hidden_layers=4,
            head_dim=8,
            intermediate_size_mlp=40,
            moe_layers=[],
            attention_chunk_size=16,
            floor_scale=8,  # small enough that the temperature grows within the 48 tokens
            attn_scale=0.5,
            pad_token_id=None,
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "llama4_moe": (  # Llama 4's experts in blocks 1 and 3 (interleave_moe_layer_step 2): top-1, input scaled, shared
        transformers.Llama4TextConfig,
        dict(
            num_hidden_layers=4,
            head_dim=8,
            intermediate_size=24,
            intermediate_size_mlp=40,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=16,
            floor_scale=8,
            attn_scale=0.5,
            pad_token_id=None,
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "olmo3": (  # 3 local : 1 global; YaRN on the global blocks only, the local ones unscaled with the same base
        transformers.Olmo3Config,
        dict(
            num_hidden_layers=4,
            sliding_window=16,
            pad_token_id=None,
            eos_token_id=1,
            rope_parameters={"full_attention": YARN_ROPE, "sliding_attention": LOCAL_ROPE | {"rope_theta": 1e4}},
        ),
    ),
    # DeepSeek's latent attention (q through a latent or not, v narrower than q/k, YaRN with mscale) and DeepSeekMoE
    "deepseek_v3": (transformers.DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=12, rope_parameters=DEEPSEEK_YARN)),
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        dict(DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    ),
    "glm4_moe": (  # GLM-4.5: DeepSeek-V3's MoE with GQA, q/k/v biases, q/k norms, half of each head rotated
        transformers.Glm4MoeConfig,
        dict(
            {k: v for k, v in DEEPSEEK.items() if "lora" not in k and "head_dim" not in k},
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            rope_parameters=PARTIAL_ROPE,
        ),
    ),
}


def hf_class_name(config_class: type) -> str:
    """LlamaConfig -> LlamaForCausalLM; Gemma3TextConfig -> Gemma3ForCausalLM."""
    return config_class.__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")


def build_hf(family: str) -> transformers.PreTrainedModel:
    """A random model of the family, every norm and bias perturbed so that a swapped or dropped one shows."""
    config_class, features = FAMILIES[family]
    config = config_class(**(SMALL | features))
    config._attn_implementation = "eager" if family in ("gpt_oss", "gemma2") else "sdpa"  # sinks, soft caps: eager
    torch.manual_seed(0)
    model_class = getattr(transformers, hf_class_name(config_class))
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's balancing bias: it must steer the choice
                buffer.add_(0.1 * torch.randn_like(buffer))
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
