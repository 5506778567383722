"""Sequence tiling of the loss and the MLPs (ds_config "tiling"): the same loss and gradients as the untiled model,
with less tensor memory. The figures at seq 8192: bench/bench_tiling.py, in BENCHMARKS.md; under ZeRO-3 and
sequence parallelism on 2 ranks: tests/test_sequence.py."""

import pytest
import torch

from dstrain.metrics import peak_tensor_bytes
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import GPT, lm_loss
from dstrain.train.engine import tiling


def forward_backward(
    flavour: str,
    seq: int,
    loss_tiles: int,
    mlp_tiles: int,
    measure: bool = False,
    masked: bool = False,
    softcap: float | None = None,
):
    """(loss, gradients by name, peak tensor bytes or None) of one step of a fresh seeded model; ``masked``: a third
    of the labels -100 (SFT's prompt tokens), including a whole tile's; ``softcap``: model.logit_softcap."""
    torch.manual_seed(0)
    config = GPTConfig(
        flavour=flavour, vocab_size=512, max_seq_len=seq, n_layer=2, n_head=4, d_model=64, logit_softcap=softcap
    )
    model = GPT(config)
    if mlp_tiles > 1:
        tiling.tile_mlps(model, mlp_tiles)
    ids = torch.randint(0, 512, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    if masked:
        labels[:, : seq // 4] = -100  # the first tile of 4 learns nothing
        labels[0, seq // 2 : seq // 2 + seq // 12] = -100
    losses = []

    def step():
        if loss_tiles > 1:
            loss = tiling.mean_loss(model.lm_head, model(inputs, head=False), labels, loss_tiles)
        else:
            loss = lm_loss(model(inputs), labels)
        (loss * 0.5).backward()  # a factor after the loss (1 / accumulation steps) reaches every gradient
        losses.append(loss.detach())

    peak = peak_tensor_bytes(step, "cpu") if measure else step()
    return losses[0], {n: p.grad for n, p in model.named_parameters()}, peak


@pytest.mark.parametrize(
    "flavour, masked, softcap",  # untied and tied heads; Gemma 2's logit soft cap (llama only) at 0.1, under most
    [("llama", False, None), ("llama", True, None), ("gpt2", False, None), ("gpt2", True, None), ("llama", True, 0.1)],
)
def test_tiled_loss_and_mlp_give_the_same_loss_and_gradients(flavour, masked, softcap):
    """The chunked loss (head gradients formed in its forward, model/chunked_loss.py) and the tiled MLP against the
    whole loss: losses and every gradient within 1e-6 (fp32), a factor after the loss (0.5) reaching both."""
    loss, grads, _ = forward_backward(flavour, 96, 1, 1, masked=masked, softcap=softcap)
    for loss_tiles, mlp_tiles in [(4, 1), (1, 3), (8, 4)]:
        tiled_loss, tiled_grads, _ = forward_backward(flavour, 96, loss_tiles, mlp_tiles, False, masked, softcap)
        assert abs(tiled_loss - loss) <= 1e-6 * loss
        for name, grad in grads.items():
            # + 1e-10: gpt2's key bias has a zero gradient in exact arithmetic (softmax ignores a shift of every
            # score of a query); what it holds is rounding noise near 1e-12, which no summation order keeps.
            assert (tiled_grads[name] - grad).abs().max() <= 1e-6 * grad.abs().max() + 1e-10, name


def test_tiling_lowers_the_peak_tensor_memory():
    """Measured at seq 256 (a 512-entry vocabulary, d_model 64, batch 2): 0.44x of the untiled peak, 8 tiles each."""
    _, _, plain = forward_backward("llama", 256, 1, 1, measure=True)
    _, _, tiled = forward_backward("llama", 256, 8, 8, measure=True)
    assert tiled < 0.6 * plain


def test_task_scorer_by_chunks_gives_the_whole_logits_statistics():
    """The downstream-task scorer's head applied chunk by chunk (a run with a chunked loss): the same summed
    log-likelihoods and argmax misses as from the whole logits, for chunks that do not divide the length too."""
    from dstrain.tasks.scoring import continuation_stats, tiled_continuation_stats

    torch.manual_seed(0)
    model = GPT(GPTConfig(flavour="llama", vocab_size=512, max_seq_len=40, n_layer=1, n_head=4, d_model=64))
    ids = torch.randint(0, 512, (3, 40))
    targets = torch.randint(0, 512, (3, 40))
    targets[:, :25] = -100  # the context is not scored
    with torch.no_grad():
        whole = continuation_stats(model(ids), targets)
        for tiles in (4, 3):
            chunked = tiled_continuation_stats(model.lm_head, model(ids, head=False), targets, tiles)
            assert torch.allclose(chunked, whole, rtol=1e-6, atol=0), tiles
