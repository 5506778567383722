"""Published families in and out: a small random transformers model of each family, built from its own config class
(never downloaded) -> from_hf -> our GPT gives its logits (fp32, 1e-5), also on packed documents; to_hf gives the same
class back with the same logits, and the exported folder loads in transformers with no missing or unexpected weight."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from dstrain.errors import DstrainError  # noqa: E402
from dstrain.model.gpt import GPT  # noqa: E402
from dstrain.model.hf import from_hf, to_hf  # noqa: E402
from dstrain.model.rope import inverse_frequencies  # noqa: E402

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


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request):
    """(the transformers model, from_hf's config and state dict) of one family, built once for its tests."""
    hf = build_hf(request.param)
    return (hf, *from_hf(hf))


@torch.no_grad()
def test_imported_family_gives_transformers_logits(imported):
    hf, config, state = imported
    config = dataclasses.replace(config)  # a copy: doc_masking is flipped below
    ours = GPT(config).eval()
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (2, LENGTH))  # longer than every window: the window cuts
    assert max_diff(ours(ids), hf(ids).logits) <= ATOL
    if config.sliding_window is not None:
        unwindowed = GPT(dataclasses.replace(config, sliding_window=None, layer_types=None)).eval()
        unwindowed.load_state_dict(state, strict=True)
        assert max_diff(unwindowed(ids), hf(ids).logits) > 1e-3
    position_ids = torch.cat([torch.arange(19), torch.arange(LENGTH - 19)]).expand(2, -1)
    plain = hf(ids, position_ids=position_ids, attention_mask=torch.ones_like(ids)).logits
    assert max_diff(ours(ids, position_ids), plain) <= ATOL
    assert max_diff(plain, hf(ids).logits) > 1e-3  # the positions did matter
    # Packed documents: each document run alone through transformers (its own packed-document detection misses
    # GPT-OSS's eager attention in transformers 5.23: its second document then attends to the first).
    packed = torch.cat([hf(ids[:, :19]).logits, hf(ids[:, 19:]).logits], dim=1)
    config.doc_masking = True
    assert max_diff(ours(ids, position_ids), packed) <= ATOL


@torch.no_grad()
def test_exported_family_is_the_same_class_with_the_same_logits(imported, tmp_path):
    hf, config, state = imported
    hf_config, hf_state = to_hf(config, state)
    assert hf_config.architectures == [type(hf).__name__]
    hf_config._attn_implementation = hf.config._attn_implementation
    again = type(hf)(hf_config).eval()
    again.load_state_dict(hf_state, strict=True)
    ids = torch.randint(0, VOCAB, (2, 20))
    assert torch.equal(again(ids).logits, hf(ids).logits)
    again.save_pretrained(tmp_path)
    loaded, info = type(hf).from_pretrained(tmp_path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert type(transformers.AutoModelForCausalLM.from_config(loaded.config)) is type(hf)
    assert max_diff(loaded.eval()(ids).logits, hf(ids).logits) <= ATOL
    assert from_hf(tmp_path)[0] == config  # config.json -> the same model.* fields


@pytest.mark.parametrize(
    "family",
    ["mistral", "smollm3", "phi3", "gemma2", "gemma3", "gpt_oss", "olmo3", "phi3-longrope", "llama4"]
    + ["deepseek_v3", "deepseek_v2", "glm4_moe"],
)
@torch.no_grad()
def test_greedy_generation_equals_transformers_generate(family):
    """Past the windows (6 + 14 tokens > 16): transformers decodes with its cache (a sliding one on local layers),
    we recompute the whole sequence each step; the tokens must agree (the other families: tests/test_hf.py's llama)."""
    hf = build_hf(family)
    config, state = from_hf(hf)
    ours = GPT(config).eval()
    ours.load_state_dict(state, strict=True)
    prompt = torch.randint(2, VOCAB, (2, 6))
    greedy = transformers.GenerationConfig(max_new_tokens=14, do_sample=False, pad_token_id=1, eos_token_id=None)
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    assert generated.shape == (2, 20)  # no early stop: every step compared
    tokens = prompt
    for _ in range(14):
        tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


@pytest.mark.parametrize(
    "family, feature, without",
    [
        ("smollm3", "nope_layers", []),
        ("phi3", "partial_rotary_factor", 1.0),
        ("gemma3", "rope_local_theta", None),
        ("gemma3", "query_pre_attn_scalar", None),
        ("gemma3", "layer_types", None),
        ("gemma2", "attn_softcap", None),
        ("gemma2", "logit_softcap", None),
        ("gpt_oss", "layer_types", None),
        ("gpt_oss", "moe", "unclamped"),
        ("olmo3", "layer_types", None),
        ("olmo3", "rope_local_theta", None),
        ("llama4", "attention_chunk", 4096),  # chunks longer than the sequence: nothing cut
        ("llama4", "nope_layers", []),
        ("llama4", "qk_norm", None),
        ("llama4", "attn_temperature_floor", None),
        ("deepseek_v3", "rope_scaling", None),
        ("deepseek_v3", "moe", "unbiased"),
        ("deepseek_v3", "moe", "ungrouped"),
        ("deepseek_v3", "moe", "unshared"),
        ("deepseek_v2", "moe", "unscaled"),
    ],
)
@torch.no_grad()
def test_each_new_feature_is_computed(family, feature, without):
    """The parity above is not vacuous: each feature of the new families, turned off, changes the logits."""
    hf = build_hf(family)
    config, state = from_hf(hf)
    ids = torch.randint(0, VOCAB, (1, LENGTH))
    if without == "unclamped":  # GPT-OSS's experts with a plain SwiGLU
        without = dataclasses.replace(config.moe, swiglu_limit=None)
    states = [state, state]
    if isinstance(without, str) and without in DEEPSEEK_MOE_OFF:  # one DeepSeekMoE feature off, weights kept
        without, states[1] = DEEPSEEK_MOE_OFF[without](config, state)
    logits = []
    for variant, weights in zip((config, dataclasses.replace(config, **{feature: without})), states, strict=True):
        model = GPT(variant).eval()
        model.load_state_dict(weights, strict=True)
        logits.append(model(ids))
    assert max_diff(logits[0], hf(ids).logits) <= ATOL and max_diff(*logits) > 1e-3


def _unbiased(config, state):
    return config.moe, {k: torch.zeros_like(v) if "e_score" in k else v for k, v in state.items()}


def _unshared(config, state):
    return dataclasses.replace(config.moe, n_shared_experts=0), {k: v for k, v in state.items() if "shared" not in k}


DEEPSEEK_MOE_OFF = {
    "unbiased": _unbiased,
    "ungrouped": lambda config, state: (dataclasses.replace(config.moe, n_group=1, topk_group=1), state),
    "unshared": _unshared,
    "unscaled": lambda config, state: (dataclasses.replace(config.moe, routed_scaling_factor=1.0), state),
}


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, YARN_ROPE, LINEAR_ROPE], ids=lambda r: r["rope_type"])
def test_rope_scaling_equals_transformers_inverse_frequencies(rope):
    hf_config = transformers.LlamaConfig(**(SMALL | dict(head_dim=64, rope_parameters=rope)))
    config, _ = from_hf(transformers.LlamaForCausalLM(hf_config))
    inv_freq, scale = inverse_frequencies(config, torch.device("cpu"))
    theirs, their_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    assert torch.equal(inv_freq, theirs) and scale == their_scale
    unscaled = dataclasses.replace(config, rope_scaling=None)
    assert not torch.equal(inv_freq, inverse_frequencies(unscaled, torch.device("cpu"))[0])


# --- issue 50: longrope ---


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_equals_transformers_inverse_frequencies(long):
    """Both factor sets and the attention factor, derived from max_position_embeddings / original (Phi-3's way)."""
    features = dict(rope_parameters=LONGROPE, original_max_position_embeddings=16, pad_token_id=None)
    hf_config = transformers.Phi3Config(**(SMALL | features))
    config, _ = from_hf(transformers.Phi3ForCausalLM(hf_config))
    assert config.rope_scaling.factor == 4.0  # 64 / 16, written out on export
    inv_freq, scale = inverse_frequencies(config, torch.device("cpu"), long=long)
    theirs, their_scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=17 if long else 16)
    assert torch.equal(inv_freq, theirs) and scale == their_scale and scale > 1.0


@torch.no_grad()
def test_longrope_takes_the_short_factors_within_the_original_length():
    """12 tokens (within original_max_position_embeddings 16): the short factors, as transformers; the 48 tokens of the
    parity test above took the long ones. Either set swapped for the other changes the logits."""
    hf = build_hf("phi3-longrope")
    config, state = from_hf(hf)
    ours = GPT(config).eval()
    ours.load_state_dict(state, strict=True)
    for length in (12, LENGTH):
        ids = torch.randint(0, VOCAB, (2, length))
        assert max_diff(ours(ids), hf(ids).logits) <= ATOL
        s = config.rope_scaling
        swapped = dataclasses.replace(s, long_factor=s.short_factor, short_factor=s.long_factor)
        other = GPT(dataclasses.replace(config, rope_scaling=swapped)).eval()
        other.load_state_dict(state, strict=True)
        assert max_diff(other(ids), hf(ids).logits) > 1e-3


def test_llama4_moe_is_refused_on_every_path_that_reads_a_model(tmp_path, capsys):
    """Llama 4's MoE (sigmoid-scaled expert inputs beside a shared expert) is not computed: a config with MoE layers
    (Scout: every block) is refused by name whether imported, continued, evaluated or sampled from."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.commands.cli import main as cli
    from dstrain.model.hf import architecture_from_hf

    config_class, features = FAMILIES["llama4"]
    torch.manual_seed(0)
    transformers.Llama4ForCausalLM(config_class(**(SMALL | features | dict(moe_layers=[1])))).save_pretrained(tmp_path)
    for read in (from_hf, architecture_from_hf, load_model_source):
        with pytest.raises(DstrainError, match=r"config.json: moe_layers=\[1\] is not supported: Llama 4's mixture"):
            read(tmp_path)
    capsys.readouterr()
    assert cli(["generate", str(tmp_path), "--prompt", "a"]) == 2
    assert cli(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("moe_layers=[1] is not supported") == 2


def test_unsupported_family_features_are_named():
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(DstrainError, match="rope_type='dynamic'"):
        from_hf(transformers.LlamaForCausalLM(transformers.LlamaConfig(**(SMALL | dict(rope_parameters=dynamic)))))
    sliding = transformers.Qwen3MoeConfig(**(SMALL | dict(use_sliding_window=True, sliding_window=8)))
    with pytest.raises(DstrainError, match="use_sliding_window=True"):  # Qwen3-MoE windows every block: not converted
        from_hf(transformers.Qwen3MoeForCausalLM(sliding))
    config, state = from_hf(build_hf("qwen3"))
    config.family = "llama"
    with pytest.raises(DstrainError, match="model.qk_norm='head' has no counterpart in LlamaForCausalLM"):
        to_hf(config, state)


def test_a_feature_dstrain_does_not_compute_is_refused_on_every_path_that_reads_a_model(tmp_path, capsys):
    """The defect class of issue 39 (a Mistral window once imported and computed as full attention): every key of a
    transformers config either converts, computes nothing (NEUTRAL) or is refused in one line, whether the folder is
    imported, continued (init_from), evaluated or sampled from."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.commands.cli import main as cli
    from dstrain.model.hf import architecture_from_hf

    hf_config = transformers.LlamaConfig(**(SMALL | dict(mlp_bias=True)))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path)
    expected = f"{tmp_path / 'config.json'}: mlp_bias=True is not supported"
    for read in (from_hf, architecture_from_hf, load_model_source):
        with pytest.raises(DstrainError, match=expected):
            read(tmp_path)
    capsys.readouterr()
    assert cli(["generate", str(tmp_path), "--prompt", "a"]) == 2
    assert cli(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("mlp_bias=True is not supported") == 2
    from dstrain.model.family_configs import check_round_trip

    mistral = transformers.MistralConfig(**(SMALL | dict(sliding_window=16)))  # no layer_types: its window compared
    with pytest.raises(DstrainError, match="sliding_window=16 is not supported; dstrain computes this family with"):
        check_round_trip(mistral, transformers.MistralConfig(**(SMALL | dict(sliding_window=None))), "x")
    config, state = from_hf(build_hf("llama3"))
    with pytest.raises(DstrainError, match=r"model: nope_layers=\[1\] has no counterpart in LlamaForCausalLM"):
        to_hf(dataclasses.replace(config, nope_layers=[1]), state)  # export: what the class cannot express


# DeepSeek's published sizes: (config.json values written out, total parameters, active per token without the
# embedding), as their model cards round them.
DEEPSEEK_V3_PUBLISHED = dict(  # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    flavour="llama",
    family="deepseek_v3",
    vocab_size=129280,
    d_model=7168,
    d_ff=18432,
    n_layer=61,
    n_head=128,
    mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    moe=dict(num_experts=256, top_k=8, d_expert=2048, n_shared_experts=1, dense_layers=[0, 1, 2], scoring="sigmoid"),
)


def test_deepseek_parameter_counts_equal_the_published_sizes():
    """num_params (what estimate, plan and 6·N·T read) equals transformers' own model of the shipped V2-Lite recipe
    on the meta device, and the model cards' sizes: V2-Lite 15.7B (2.4B active), V3 671B (37B active), GLM-4.5-Air
    106B (12B active)."""
    from dstrain.model.config import GPTConfig
    from dstrain.model.counts import num_params
    from dstrain.model.family_configs import hf_config
    from dstrain.recipe_file import load_recipe

    lite = load_recipe(os.path.join(os.path.dirname(__file__), "..", "recipes", "continue-deepseek-v2-lite.yaml"))
    with torch.device("meta"):
        theirs = transformers.DeepseekV2ForCausalLM(hf_config(lite.model, None, None))
    assert num_params(lite.model) == sum(p.numel() for p in theirs.parameters())
    embedding = lite.model.vocab_size * lite.model.d_model
    assert round(num_params(lite.model) / 1e9, 1) == 15.7
    assert 2.4e9 <= num_params(lite.model, active=True) - embedding < 2.5e9  # "2.4B activated"
    air = load_recipe(os.path.join(os.path.dirname(__file__), "..", "recipes", "continue-glm-4.5-air.yaml")).model
    assert int(num_params(air) / 1e9) == 106  # "106B total" (without its multi-token-prediction layer)
    assert int((num_params(air, active=True) - air.vocab_size * air.d_model) / 1e9) == 12  # "12B active"
    v3 = GPTConfig.from_dict(DEEPSEEK_V3_PUBLISHED)
    assert round(num_params(v3) / 1e9) == 671
    assert round((num_params(v3, active=True) - v3.vocab_size * v3.d_model) / 1e9) == 37


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("deepseek_v3", dict(attention_bias=True), "attention_bias=True"),
        ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=True"),  # transformers' V2 router ignores it
        ("deepseek_v2", dict(topk_method="noaux_tc"), "n_group=4"),  # V2's class computes no such routing
    ],
)
def test_deepseek_features_dstrain_does_not_compute_are_refused_by_name(family, change, named):
    from dstrain.model.family_configs import config_from_hf

    config_class, features = FAMILIES[family]
    with pytest.raises(DstrainError, match=f"x: {named} is not supported"):
        config_from_hf(config_class(**(SMALL | features | change)), family, "x")
