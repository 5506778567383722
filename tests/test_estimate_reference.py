"""The estimate and the planner count a preference recipe's reference pass (dstrain.plan.reference_memory): its
no-grad forward against the live tensors it makes, its phase beside training's, and the layouts it refuses."""

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dstrain.plan.memory_parts import GIB, PHASES
from dstrain.recipe_file import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DPO_QWEN = ROOT / "recipes" / "dpo-qwen3-0.6b.yaml"


class LivePeak(TorchDispatchMode):
    """The peak bytes of the storages that the ops run under it make and keep alive (counted when an op returns
    them, released when their last tensor dies); tensors made before it (the weights, the batch) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.held: dict[int, list[int]] = {}  # storage pointer -> [tensors alive, bytes]

    def _release(self, key: int) -> None:
        self.held[key][0] -= 1
        if self.held[key][0] == 0:
            self.live -= self.held.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in self.held:
                    self.held[key] = [0, storage.nbytes()]
                    self.live += storage.nbytes()
                self.held[key][0] += 1
                weakref.finalize(tensor, self._release, key)
        self.peak = max(self.peak, self.live)
        return out


def packed_pairs(seq: int, batch: int, vocab: int) -> dict:
    """``batch`` samples of whole pairs: 40-100 prompt tokens, 20-120 tokens each completion (as bench_dpo.py)."""
    import numpy as np

    from dstrain.data.dataset import collate
    from dstrain.data.pair_packing import pair_sample

    rng, samples = np.random.default_rng(1), []
    for _ in range(batch):
        sides, used = [], 0
        while True:
            prompt = rng.integers(0, vocab, rng.integers(40, 100))
            answers = [rng.integers(0, vocab, rng.integers(20, 120)) for _ in range(2)]
            if used + 2 * prompt.size + sum(a.size for a in answers) > seq + 1:
                break
            for answer in answers:
                mask = np.concatenate([np.zeros(prompt.size, np.uint8), np.ones(answer.size, np.uint8)])
                sides.append((np.concatenate([prompt, answer]), mask))
                used += prompt.size + answer.size
        samples.append(pair_sample(sides, seq, pad_id=0))
    return collate(samples)


@pytest.mark.parametrize(
    "d_model,d_ff,vocab", [(128, 344, 4096), (256, 688, 512), (64, 1024, 256)], ids=["head", "block", "wide-mlp"]
)
def test_reference_forward_term_bounds_the_live_tensors_of_a_no_grad_forward(d_model, d_ff, vocab):
    """The reference pass's forward (reference_scores.score_pairs: the model's logits, then completion_logps)
    makes at most forward_bytes, and at least 98% of it: the head's logits and log-softmax where the vocabulary is
    large, one block's MLP where it is wide."""
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.objectives.preference import forward_bytes
    from dstrain.train.objectives.preference.losses import completion_logps

    config = GPTConfig(flavour="llama", vocab_size=vocab, max_seq_len=256, n_layer=2, n_head=4, n_kv_head=2,
                       d_model=d_model, d_ff=d_ff, doc_masking=True)  # fmt: skip
    torch.manual_seed(0)
    model, batch = GPT(config).eval(), packed_pairs(256, 4, vocab)
    recipe = load_recipe(DPO_QWEN)
    recipe = dataclasses.replace(recipe, model=config, data=dataclasses.replace(recipe.data, seq_len=256))
    with torch.no_grad(), LivePeak() as live:
        completion_logps(model(batch["input_ids"], batch["position_ids"]), batch["labels"], batch["documents"])
    counted = forward_bytes(recipe, micro_batch=4)
    assert live.peak <= counted <= live.peak / 0.98, (live.peak, counted)


def test_the_estimate_shows_the_reference_phase_beside_training():
    """dpo-qwen3-0.6b under its planned ds_config: the reference phase holds the built engine's state at rest and
    one no-grad forward in bf16 (no second model); training's peak is the backward's, as before; simpo has no pass."""
    from dstrain.objectives.preference import forward_bytes
    from dstrain.plan.memory import estimate_file

    recipe = load_recipe(DPO_QWEN)
    ds_config = ROOT / "ds_configs" / "planned" / "dpo-qwen3-0.6b-1x8-h100.json"
    est = estimate_file(recipe, DPO_QWEN, ds_config, nodes=1, gpus_per_node=8)
    rest = sum(p.step for p in est.parts if p.where == "device" and p.group in ("parameters", "optimizer states"))
    rest += next(p.step for p in est.parts if p.name.startswith("gradients (fp32), 1/8 partition"))
    assert est.total("device", "reference") == rest + forward_bytes(recipe, 4, act_bytes=2)
    assert est.total("cpu", "reference") == est.total("cpu", "step") - sum(
        p.step for p in est.parts if p.where == "cpu" and p.reference == 0
    )  # the host holds no reference model either
    assert est.peak_phase == "backward" and 20 * GIB < est.total("device", "reference") < 28 * GIB
    assert est.to_json()["reference_device"] == est.total("device", "reference")
    simpo = dataclasses.replace(recipe, preference=dataclasses.replace(recipe.preference, loss="simpo"))
    plain = estimate_file(simpo, DPO_QWEN, ds_config, nodes=1, gpus_per_node=8)
    assert plain.phases == PHASES and plain.total("device", "reference") == 0
    assert [plain.total("device", phase) for phase in PHASES] == [est.total("device", phase) for phase in PHASES]


@pytest.mark.parametrize(
    "layout", [dict(zero=3, micro=16, sp=2, checkpointing=True), dict(zero=2, micro=8), dict(zero=1, micro=2, tp=2)]
)
def test_the_reference_pass_fits_wherever_training_does(layout):
    """The engine's own no-grad forwards on each rank's slice, beside the state training holds at rest: below
    training's peak under every layout (so the planner weighs the same layouts with and without a reference)."""
    from dstrain.plan.layouts import Layout
    from dstrain.plan.memory import estimate
    from dstrain.strategy.resolve import resolve

    recipe = load_recipe(DPO_QWEN)
    strategy = resolve(recipe, DPO_QWEN, Layout(**layout).ds_config("bf16", False), "plan", 2, check_device=False)
    est = estimate(recipe, strategy, 1, 2)
    assert 0 < est.total("device", "reference") < est.total("device", est.peak_phase)
    assert est.peak_phase != "reference"
