"""What only a CUDA device can show; bench/gpu_check.py runs these on a GPU machine (see BENCHMARKS.md, "GPU")."""

import pytest
import torch

from ranks import run_ranks
from train_helpers import zero0_fp16_gradient_scale

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; bench/gpu_check.py runs it"),
]


@pytest.mark.deepspeed_defect(
    "engine.backward does not scale the loss for the ZeRO-0 fp16 optimizer (strategy._precision refuses it)"
)
def test_the_zero0_fp16_defect_reproduces_on_cuda():
    """The refusal of ZeRO-0 fp16 rests on a defect seen on CPU ranks; on CUDA (real fp16 kernels) the gradient after
    engine.backward is likewise unscaled (a correct engine would give the loss scale, 2**10)."""
    (ratio,) = run_ranks(1, zero0_fp16_gradient_scale)
    assert ratio == pytest.approx(1.0, rel=1e-2)


def test_fused_adam_matches_torch_adamw():
    """DeepSpeed's FusedAdam, JIT-built with this machine's nvcc as build_engine builds it, takes the same 10 steps as
    torch's AdamW (fp32)."""
    from deepspeed.ops.adam import FusedAdam

    from dstrain.train.engine.build import make_arch_list_readable_by_deepspeed

    make_arch_list_readable_by_deepspeed()  # the H100 image sets TORCH_CUDA_ARCH_LIST=9.0a (seen 2026-11-26)

    torch.manual_seed(0)
    start = torch.randn(4096, 257, device="cuda")
    grads = [torch.randn_like(start) for _ in range(10)]
    results = []
    for make in (
        lambda p: FusedAdam(p, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False),
    ):
        param = torch.nn.Parameter(start.clone())
        optimizer = make([param])
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        results.append(param.detach())
    assert (results[0] - results[1]).abs().max().item() <= 1e-6


def test_initial_weights_do_not_depend_on_the_device():
    """ZeRO-3 builds the model on the accelerator (zero.Init), the other strategies on the host: same weights."""
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT

    config = GPTConfig(flavour="llama", vocab_size=512, max_seq_len=64, n_layer=2, n_head=4, d_model=64)
    torch.manual_seed(0)
    host = GPT(config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        device = GPT(config)
    for (name, a), b in zip(host.state_dict().items(), device.state_dict().values()):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_bf16_causal_attention_dispatches_a_fused_kernel(flavour):
    """The shipped recipes' attention (causal, no dense mask; GQA for llama) runs a fused flash-style kernel in bf16:
    FlashAttention-2 or cuDNN's (which torch 2.11 prefers on Hopper), never the math path."""
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT

    config = GPTConfig(
        flavour=flavour,
        vocab_size=512,
        max_seq_len=1024,
        n_layer=1,
        n_head=8,
        n_kv_head=4 if flavour == "llama" else None,
        d_model=512,
    )
    model = GPT(config).to(device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 1024), device="cuda")
    with torch.no_grad(), torch.profiler.profile() as prof:
        model(tokens)
    ops = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}
    assert any("flash" in op or "cudnn" in op for op in ops), ops


def test_flex_doc_attention_equals_the_dense_mask_on_cuda():
    """Packed documents on a GPU take FlexAttention (compiled, block mask from position_ids): outputs and gradients
    equal the dense-mask SDPA's to 1e-4 in fp32: two fp32 kernels summing in other orders; an H100 (2026-11-26) gave
    4.0e-5 at most, on 0.2% of the elements, where a masking error would be ~1e-1 (tests/test_doc_attention.py checks
    the forward on CPU)."""
    from dstrain.model.doc_attention import dense_doc_attention, doc_attention, flex_supported

    assert flex_supported("cuda")
    torch.manual_seed(0)
    length, cuts = 512, [0, 37, 300, 301, 512]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None].cuda()
    inputs = [torch.randn(1, h, length, 64, device="cuda", requires_grad=True) for h in (8, 2, 2)]
    results = []
    for attend in (doc_attention, dense_doc_attention):
        out = attend(*inputs, positions)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        results.append((out, *grads))
    for flex, dense in zip(*results):
        torch.testing.assert_close(flex, dense, rtol=0, atol=1e-4)


def test_flex_window_and_sinks_equal_the_dense_mask_on_cuda():
    """A local block (window 100, across 128-token blocks) with GPT-OSS's sinks, packed or not, takes FlexAttention
    compiled on a GPU (block mask = causal, window and documents; sinks through the log-sum-exp): outputs and
    gradients, sinks' included, equal the dense path's (transformers' eager GPT-OSS attention, tests/test_windows.py)
    to 1e-4 in fp32, the bound of test_flex_doc_attention_equals_the_dense_mask_on_cuda. Not yet run on a GPU."""
    from dstrain.model.doc_attention import dense_doc_attention, doc_attention, flex_supported

    assert flex_supported("cuda")
    torch.manual_seed(0)
    length, cuts = 512, [0, 37, 300, 301, 512]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None].cuda()
    inputs = [torch.randn(1, h, length, 64, device="cuda", requires_grad=True) for h in (8, 2, 2)]
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    for documents in (positions, None):
        results = []
        for attend in (doc_attention, dense_doc_attention):
            out = attend(*inputs, documents, 100, sinks)
            results.append((out, *torch.autograd.grad(out.square().sum(), [*inputs, sinks])))
        for flex, dense in zip(*results):
            torch.testing.assert_close(flex, dense, rtol=0, atol=1e-4)


def test_rms_norm_on_cuda_keeps_its_input_and_an_fp32_rstd():
    """`dstrain estimate` counts torch's fused CUDA RMSNorm (activations.py, fused_norms=True): it keeps its bf16 input
    and one fp32 rstd per row, where the CPU's composite path keeps fp32 copies of input and output. With it the
    estimate met an H100's measured peaks of gpt-1.3b and Qwen3-0.6B to 0.3% (2026-11-26); without it, 12-14% high."""
    rows, width = 64, 512
    norm = torch.nn.RMSNorm(width, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    assert sum(saved.values()) == rows * width * 2 + rows * 4 + width * 2  # input, rstd, weight
