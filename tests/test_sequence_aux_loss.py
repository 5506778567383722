"""DeepSeek-V3's sequence-wise auxiliary loss (model.moe.aux_loss_kind: sequence; DeepSeek-V3 §2.1.2, eq. 17-20):
the router's loss equals a plain loop over the paper's formula (1e-6), and training gives the same losses, router
losses and pre-clip gradient norms whether a rank's 4 samples are one micro-batch or two (2 gloo ranks, fp32)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dstrain.model.config import GPTConfig, MoEConfig  # noqa: E402
from dstrain.model.gpt import GPT  # noqa: E402
from dstrain.model.moe import moe_routers  # noqa: E402

DEEPSEEK_MOE = {"num_experts": 4, "top_k": 2, "scoring": "sigmoid", "router_fp32": True, "n_shared_experts": 1}
DEEPSEEK_MOE |= {"routed_scaling_factor": 2.0, "aux_loss_kind": "sequence", "aux_loss_coef": 0.1}


def paper_sequence_loss(x: torch.Tensor, router: torch.nn.Module, samples: int) -> float:
    """Eq. 17-20 by loops: per sample, f_i = N_r/(K_r T) * #tokens choosing i (top-K_r of the biased sigmoid
    scores), P_i = 1/T * sum_t s'_{i,t} (the sigmoid scores normalised over the experts); sum_i f_i P_i, averaged
    over the samples (DeepSeek-V2's published MoEGate with seq_aux averages over its batch's samples the same way)."""
    x = x.double().view(samples, -1, x.shape[-1])
    scores = (x @ router.wg.weight.double().t()).sigmoid()
    choice = scores + router.e_score_correction_bias.double()
    n_r, k_r, length = scores.shape[-1], router.top_k, x.shape[1]
    total = 0.0
    for b in range(samples):
        for i in range(n_r):
            chosen = sum(int(i in choice[b, t].topk(k_r).indices.tolist()) for t in range(length))
            f = n_r / (k_r * length) * chosen
            p = sum((scores[b, t, i] / scores[b, t].sum()).item() for t in range(length)) / length
            total += f * p
    return total / samples


def test_the_sequence_wise_loss_is_the_papers_formula():
    config = GPTConfig(
        flavour="llama", vocab_size=97, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
        moe=MoEConfig(**DEEPSEEK_MOE),
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    router = moe_routers(model)[0]
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.01]))  # the choice takes it
    seen = []
    router.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    model(torch.randint(0, 97, (3, 16)))
    expected = paper_sequence_loss(seen[0], router, 3)
    assert router.aux_loss.item() == pytest.approx(expected, abs=1e-6)
    batch_wise = paper_sequence_loss(seen[0], router, 1)  # one "sample" of 48 tokens: another value
    assert abs(batch_wise - expected) > 1e-4
    router.aux_loss.backward()  # P carries the gradient into the router
    assert router.wg.weight.grad is not None and router.wg.weight.grad.abs().sum() > 0


@pytest.mark.distributed
def test_the_sequence_wise_loss_is_independent_of_the_micro_batch_split(tmp_path, corpus):
    from test_moe import run_all

    from ranks import run_ranks
    from train_helpers import ds_config, read_metrics, small_recipe, train_argv

    recipe = small_recipe(tmp_path, corpus, name="seqaux", model={"moe": DEEPSEEK_MOE})
    layouts = {
        "one": ds_config(tmp_path, "zero1"),
        "two": ds_config(tmp_path, "zero1", train_micro_batch_size_per_gpu=2),
    }
    runs = {name: tmp_path / name for name in layouts}
    calls = [("train", [train_argv(recipe, config, runs[name])]) for name, config in layouts.items()]
    assert run_ranks(2, run_all, calls) == [[0, 0]] * 2
    one, two = ([r for r in read_metrics(runs[n]) if "split" not in r] for n in layouts)
    assert len(one) == len(two) == 10
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5), key
    assert all(0.5 < r["moe_aux_loss"] < 2.0 for r in one)  # 1 when balanced; logged as the batch-wise one is
