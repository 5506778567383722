"""LoRA on the preference objective (issue 56 §1): DPO with adapters on a published base under ZeRO-0 and ZeRO-3 on
2 ranks (fp32). The adapters start at B = 0, so the first step's policy is its reference (sigmoid: ln 2); the two
strategies give the same losses and pre-clip gradient norms; the base stays the reference, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dstrain.data.chat_corpus import write_pair_corpus
from dstrain.data.prepare import prepare

from ranks import run_ranks
from train_helpers import ROOT, ds_config, read_metrics, small_recipe, train_argv, train_each

pytestmark = pytest.mark.distributed

TEMPLATE = ROOT / "recipes" / "chat_templates" / "role-lines.jinja"
RTOL = 1e-5  # as tests/test_preference_training.py: the strategies reorder the same fp32 sums


@pytest.fixture(scope="module")
def dpo_lora_runs(tmp_path_factory, corpus):
    from dstrain.data.manifest import read_manifest
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model

    tmp = tmp_path_factory.mktemp("dpo_lora")
    assert write_pair_corpus(tmp / "pairs.jsonl", max_examples=64) >= 60
    pairs = tmp / "pairs"
    prepare(
        str(tmp / "pairs.jsonl"), str(pairs), tokenizer=str(corpus / "tokenizer"), chat=True,
        chat_template=str(TEMPLATE), num_proc=1, progress=False,
    )  # fmt: skip
    vocab = -(-read_manifest(pairs).vocab_size // 64) * 64
    config = GPTConfig(flavour="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=64, vocab_size=vocab)
    torch.manual_seed(3)
    to_hf_model(config, GPT(config).state_dict()).save_pretrained(tmp / "reference")
    recipe = small_recipe(
        tmp, pairs, name="dpo-lora", init_from=str(tmp / "reference"), preference={"loss": "sigmoid", "beta": 0.5},
        lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        data={"sources": [{"path": str(pairs)}], "seq_len": 128, "valid_fraction": 0.1, "sft": True},
        train={"global_batch": 8, "steps": 3, "log_interval": 1, "eval_samples": 8, "keep_last": 1},
        optim={"lr": 1e-2, "min_lr": 1e-3},
    )  # fmt: skip
    configs = {name: ds_config(tmp, name, train_micro_batch_size_per_gpu=4) for name in ("zero0", "zero3")}
    runs = {name: tmp / name for name in configs}
    assert run_ranks(2, train_each, [train_argv(recipe, configs[n], runs[n]) for n in configs]) == [[0, 0]] * 2
    return tmp, runs


def test_dpo_with_adapters_starts_at_ln2_and_zero3_equals_zero0(dpo_lora_runs):
    _, runs = dpo_lora_runs
    records = {n: [r for r in read_metrics(run) if "split" not in r and "loss" in r] for n, run in runs.items()}
    assert len(records["zero0"]) == len(records["zero3"]) == 3
    assert records["zero0"][0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # B = 0: the policy is the reference
    # the margins are differences of log-prob sums of hundreds (fp32 ulp ~3e-5 there): 1e-5 absolute (1e-6 seen)
    for key, atol in (("loss", 0.0), ("grad_norm", 0.0), ("rewards/margins", 1e-5)):
        want, got = ([r[key] for r in records[n]] for n in ("zero0", "zero3"))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=key)
    assert abs(records["zero0"][-1]["rewards/margins"]) > 1e-4  # the adapters moved the policy off its reference


def test_dpo_with_adapters_leaves_the_reference_base_bit_for_bit(dpo_lora_runs):
    from dstrain.adapters.lora import is_adapter
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.model.hf.convert import from_hf

    tmp, runs = dpo_lora_runs
    _, published = from_hf(tmp / "reference")
    for name, run in runs.items():
        recipe, tag = load_run(run, None)
        state = consolidated_state_dict(tag, recipe.model)
        base = {k: v for k, v in state.items() if not is_adapter(k)}
        assert base.keys() == published.keys(), name
        assert [k for k in base if not torch.equal(base[k], published[k])] == [], name
