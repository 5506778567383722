"""Muon under DeepSpeed's ZeRO optimizers: the upstream behaviour (ZeRO-1/2/3 clip the orthogonalised update and
report its norm) and dstrain's workaround (train/engine/muon_zero.py: clip the raw gradient, then orthogonalise), one
Muon step
of a tiny GPT on one rank against ZeRO-0. The training-level proof (losses and grad norms over 10 steps on 2 ranks)
is tests/test_muon.py."""

import pytest
import torch

from ranks import run_ranks


def probe_zero_clipping(stage: int, clip: float, workaround: bool = False) -> dict:
    """Rank target (1 rank): one Muon step of a small GPT under ZeRO ``stage`` with clipping at ``clip``, DeepSpeed's
    own or with dstrain's ``muon_zero`` workaround; the norm the engine reports, the raw gradient's norm, and a Muon
    matrix after the step."""
    import deepspeed

    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT, lm_loss, param_groups
    from dstrain.train.engine import grad_norm, muon_zero
    from dstrain.train.process import distributed

    distributed.init()
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavour="llama", vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=16))
    config = {
        "train_batch_size": 2,
        "gradient_clipping": clip,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **({"reduce_scatter": False} if stage == 3 else {})},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.0), config=config)
    grad_norm.install(engine)  # ZeRO-0: dstrain's clip of the raw gradient
    if workaround:
        muon_zero.install(engine)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
    raw = grad_norm.global_grad_norm(engine).item() if stage == 0 else None
    engine.step()
    with deepspeed.zero.GatheredParameters([engine.module.blocks[0].mlp.up_proj.weight]):
        matrix = engine.module.blocks[0].mlp.up_proj.weight.detach().tolist()
    return {"reported": float(engine.get_global_grad_norm()), "raw": raw, "matrix": matrix}


def run_clipping_probes() -> dict:
    """Both tests' probes in one rank: ZeRO-0's, and ZeRO-1/3's without (False) and with (True) the workaround."""
    with torch.compiler.set_stance("force_eager"):  # as dstrain runs Muon on a CPU (engine.run_muon_eagerly_on_cpu)
        zero0 = {(0, clip): probe_zero_clipping(0, clip) for clip in (0.0, 1e-2)}
        probes = {}
        for workaround in (False, True):
            probes[workaround] = dict(zero0)
            for stage in (1, 3):
                for clip in (0.0, 1e-2):
                    probes[workaround][(stage, clip)] = probe_zero_clipping(stage, clip, workaround)
        return probes


@pytest.fixture(scope="module")
def clipping_probes():
    (probes,) = run_ranks(1, run_clipping_probes)
    return probes


@pytest.mark.distributed
@pytest.mark.deepspeed_defect(
    "ZeRO-1/2/3 clip Muon's orthogonalised update (train/engine/muon_zero.py works around it)"
)
def test_deepspeed_zero_clips_the_orthogonalised_update(clipping_probes):
    """Without clipping ZeRO-1 and 3 take ZeRO-0's Muon step; with it, another one, and they report another norm: the
    norm of the orthogonalised update (about sqrt(rank) per matrix), not the raw gradient's."""
    probes = clipping_probes[False]
    matrix = {key: torch.tensor(probe["matrix"]) for key, probe in probes.items()}
    zero0 = probes[(0, 1e-2)]
    assert zero0["reported"] == pytest.approx(zero0["raw"], rel=1e-6)
    for stage in (1, 3):
        torch.testing.assert_close(matrix[(stage, 0.0)], matrix[(0, 0.0)], rtol=0, atol=1e-6)
        assert probes[(stage, 1e-2)]["reported"] > 2 * zero0["raw"]
        assert (matrix[(stage, 1e-2)] - matrix[(0, 1e-2)]).abs().max() > 1e-4


@pytest.mark.distributed
def test_muon_zero_clips_the_raw_gradient_before_deepspeeds_muon(clipping_probes):
    """The same probes with train/engine/muon_zero.py installed: ZeRO-1 and 3 report the raw gradient's norm and take
    ZeRO-0's clipped step (the update is about 1e-4 per element: 1e-6 is 1% of it)."""
    probes = clipping_probes[True]
    matrix = {key: torch.tensor(probe["matrix"]) for key, probe in probes.items()}
    for stage in (1, 3):
        for clip in (0.0, 1e-2):
            assert probes[(stage, clip)]["reported"] == pytest.approx(probes[(0, clip)]["raw"], rel=1e-6)
            torch.testing.assert_close(matrix[(stage, clip)], matrix[(0, clip)], rtol=0, atol=1e-6)
    assert (matrix[(0, 1e-2)] - matrix[(0, 0.0)]).abs().max() > 1e-5  # the clip changes the step
