"""dstrain.model.generate: decoding with our KV cache is transformers' greedy generate token for token (gpt2, llama
with GQA), keeps the log-probs the trainer computes for the same tokens, and samples what a row's seed says whatever
the other rows of the batch."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dstrain.errors import DstrainError  # noqa: E402
from dstrain.model.config import GPTConfig  # noqa: E402
from dstrain.model.generate import Sampling, decode, filtered_logits, sample_seed, token_logprobs  # noqa: E402
from dstrain.model.gpt import GPT  # noqa: E402
from dstrain.model.hf.convert import to_hf  # noqa: E402

VOCAB = 101
CONFIGS = {
    "gpt2": GPTConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=48, n_layer=2, n_head=4, n_kv_head=4, d_model=32,
                      d_ff=128, tie_embeddings=True, norm_eps=1e-5, init_std=0.2),
    "llama": GPTConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=48, n_layer=2, n_head=4, n_kv_head=2,
                       d_model=32, d_ff=96, tie_embeddings=False, norm_eps=1e-6, rope_theta=500.0, init_std=0.2),
}  # fmt: skip
HF_CLASSES = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}
PROMPTS = [[5, 17, 3, 44, 9, 12, 60], [7, 2], [88, 31, 4, 19]]  # different lengths: left padding matters


@pytest.fixture(params=["gpt2", "llama"])
def models(request):
    """(our model, transformers' model of the same weights), both fp32 and in eval mode."""
    torch.manual_seed(0)
    ours = GPT(dataclasses.replace(CONFIGS[request.param])).eval()
    with torch.no_grad():  # norms and biases away from their initial values, so a dropped one would show
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf_config, hf_state = to_hf(ours.config, ours.state_dict(), bos_token_id=0, eos_token_id=1)
    hf = HF_CLASSES[request.param](hf_config).eval()
    hf.load_state_dict(hf_state, strict=True)
    return ours, hf


def test_greedy_equals_transformers_generate(models):
    ours, hf = models
    free = decode(ours, PROMPTS, Sampling(max_new_tokens=12, temperature=0), stop_ids=[], pad_id=0)
    eos = free.tokens[0, 4].item()  # a token row 0 emits: its stop is exercised
    ours_out = decode(ours, PROMPTS, Sampling(max_new_tokens=12, temperature=0), stop_ids=[eos], pad_id=0)
    assert ours_out.stopped[0] and ours_out.completion(0)[-1] == eos
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)  # fmt: skip
        assert ours_out.completion(row) == out[0, len(prompt) :].tolist(), row
    assert ours_out.mask.sum(1).tolist() == [len(ours_out.completion(r)) for r in range(len(PROMPTS))]


@pytest.mark.parametrize("sampling", [Sampling(10, 1.0), Sampling(10, 0.7, top_k=20, top_p=0.9)])
def test_sampled_logprobs_are_the_trainers(models, sampling):
    ours, _ = models
    seeds = [sample_seed(3, 1, i, 0) for i in range(len(PROMPTS))]
    out = decode(ours, PROMPTS, sampling, stop_ids=[1], pad_id=0, seeds=seeds)
    for row, prompt in enumerate(PROMPTS):
        completion = out.completion(row)
        full = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = ours(full)[0, len(prompt) - 1 : -1]  # the trainer's forward: one unpadded sequence
        trainer = token_logprobs(logits, torch.tensor(completion), sampling.logprob_temperature)
        torch.testing.assert_close(out.logprobs[row][out.mask[row]], trainer, rtol=0, atol=1e-5)


def test_samples_do_not_depend_on_the_batch(models):
    ours, _ = models
    sampling = Sampling(10, 1.0, top_k=30)
    seeds = [sample_seed(0, 2, i, 1) for i in range(len(PROMPTS))]
    together = decode(ours, PROMPTS, sampling, stop_ids=[1], pad_id=0, seeds=seeds)
    for row in range(len(PROMPTS)):
        alone = decode(ours, [PROMPTS[row]], sampling, stop_ids=[1], pad_id=0, seeds=[seeds[row]])
        assert alone.completion(0) == together.completion(row)
    reordered = decode(ours, PROMPTS[::-1], sampling, stop_ids=[1], pad_id=0, seeds=seeds[::-1])
    assert [reordered.completion(r) for r in range(3)][::-1] == [together.completion(r) for r in range(3)]
    other = decode(ours, PROMPTS, sampling, stop_ids=[1], pad_id=0, seeds=[s + 1 for s in seeds])
    assert [other.completion(r) for r in range(3)] != [together.completion(r) for r in range(3)]


def test_top_k_top_p_are_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    sampling = Sampling(1, 0.8, top_k=25, top_p=0.7)
    expected = TopPLogitsWarper(0.7)(None, TopKLogitsWarper(25)(None, TemperatureLogitsWarper(0.8)(None, logits)))
    assert torch.equal(torch.isinf(filtered_logits(logits, sampling)), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    torch.testing.assert_close(filtered_logits(logits, sampling)[kept], expected[kept], rtol=0, atol=0)


def test_truncation_and_position_limit(models):
    ours, _ = models
    out = decode(ours, PROMPTS, Sampling(max_new_tokens=3, temperature=0), stop_ids=[], pad_id=0)
    assert out.tokens.shape == (3, 3) and not out.stopped.any() and out.mask.all()
    if ours.config.flavour == "llama":  # RoPE has no position table: no limit to check
        return
    with pytest.raises(DstrainError, match="exceeds the model's 48 positions"):
        decode(ours, PROMPTS, Sampling(max_new_tokens=42, temperature=0), stop_ids=[], pad_id=0)


def test_refused_model_features_named():
    config = dataclasses.replace(CONFIGS["llama"], attn_softcap=30.0)
    with pytest.raises(DstrainError, match="attn_softcap"):
        decode(GPT(config), PROMPTS, Sampling(4, 0.0), stop_ids=[], pad_id=0)
