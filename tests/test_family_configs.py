"""What the conversion of a published family computes and refuses: RoPE's inverse frequencies as transformers' (every
scaling, longrope's short and long factors), the published parameter counts, and every feature dstrain does not
compute refused by name on every path that reads a model (the families' fixtures: tests/family_fixtures.py)."""

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
from dstrain.model.hf.convert import from_hf, to_hf  # noqa: E402
from dstrain.model.rope import inverse_frequencies  # noqa: E402

from family_fixtures import (  # noqa: E402
    ATOL,
    FAMILIES,
    LENGTH,
    LINEAR_ROPE,
    LLAMA3_ROPE,
    LONGROPE,
    SMALL,
    VOCAB,
    YARN_ROPE,
    build_hf,
    max_diff,
)


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


def test_llama4_moe_beyond_top_1_is_refused_on_every_path_that_reads_a_model(tmp_path, capsys):
    """Llama 4's MoE is computed top-1 (its published models; the score scales the one chosen expert's input): a
    config routing each token to 2 experts is refused by name whether imported, continued, evaluated or sampled from;
    the same config top-1 reads."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.commands.cli import main as cli
    from dstrain.model.hf.convert import architecture_from_hf

    config_class, features = FAMILIES["llama4_moe"]
    torch.manual_seed(0)
    top_2 = config_class(**(SMALL | features | dict(num_experts_per_tok=2)))
    transformers.Llama4ForCausalLM(top_2).save_pretrained(tmp_path)
    for read in (from_hf, architecture_from_hf, load_model_source):
        with pytest.raises(DstrainError, match=r"config.json: num_experts_per_tok=2 is not supported: dstrain"):
            read(tmp_path)
    capsys.readouterr()
    assert cli(["generate", str(tmp_path), "--prompt", "a"]) == 2
    assert cli(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("num_experts_per_tok=2 is not supported") == 2
    top_1 = from_hf(transformers.Llama4ForCausalLM(config_class(**(SMALL | features))))[0]
    assert top_1.moe is not None and top_1.moe.input_scaling and top_1.n_moe_layers == 2


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
    from dstrain.model.hf.convert import architecture_from_hf

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
    from dstrain.model.hf.family_configs import check_round_trip

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
    from dstrain.model.hf.family_configs import hf_config
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
    from dstrain.model.hf.family_configs import config_from_hf

    config_class, features = FAMILIES[family]
    with pytest.raises(DstrainError, match=f"x: {named} is not supported"):
        config_from_hf(config_class(**(SMALL | features | change)), family, "x")
