"""Behaviour of dstrain.model.gpt: shapes, masking, parameter accounting, initialisation, checkpointing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.model.counts import flops_per_token, num_params
from dstrain.model.gpt import GPT, Block, Embedding, lm_loss

from ranks import free_port

VOCAB = 97


def small(flavour: str, **overrides) -> GPTConfig:
    fields = dict(flavour=flavour, vocab_size=VOCAB, max_seq_len=32, n_layer=2, n_head=4, d_model=32)
    if flavour == "llama":
        fields["n_kv_head"] = 2
    return GPTConfig(**{**fields, **overrides})


def build(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def real_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


@pytest.fixture(params=["gpt2", "llama"])
def flavour(request) -> str:
    return request.param


def test_module_structure_and_logit_shape(flavour):
    config = small(flavour)
    model = build(config).eval()
    assert isinstance(model.embed, Embedding) and (model.embed.pos is not None) == (flavour == "gpt2")
    assert len(model.blocks) == config.n_layer and all(isinstance(b, Block) for b in model.blocks)
    assert isinstance(model.lm_head, torch.nn.Linear)
    names = {n for n, _ in model.named_parameters()}
    for proj in [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ] + (["mlp.gate_proj"] if flavour == "llama" else []):
        assert f"blocks.1.{proj}.weight" in names
    ids = torch.randint(0, VOCAB, (3, 11))
    logits = model(ids)
    assert logits.shape == (3, 11, VOCAB)
    # a block maps (x, position_ids) -> x of the same shape, as a pipeline stage needs
    x = model.embed(ids)
    assert model.blocks[0](x, torch.arange(11).expand(3, 11)).shape == x.shape
    loss = lm_loss(logits, ids)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert abs(loss.item() - math.log(VOCAB)) < 0.5  # small init: close to uniform


def test_lm_loss_ignores_minus_100():
    logits = torch.randn(2, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 5))
    masked = labels.clone()
    masked[:, 3:] = -100
    expected = torch.nn.functional.cross_entropy(logits[:, :3].reshape(-1, VOCAB), labels[:, :3].reshape(-1))
    torch.testing.assert_close(lm_loss(logits, masked), expected, rtol=0, atol=1e-6)


def test_causality(flavour):
    model = build(small(flavour)).eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :9], before[:, :9], rtol=0, atol=1e-6)
    assert (after[:, 9:] - before[:, 9:]).abs().max() > 1e-3  # the change is visible from position 9 on


def test_doc_masking_equals_separate_documents(flavour):
    lengths = [5, 8, 3]
    model = build(small(flavour, doc_masking=True)).eval()
    ids = torch.randint(0, VOCAB, (2, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    with torch.no_grad():
        packed = model(ids, position_ids)
        separate = torch.cat([model(doc) for doc in ids.split(lengths, dim=1)], dim=1)
        model.config.doc_masking = False
        unmasked = model(ids, position_ids)
    torch.testing.assert_close(packed, separate, rtol=0, atol=1e-5)
    assert (unmasked - separate).abs().max() > 1e-3  # without the mask, later documents see earlier ones


def test_gqa_runs_and_saves_the_computed_parameters():
    mha, gqa = small("llama", n_kv_head=None), small("llama", n_kv_head=1)
    model = build(gqa).eval()
    assert model(torch.randint(0, VOCAB, (2, 7))).shape == (2, 7, VOCAB)
    assert model.blocks[0].self_attn.k_proj.weight.shape == (gqa.head_dim, gqa.d_model)
    saved_per_layer = 2 * gqa.d_model * (gqa.n_head - 1) * gqa.head_dim  # k_proj and v_proj lose 3 of 4 heads
    assert num_params(mha) - num_params(gqa) == gqa.n_layer * saved_per_layer
    assert real_count(build(mha)) - real_count(model) == gqa.n_layer * saved_per_layer


def test_tied_and_untied_embeddings(flavour):
    tied, untied = build(small(flavour, tie_embeddings=True)), build(small(flavour, tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed.tok.weight
    assert untied.lm_head.weight is not untied.embed.tok.weight
    assert real_count(untied) - real_count(tied) == VOCAB * 32
    # the tied head keeps the embedding's init (a separate head init would have overwritten it)
    assert abs(tied.embed.tok.weight.std().item() - 0.02) < 0.002
    lm_loss(tied(torch.randint(0, VOCAB, (1, 6))), torch.randint(0, VOCAB, (1, 6))).backward()
    assert tied.embed.tok.weight.grad is tied.lm_head.weight.grad
    assert GPTConfig(flavour="gpt2").tied and not GPTConfig(flavour="llama").tied


@pytest.mark.parametrize("tie", [True, False])
def test_num_params_matches_the_model(flavour, tie):
    config = small(flavour, tie_embeddings=tie, d_ff=48)
    model = build(config)
    assert num_params(config) == real_count(model)
    tables = [model.embed.tok] + ([model.embed.pos] if flavour == "gpt2" else [])
    assert num_params(config, exclude_embeddings=True) == real_count(model) - sum(t.weight.numel() for t in tables)


def test_num_params_and_d_ff_match_published_models():
    gpt2_small = GPTConfig(flavour="gpt2", vocab_size=50257, max_seq_len=1024, n_layer=12, n_head=12, d_model=768)
    assert num_params(gpt2_small) == 124_439_808  # HF GPT2LMHeadModel("gpt2")
    llama2_7b = GPTConfig(
        flavour="llama", vocab_size=32000, max_seq_len=4096, n_layer=32, n_head=32, d_model=4096, d_ff=11008
    )
    assert num_params(llama2_7b) == 6_738_415_616  # Llama-2-7b-hf
    # 6N + 12 L d T with N = non-embedding params + the logits projection (tied or not)
    n = num_params(gpt2_small, exclude_embeddings=True) + 50257 * 768
    assert flops_per_token(gpt2_small, 1024) == 6 * n + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("d_model", [768, 1040, 4096])
def test_default_d_ff(d_model):
    assert GPTConfig(flavour="gpt2", d_model=d_model, n_head=8).ff_dim == 4 * d_model
    ff = GPTConfig(flavour="llama", d_model=d_model, n_head=8).ff_dim
    assert ff % 64 == 0 and ff - 64 < 8 * d_model / 3 <= ff  # 8/3 d rounded up to a multiple of 64


def test_init_statistics(flavour):
    config = small(flavour, d_model=256, n_head=8, n_layer=4, vocab_size=512, n_kv_head=None, tie_embeddings=False)
    model = build(config)
    scaled = config.init_std / math.sqrt(2 * config.n_layer)
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert abs(p.std().item() / scaled - 1) < 0.03, name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.std().item() / config.init_std - 1) < 0.03, name
            assert abs(p.mean().item()) < 1e-3, name


def test_activation_checkpointing_same_loss_and_grads(flavour):
    """The hook the trainer applies DeepSpeed's activation checkpointing through (when the ds_config asks for it)."""
    import deepspeed

    config = small(flavour, doc_masking=True)
    plain, checkpointed = build(config), build(config)
    checkpointed.checkpoint_fn = deepspeed.checkpointing.checkpoint
    ids, labels = torch.randint(0, VOCAB, (2, 12)), torch.randint(0, VOCAB, (2, 12))
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1)
    losses = []
    for model in (plain, checkpointed):
        loss = lm_loss(model(ids, position_ids), labels)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(flavour="mamba"), "model.flavour"),
        (dict(n_head=6), "model.n_head"),
        (dict(flavour="llama", n_kv_head=3), "model.n_kv_head"),
        (dict(flavour="gpt2", n_kv_head=2), "model.n_kv_head"),
    ],
)
def test_bad_config_raises_one_line_error(overrides, key):
    with pytest.raises(DstrainError) as error:
        GPTConfig(**{"d_model": 40, "n_head": 4, **overrides})
    assert str(error.value).startswith(key) and "\n" not in str(error.value)


ZERO_INIT_SCRIPT = textwrap.dedent("""
    import sys, torch, deepspeed
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for flavour in ("gpt2", "llama"):
        config = GPTConfig(flavour=flavour, vocab_size=97, max_seq_len=32, n_layer=2, n_head=4, d_model=32,
                           n_kv_head=2 if flavour == "llama" else None)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
            model = GPT(config)
        partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[flavour] = {"partitioned": partitioned, "params": params,
                        "tied": model.lm_head.weight is model.embed.tok.weight}
    torch.save(out, sys.argv[1])
""")


@pytest.mark.distributed
def test_init_under_zero3_equals_plain_init(tmp_path):
    """Every parameter is initialised inside its owning constructor, so ZeRO-3 partitioning keeps it."""
    # A subprocess keeps the gloo process group out of the other tests.
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "OMP_NUM_THREADS": "1",
    }
    result_path = tmp_path / "zero3_params.pt"
    run = subprocess.run(
        [sys.executable, "-c", ZERO_INIT_SCRIPT, str(result_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(result_path)
    for flavour in ("gpt2", "llama"):
        zero3 = result[flavour]
        assert zero3["partitioned"], "zero.Init did not partition the parameters; the test would prove nothing"
        assert zero3["tied"] == (flavour == "gpt2")
        plain = dict(build(small(flavour)).named_parameters())
        assert zero3["params"].keys() == plain.keys()
        for name, p in plain.items():
            assert torch.equal(zero3["params"][name], p.detach()), f"{flavour} {name} differs under zero.Init"
