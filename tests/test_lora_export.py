"""The adapter format users load (issue 56 §3): `dstrain export` of a lora: run trained under ZeRO-3 writes a PEFT
folder that PeftModel.from_pretrained loads on the Hugging Face base with dstrain's logits; --merge equals PEFT's
merge_and_unload; lora.init_from continues a PEFT adapter; the frozen base comes back bit for bit. The real peft."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dstrain.adapters.config import LoraConfig, adapter_params  # noqa: E402
from dstrain.errors import DstrainError  # noqa: E402

from family_fixtures import build_hf  # noqa: E402

ATOL = 1e-5  # fp32 logits, as every published-model parity test (tests/test_families.py)
LORA = {"rank": 4, "alpha": 8, "target_modules": ["all-linear"], "modules_to_save": ["lm_head"]}


def published_llama(folder, corpus) -> None:
    """A small random Llama on the corpus' tokenizer, saved as a published model is."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(corpus / "tokenizer")
    config = transformers.LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def our_model(config, state, lora: LoraConfig):
    """Our GPT with the adapters of ``lora`` holding ``state``'s values, in eval mode."""
    from dstrain.adapters.lora import inject
    from dstrain.model.gpt import GPT

    model = GPT(config)
    inject(model, config, lora, seed=0)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, corpus):
    """A lora: run on a published Llama, 3 steps under ZeRO-3 on 2 ranks; its adapter exported, and merged."""
    from dstrain.commands.cli import main as cli

    from ranks import run_ranks
    from train_helpers import small_recipe, train_argv, train_each

    tmp = tmp_path_factory.mktemp("lora_export")
    published_llama(tmp / "base", corpus)
    recipe = small_recipe(tmp, corpus, init_from=str(tmp / "base"), lora=LORA, train={"steps": 3})
    assert run_ranks(2, train_each, [train_argv(recipe, "zero3", tmp / "run")]) == [[0], [0]]
    assert cli(["export", str(tmp / "run"), "--out", str(tmp / "adapter")]) == 0
    assert cli(["export", str(tmp / "run"), "--merge", "--out", str(tmp / "merged")]) == 0
    return tmp


@pytest.mark.distributed
def test_peft_loads_the_zero3_adapter_with_our_logits(zero3_run):
    import peft
    from safetensors.torch import load_file

    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run

    recipe, tag = load_run(zero3_run / "run", None)
    state = consolidated_state_dict(tag, recipe.model)
    saved = load_file(zero3_run / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 2 + 1  # A and B of 7 projections in 2 blocks, and lm_head
    assert saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)  # whole
    config = json.loads((zero3_run / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")

    base = transformers.AutoModelForCausalLM.from_pretrained(zero3_run / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, zero3_run / "adapter").eval()
    ids = torch.randint(0, recipe.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = our_model(recipe.model, state, recipe.lora)
    with torch.no_grad():
        want, got = ours(ids), theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            plain = theirs(input_ids=ids).logits
    assert (got - plain).abs().max() > 1e-3  # the adapter changes the logits (it trained) ...
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)  # ... as it changed ours

    merged = transformers.AutoModelForCausalLM.from_pretrained(zero3_run / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        reference = theirs.merge_and_unload()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, reference, rtol=0, atol=ATOL)


@pytest.mark.distributed
def test_the_frozen_base_is_the_published_one_bit_for_bit(zero3_run):
    from dstrain.adapters.lora import is_adapter
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.model.hf.convert import from_hf

    recipe, tag = load_run(zero3_run / "run", None)
    state = consolidated_state_dict(tag, recipe.model)
    _, published = from_hf(zero3_run / "base")
    base = {k: v for k, v in state.items() if not is_adapter(k) and k != "lm_head.weight"}  # lm_head: saved, trains
    assert base.keys() == published.keys() - {"lm_head.weight"}
    assert [k for k in base if not torch.equal(base[k], published[k])] == []
    assert not torch.equal(state["lm_head.weight"], published["lm_head.weight"])  # modules_to_save trained


@pytest.mark.distributed
def test_lora_init_from_continues_the_exported_adapter(zero3_run):
    from dstrain.adapters.peft_format import load_adapter_into
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run

    recipe, tag = load_run(zero3_run / "run", None)
    state = consolidated_state_dict(tag, recipe.model)
    model = our_model(recipe.model, {k: torch.zeros_like(v) for k, v in state.items()}, recipe.lora)
    load_adapter_into(model, str(zero3_run / "adapter"), recipe, zero3=False)
    loaded = model.state_dict()
    assert [k for k in state if ".lora." in k and not torch.equal(loaded[k], state[k])] == []
    assert torch.equal(loaded["lm_head.weight"], state["lm_head.weight"])

    other = dataclasses.replace(recipe, init_from="/models/another-base")
    with pytest.raises(DstrainError, match=r"was trained on .*base, the recipe's init_from is /models/another-base"):
        load_adapter_into(model, str(zero3_run / "adapter"), other, zero3=False)
    wider = dataclasses.replace(recipe, lora=dataclasses.replace(recipe.lora, rank=8))
    with pytest.raises(DstrainError, match=r"has rank 4, the recipe's lora.rank is 8; set it to 4"):
        load_adapter_into(model, str(zero3_run / "adapter"), wider, zero3=False)


def family_recipe(config, lora: LoraConfig, init_from: str):
    from dstrain.config import DataConfig, Recipe, TrainConfig

    data = DataConfig(sources=[], seq_len=16)
    return Recipe("t", config, data, TrainConfig(global_batch=1, steps=1), lora=lora, init_from=init_from)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3", "olmo2", "llama4", "mistral"])
def test_adapters_of_other_families_load_in_peft_with_our_logits(tmp_path, family):
    """Every projection adapted, B drawn at random (a trained adapter's stand-in), written and loaded by PEFT."""
    import peft

    from dstrain.adapters.lora import inject
    from dstrain.adapters.peft_format import write_adapter_folder
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import from_hf

    hf = build_hf(family)
    config, state = from_hf(hf)
    lora = LoraConfig(rank=2, alpha=3.0, target_modules=["all-linear"], use_rslora=family == "qwen3")
    ours = GPT(config)
    inject(ours, config, lora, seed=1)
    missing = ours.load_state_dict(state, strict=False).missing_keys
    assert missing and all(".lora." in k for k in missing)
    trained = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert trained == adapter_params(lora, config) == sum(p.numel() for n, p in ours.named_parameters() if n in missing)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    ours.eval()
    write_adapter_folder(family_recipe(config, lora, None), ours.state_dict(), tmp_path / "a", torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "a").eval()
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids), rtol=0, atol=ATOL)
