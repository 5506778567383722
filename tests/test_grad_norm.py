"""grad_norm where DeepSpeed keeps none (ZeRO-0 fp32), and the DeepSpeed defects that train/engine/grad_norm.py works
around (issue 12 item 9). The same norm under ZeRO 0-3, pipeline and TP: tests/test_train.py and
tests/test_parallel.py compare the logged grad_norm of their runs."""

from types import SimpleNamespace

import pytest
import torch

from ranks import run_ranks

RTOL = 1e-6  # one fp32 sum of squares against another order of the same sum


def probe_engines() -> dict:
    """Rank target (2 ranks, data parallel): DeepSpeed's ZeRO-0 fp32 engine as it is and with our install, against
    torch's clip_grad_norm_ and SGD on a replica fed both ranks' samples."""
    import deepspeed

    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT, lm_loss
    from dstrain.train.engine import grad_norm
    from dstrain.train.process import distributed

    distributed.init()
    config = GPTConfig(flavour="llama", vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    rank = torch.distributed.get_rank()
    ds = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1e-3,
        "zero_optimization": {"stage": 0},
    }
    norms = {}
    for name in ("deepspeed", "installed"):
        torch.manual_seed(0)
        model = GPT(config)
        # SGD with lr 1: the update is the clipped gradient itself (Adam would hide the clipping's scale)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds)
        if name == "installed":
            grad_norm.install(engine)
        mine = tokens[2 * rank : 2 * rank + 2]
        engine.backward(lm_loss(engine(mine[:, :-1]), mine[:, 1:]))
        engine.step()
        norm = engine.get_global_grad_norm()
        norms[name] = None if norm is None else float(norm)
        norms[f"{name}_weight"] = engine.module.lm_head.weight.detach().tolist()
    torch.manual_seed(0)
    reference = GPT(config)
    lm_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    norms["torch"] = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3))
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    norms["torch_weight"] = reference.lm_head.weight.detach().tolist()
    return norms


def probe_pipeline_grid() -> dict:
    """Rank target (2 ranks = 2 pipeline stages): one parameter per stage with gradient norm 3 and 4; the norm
    DeepSpeed's ZeRO-0 clipping uses and ours."""
    from types import SimpleNamespace

    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    from deepspeed.runtime.utils import clip_grad_norm_

    from dstrain.train.engine.grad_norm import global_grad_norm
    from dstrain.train.process import distributed

    distributed.init()
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([0.0, 3.0]) if grid.get_stage_id() == 0 else torch.tensor([4.0, 0.0])
    ours = global_grad_norm(SimpleNamespace(mpu=grid, module=torch.nn.ParameterList([param]), device="cpu"))
    deepspeeds = clip_grad_norm_([param], max_norm=1e9, mpu=grid)
    return {"deepspeed": float(deepspeeds), "ours": float(ours)}


def probe_pipeline_zero1_groups() -> dict:
    """Rank target (2 ranks = 2 pipeline stages, ZeRO-1): stage 0 holds one matrix only, stage 1 a matrix and a bias,
    so stage 0's no-decay group is empty (as for an embedding-only stage). Each rank's parameter group count, and
    with pad_group_norms a step's global norm against torch's on a replica, loss averaged over the micro-batches."""
    import copy

    import deepspeed
    from deepspeed.pipe import PipelineModule

    from dstrain.model.gpt import param_groups
    from dstrain.train.engine.grad_norm import pad_group_norms
    from dstrain.train.process import distributed

    distributed.init()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4)]
    replica = torch.nn.Sequential(*copy.deepcopy(layers))
    model = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    ds = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1), config=ds)
    groups = len(engine.optimizer.bit16_groups)
    pad_group_norms(engine)
    data = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    target = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    engine.train_batch(iter([(data[:2], target[:2]), (data[2:], target[2:])]))
    loss = sum(torch.nn.functional.mse_loss(replica(data[i : i + 2]), target[i : i + 2]) for i in (0, 2)) / 2
    loss.backward()
    reference = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in replica.parameters()]))
    return {"groups": groups, "norm": float(engine.get_global_grad_norm()), "torch": float(reference)}


def run_probes() -> dict:
    """Rank target: the probes in one process group."""
    return {"engines": probe_engines(), "grid": probe_pipeline_grid(), "zero1_pipe": probe_pipeline_zero1_groups()}


def test_fp32_vector_norm_drifts_on_cpu_and_ours_is_taken_in_fp64():
    """torch's CPU vector_norm sums fp32 in one running accumulator: on 2^19 elements (a 4096 x 128 lm_head) it is
    ~4e-6 off, which made ZeRO-0's norm differ from ZeRO-1/2/3's (fp64, DeepSpeed's get_norm_dtype) by 1e-5 on the
    tiny recipe. Ours is exact to fp32 rounding; the first assertion notices a torch that sums better."""
    from dstrain.train.engine.grad_norm import global_grad_norm

    grad = torch.randn(2**19, generator=torch.Generator().manual_seed(0))
    exact = grad.double().norm().item()
    assert abs(torch.linalg.vector_norm(grad).item() - exact) > 1e-6 * exact
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    ours = global_grad_norm(SimpleNamespace(mpu=None, module=torch.nn.ParameterList([param]), device="cpu"))
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(exact, rel=1e-7)


@pytest.fixture(scope="module")
def probes():
    return run_ranks(2, run_probes)


@pytest.mark.deepspeed_defect("ZeRO-0 fp32 keeps no grad norm (train/engine/grad_norm.py::install computes it)")
@pytest.mark.distributed
def test_deepspeed_keeps_no_grad_norm_without_zero(probes):
    assert [rank["engines"]["deepspeed"] for rank in probes] == [None, None]


@pytest.mark.deepspeed_defect("pipeline ZeRO-0 clips by the first stage's norm (train/engine/grad_norm.py::install)")
@pytest.mark.distributed
def test_deepspeed_pipeline_zero0_clips_by_the_first_stage_only(probes):
    assert [rank["grid"]["deepspeed"] for rank in probes] == pytest.approx([3.0, 3.0], rel=1e-6)


@pytest.mark.deepspeed_defect(
    "a ZeRO-1 pipeline stage loses its empty group (train/engine/grad_norm.py::pad_group_norms)"
)
@pytest.mark.distributed
def test_deepspeed_pipeline_zero1_drops_a_stages_empty_group(probes):
    """Unpadded, stage 0 makes one norm all-reduce for stage 1's two and the step hangs (the planner's DualPipeV
    layout of recipes/tiny.yaml did: embedding and head on one rank)."""
    assert [rank["zero1_pipe"]["groups"] for rank in probes] == [1, 2]


@pytest.mark.distributed
def test_a_zero1_pipeline_with_an_empty_group_on_a_stage_steps_with_the_global_norm(probes):
    for rank in probes:
        assert rank["zero1_pipe"]["norm"] == pytest.approx(rank["zero1_pipe"]["torch"], rel=RTOL)


@pytest.mark.distributed
def test_our_norm_is_the_global_pre_clip_norm(probes):
    for rank in probes:
        engines = rank["engines"]
        assert engines["installed"] == pytest.approx(engines["torch"], rel=RTOL)
        assert engines["torch"] > 1e-2  # far above the clip: the clipped update differs from an unclipped one
        assert rank["grid"]["ours"] == pytest.approx(5.0, rel=1e-6)


@pytest.mark.distributed
def test_our_clipping_gives_torchs_update(probes):
    """Clipped by our norm, the ZeRO-0 step lands where torch's clip_grad_norm_ + SGD does (as DeepSpeed's own
    clipping does without pipeline stages)."""
    for rank in probes:
        engines = rank["engines"]
        want = torch.tensor(engines["torch_weight"])
        for name in ("installed_weight", "deepspeed_weight"):
            torch.testing.assert_close(torch.tensor(engines[name]), want, rtol=0, atol=1e-7)
