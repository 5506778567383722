"""What `dstrain doctor` checks besides the strategies' runs, on the ranks of its launch: the kernels this machine
runs against their plain references, and the collectives' bandwidth.

Each check returns ``{"name", "value", "tolerance", "ok", "detail"}`` (bandwidths: ``value`` in Gbit/s of bus
bandwidth, ``tolerance`` None). The kernels run on rank 0's device in fp32 at small shapes; their tolerances are a few
fp32 units of the outputs' scale (the kernels sum in other orders), far below what a wrong mask, a lost tile or a
different update rule moves (1e-2 and more).
"""

from __future__ import annotations

import time

import torch

KERNEL_RTOL = 1e-5  # fp32: reordered sums of a few hundred terms stay within a few units of 2^-23 of the scale
COLLECTIVE_BYTES = 16 * 2**20  # as plan --calibrate's all-reduce


def result(name: str, value: float, tolerance: float | None, detail: str) -> dict:
    ok = tolerance is None or value <= tolerance
    return {"name": name, "value": value, "tolerance": tolerance, "ok": ok, "detail": detail}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))


def fused_optimizer(device) -> dict:
    """One AdamW step of DeepSpeed's optimizer for this device (CPUAdam on a CPU, FusedAdam on a GPU) against
    torch's, from the same weights and gradients; compared on the update (new weight minus old), relative to the
    largest update."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, generator=generator)
    # |g| in [1e-2, 2e-2], away from eps, where an eps placed differently would weigh (measured on a CPU: 1.7e-4 of
    # the largest update with torch.randn * 1e-2 gradients, whose smallest are ~1e-6)
    grad = torch.randn(4096, generator=generator).sign() * (1 + torch.rand(4096, generator=generator)) * 1e-2
    updates = []
    kind = DeepSpeedCPUAdam if device.type == "cpu" else FusedAdam
    for make in (kind, torch.optim.AdamW):
        param = torch.nn.Parameter(weight.clone().to(device))
        param.grad = grad.clone().to(device)
        make([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1).step()
        updates.append((param.detach() - weight.to(device)).cpu())
    # DeepSpeedCPUAdam's vectorised step differs from torch's by 1.7e-4 of the largest update on this project's CPUs
    # (AVX-512 with FP16, as its Muon path; dstrain's fp32 CPU configs train with torch's AdamW, torch_adam: true),
    # so a CPU is held to 1e-3: a wrong step (a missing bias correction, a doubled decay) is off by 1e-1 and more.
    tolerance = 1e-3 if device.type == "cpu" else KERNEL_RTOL
    return result("fused optimizer", relative(*updates), tolerance, f"{kind.__name__} vs torch.optim.AdamW, one step")


def attention(device) -> dict:
    """The attention kernel this device runs (FlexAttention where supported) on a packed batch (documents of 12, 20
    and 32 tokens) with document masking and a window of 8, against softmax(QK^T) with the dense mask, computed
    here, forward output and the query's gradient."""
    from dstrain.model.doc_attention import doc_attention, doc_causal_mask, flex_supported

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=generator).to(device).requires_grad_() for _ in range(3))
    positions = torch.tensor([[*range(12), *range(20), *range(32)]] * 2, device=device)
    out = doc_attention(q, k, v, positions, window=8)
    (grad,) = torch.autograd.grad(out.square().sum(), q)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(~doc_causal_mask(positions, 64, 8, device), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ v
    (want_grad,) = torch.autograd.grad(want.square().sum(), q)
    kernel = "FlexAttention" if flex_supported(device.type) else "SDPA with the dense mask"
    error = max(relative(out, want), relative(grad, want_grad))
    return result("attention", error, KERNEL_RTOL, f"{kernel} vs softmax(QK^T) masked: documents, window 8")


def chunked_loss(device) -> dict:
    """The chunked loss (model/chunked_loss.py, 4 chunks, the head's gradients formed in its forward) against the
    whole one: the loss sum and both gradients."""
    from dstrain.model.chunked_loss import chunked_loss_sum
    from dstrain.model.gpt import token_loss_sum

    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 256, bias=False).to(device)
    hidden = torch.randn(2, 64, 32, generator=generator).to(device).requires_grad_()
    labels = torch.randint(0, 256, (2, 64), generator=generator).to(device)
    values = []
    whole = (
        lambda: chunked_loss_sum(hidden, head.weight, labels, 4, None),
        lambda: token_loss_sum(head(hidden), labels),
    )
    for compute in whole:
        hidden.grad = head.weight.grad = None
        loss = compute()
        loss.backward()
        values.append((loss.detach(), hidden.grad, head.weight.grad))
    errors = [relative(a, b) for a, b in zip(*values)]
    return result("chunked loss", max(errors), KERNEL_RTOL, "4 chunks vs whole logits: loss sum, d hidden, d head")


def bandwidths(device) -> list[dict]:
    """Bus bandwidth (as nccl-tests count it) of an all-reduce, all-gather and all-to-all of 16 MiB over all ranks."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world < 2:
        return []
    numel = COLLECTIVE_BYTES // 4
    tensor = torch.ones(numel, device=device)
    gathered = torch.empty(numel * world, device=device)
    moved = torch.empty(numel, device=device)
    calls = {
        "all-reduce": (lambda: dist.all_reduce(tensor), 2 * (world - 1) / world),
        "all-gather": (lambda: dist.all_gather_into_tensor(gathered, tensor), (world - 1) / world),
        "all-to-all": (lambda: dist.all_to_all_single(moved, tensor), (world - 1) / world),
    }
    found = []
    for name, (call, bus_factor) in calls.items():
        try:
            call()  # warm-up: connections
            dist.barrier()
            start, runs = time.perf_counter(), 3
            for _ in range(runs):
                call()
            seconds = (time.perf_counter() - start) / runs
            gbps = COLLECTIVE_BYTES * bus_factor / seconds * 8 / 1e9
            found.append(result(f"{name} bandwidth", gbps, None, f"{world} ranks, 16 MiB, bus Gbit/s"))
        except (RuntimeError, NotImplementedError) as e:  # gloo has no all_to_all_single on some builds
            found.append({"name": f"{name} bandwidth", "value": None, "tolerance": None, "ok": True, "detail": str(e)})
    return found


def run_checks(enabled: bool = True) -> list[dict]:
    """Every check on this rank: the kernels on rank 0, the collectives on all."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if not enabled:
        return []
    device = torch.device(get_accelerator().current_device_name())
    found = bandwidths(device)
    if dist.get_rank() == 0:
        for check in (fused_optimizer, attention, chunked_loss):
            try:
                found.append(check(device))
            except Exception as e:  # noqa: BLE001  (a kernel that does not run here is that check's line)
                found.append(result(check.__name__.replace("_", " "), float("inf"), KERNEL_RTOL, repr(e)[:200]))
    return found
