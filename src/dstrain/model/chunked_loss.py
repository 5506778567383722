"""The chunked loss (ds_config ``"tiling": {"loss": n}``) with the head's gradients formed in its forward: fused
linear cross-entropy, the algorithm of Liger-Kernel's LigerFusedLinearCrossEntropyFunction, written in torch.

The head (d_model -> vocabulary) and the cross-entropy run over n chunks of the micro-batch's tokens. Each chunk's
logits exist only while that chunk is computed: its loss sum is added up and, while its logits are still there, the
gradient of that sum with respect to the hidden states (that chunk's rows) and the head's weight (accumulated in
fp32) is formed at once. Only those two gradients are kept for the backward, which scales them by the incoming
gradient (1 / accumulation steps, a loss scale, sequence parallelism's factor all reach both). So the chunked loss
runs the head's matmuls once, like the whole loss, and never holds the (tokens x vocabulary) logits of more than one
chunk. The whole loss's math, per chunk: soft-capped logits (model.logit_softcap, Gemma 2) in the model's dtype,
the cross-entropy in fp32, labels -100 not counted; the gradient is cast back to the model's dtype before the
soft cap's derivative, where autograd would cast it.

Not Liger itself: its Triton kernels run on CUDA only, and dstrain's tests and CPU runs (gloo) need the same
function; it is not a dependency. Not DeepSpeed's TiledFusedLogitsLoss either: it forms the head's gradient with an
incoming gradient of 1, so a factor applied to the loss afterwards would not reach it (dstrain.train.engine.tiling).

The weight is used as the caller hands it over: model.gpt.Head calls this inside its own forward, so that ZeRO-3
gathers its partitioned weight around the call as for any module (and a tied weight's gradient is summed by
autograd with the embedding's before ZeRO reduces it once); the pipeline's last stage gets its weight from the head
layer (model/pipe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # labels not learned (SFT prompts, padding)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (model.logit_softcap, Gemma 2); logits unchanged when cap is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def chunked_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: int, cap: float | None = None
) -> torch.Tensor:
    """Sum of the token losses (fp32, label -100 not counted) of soft_cap(hidden @ weight.T), ``chunks`` chunks of
    the tokens at a time; with the head's gradients formed in the forward where autograd needs them."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return FusedLinearCrossEntropy.apply(hidden, weight, labels, chunks, cap)
    rows, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    with torch.no_grad():
        for h, y in zip(rows.tensor_split(chunks), targets.tensor_split(chunks)):
            scores = soft_cap(F.linear(h, weight), cap).float()
            total += _token_losses(scores, y)
    return total


def _token_losses(scores: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the counted rows of logsumexp(scores) - scores[label] (fp32 scores)."""
    lse = torch.logsumexp(scores, dim=-1) if lse is None else lse
    picked = scores.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    return (lse - picked).masked_fill(labels == IGNORE_INDEX, 0.0).sum()


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = sum of the counted tokens' cross-entropies of soft_cap(hidden @ weight.T); the gradients with respect
    to hidden and weight are formed in the forward, chunk by chunk, and scaled by the incoming gradient in the
    backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks: int, cap: float | None):
        rows, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad_rows = torch.empty_like(rows) if hidden.requires_grad else None
        # fp32 accumulation, one rounding to the weight's dtype at the end, as one whole matmul would do
        grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        start = 0
        for h, y in zip(rows.tensor_split(chunks), targets.tensor_split(chunks)):
            loss, grad_logits = _chunk_loss_and_grad(h, weight, y, cap)
            total += loss
            if grad_rows is not None:
                torch.mm(grad_logits, weight, out=grad_rows[start : start + h.shape[0]])
            if weight.requires_grad:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:  # a bf16 matmul (fp32 inside), added into the fp32 sum
                    grad_weight.add_(grad_logits.t() @ h)
            start += h.shape[0]
            del grad_logits
        grad_hidden = grad_rows.view(hidden.shape) if grad_rows is not None else None
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if weight.requires_grad else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: the forward's gradients are used once (no retain_graph), and this keeps no second copy of them.
        if grad_hidden is not None:
            grad_hidden.mul_(grad_output)
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_hidden, grad_weight, None, None, None


def _chunk_loss_and_grad(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, gradient of it with respect to the chunk's logits before the soft cap, in the model's dtype)."""
    logits = F.linear(h, weight)
    tanh = None
    if cap is not None:  # soft_cap's ops in its order, tanh kept for the derivative
        tanh = torch.tanh(logits / cap)
        logits = tanh * cap
    scores = logits.float()  # the same tensor in fp32 (then overwritten below: the logits are not needed again)
    lse = torch.logsumexp(scores, dim=-1)
    loss = _token_losses(scores, labels, lse)
    grad = scores.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place: d(logsumexp - picked) = softmax - one-hot
    counted = labels != IGNORE_INDEX
    rows = torch.arange(labels.shape[0], device=labels.device)
    grad[rows, labels.clamp(min=0)] -= 1.0
    grad.mul_(counted.unsqueeze(1).to(grad.dtype))  # rows not learned give no gradient
    grad = grad.to(logits.dtype)  # where autograd casts the fp32 loss's gradient back (a copy in bf16)
    if tanh is not None and cap is not None:  # autograd's order: x cap, x (1 - tanh^2), / cap
        grad.mul_(cap).mul_(tanh.square_().neg_().add_(1.0)).div_(cap)
    return loss, grad
