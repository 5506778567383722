"""What `dstrain doctor` measures inside each rank of each run, beside the losses and norms the trainer logs: the
gradient as every rank holds it at the optimizer step, the norm DeepSpeed reports against one computed here, the
backward passes and optimizer steps per step, and the parameters each rank holds after it.

``Probe`` is the trainer's StepHooks (dstrain.train.step.step_hooks). On ``attach`` it wraps the engine's
``_take_model_step`` (DeepSpeed calls it once per optimizer step, ZeRO, pipeline and ZeRO-0 alike, after the
gradients are reduced and before they are clipped or applied: the place DeepSpeed's ``safe_get_full_grad`` is meant
for) and hooks the first trainable parameter's gradient to count backward passes. Each step appends one record per
rank to ``run_dir/probe_rank<r>.jsonl`` (``ProbeRecord``); dstrain.commands.doctor_checks compares them.

Written here rather than taken from DeepSpeed: DeepSpeed exposes the full gradient (``safe_get_full_grad``) and its
own norm, but no per-rank digest or independent norm to hold them against.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dstrain.train.step.step_hooks import StepHooks


@dataclass
class ProbeRecord:
    """One rank's view of one optimizer step."""

    step: int
    rank: int
    shard: str  # ranks with the same shard hold the same parameters (pipeline stage, tensor-parallel rank)
    backwards: int  # backward passes that reached the first trainable parameter since the last step
    optimizer_steps: int  # DeepSpeed's global_steps moved by this much
    skipped: int  # DeepSpeed's skipped_steps moved by this much (fp16 overflows)
    accumulation: int  # the engine's gradient_accumulation_steps()
    reported_norm: float | None  # engine.get_global_grad_norm() after the step
    independent_norm: float | None  # from the full gradient at the step (None: tensor/expert-parallel, not computed)
    grad_digest: str  # blake2b of this rank's full gradient (dense, non-expert parameters) at the step
    param_digest: str | None  # of its parameters after the step (None under ZeRO-3: partitioned)
    tied_grad_norm: float | None  # the embedding's full gradient norm at the step, when the head shares it
    note: str = ""  # why a value is missing


def digest(tensors: list[torch.Tensor]) -> str:
    """A hash of the tensors' bytes in fp32: two ranks holding the same values give the same digest."""
    hasher = hashlib.blake2b(digest_size=12)
    for tensor in tensors:
        hasher.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return hasher.hexdigest()


def shard_of(engine) -> str:
    import deepspeed

    stage = engine.stage_id if isinstance(engine, deepspeed.PipelineEngine) else 0
    try:
        tp = engine.mpu.get_tensor_model_parallel_rank() if engine.mpu is not None else 0
    except AttributeError:  # DeepSpeed's sequence-parallel state has no tensor-parallel rank: every rank is one
        tp = 0
    return f"stage{stage}/tp{tp}"


class Probe(StepHooks):
    """The doctor's StepHooks for one run (module doc); a test's defect subclasses it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.rank = Path(run_dir), 0
        self.engine: Any = None  # DeepSpeed's engine, from attach
        self.backwards = 0
        self.at_step: dict = {}

    # --- the trainer's seam ------------------------------------------------------------------------------------
    def attach(self, engine) -> None:
        self.engine, self.rank = engine, torch.distributed.get_rank()
        self.shard = shard_of(engine)
        self.steps_before, self.skipped_before = engine.global_steps, engine.skipped_steps
        params = [p for p in engine.module.parameters() if p.requires_grad and not self.expert(p)]
        if params:
            params[0].register_hook(self._count_backward)
        take_model_step = engine._take_model_step

        def take_model_step_probed(*args, **kwargs):
            self.at_step = self.gradients()
            return take_model_step(*args, **kwargs)

        engine._take_model_step = take_model_step_probed

    def stepped(self, step: int) -> None:
        engine = self.engine
        reported = engine.get_global_grad_norm()
        at = self.at_step
        record = ProbeRecord(
            step=step,
            rank=self.rank,
            shard=self.shard,
            backwards=self.backwards,
            optimizer_steps=engine.global_steps - self.steps_before,
            skipped=engine.skipped_steps - self.skipped_before,
            accumulation=engine.gradient_accumulation_steps(),
            reported_norm=None if reported is None else float(reported),
            independent_norm=at.get("norm"),
            grad_digest=at.get("digest", ""),
            param_digest=self.param_digest(),
            tied_grad_norm=at.get("tied"),
            note=at.get("note", ""),
        )
        self.backwards, self.at_step = 0, {}
        with (self.run_dir / f"probe_rank{self.rank}.jsonl").open("a") as out:
            out.write(json.dumps(asdict(record)) + "\n")

    # --- measurements ------------------------------------------------------------------------------------------
    def _count_backward(self, grad):
        if self.backwards == 0:  # a step's first backward: its optimizer steps count from here (after any resume)
            self.steps_before, self.skipped_before = self.engine.global_steps, self.engine.skipped_steps
        self.backwards += 1
        return grad

    @staticmethod
    def expert(param) -> bool:
        from deepspeed.moe.utils import is_moe_param

        return is_moe_param(param)

    def gradients(self) -> dict:
        """At the optimizer step, on every rank alike (ZeRO gathers each full gradient with a collective)."""
        from deepspeed.runtime.utils import is_model_parallel_parameter
        from deepspeed.utils import safe_get_full_grad

        engine = self.engine
        dense, squares, note = [], 0.0, ""
        independent = True
        tied = getattr(getattr(engine.module, "config", None), "tied", False)  # GPT's; a pipeline's module has none
        tied_norm = None
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:
                continue
            try:
                grad = safe_get_full_grad(param)
            except Exception as e:  # noqa: BLE001  (a layout DeepSpeed's accessor does not cover is a note)
                return {"note": f"safe_get_full_grad: {type(e).__name__}: {e}"[:200]}
            if grad is None:
                continue
            if self.expert(param) or is_model_parallel_parameter(param):
                independent = False
                continue
            dense.append(grad)
            if not getattr(param, "ds_pipe_replicated", False):
                squares += float(grad.detach().double().square().sum())
            if tied and name == "embed.tok.weight":
                tied_norm = float(grad.detach().double().norm())
        norm = None
        if independent:
            total = torch.tensor([squares], dtype=torch.float64)
            total = total.to(engine.device) if engine.device.type != "cpu" else total
            torch.distributed.all_reduce(total)
            norm = math.sqrt(float(total.item()) / self.replicas())
        else:
            note = "tensor- or expert-parallel: no independent norm"
        return {"norm": norm, "digest": digest(dense), "tied": tied_norm, "note": note}

    def replicas(self) -> int:
        """How many ranks hold each gradient: all but the pipeline's split (checked only without TP and EP)."""
        import deepspeed

        stages = self.engine.num_stages if isinstance(self.engine, deepspeed.PipelineEngine) else 1
        return torch.distributed.get_world_size() // stages

    def param_digest(self) -> str | None:
        if self.engine.zero_optimization_stage() == 3:
            return None
        params = [p for p in self.engine.module.parameters() if not self.expert(p)]
        return digest(params)


class NudgedProbe(Probe):
    """The fp32 twin's probe: before step 1 every weight moves by one unit in the last place, up or down at random
    (the same seed on every rank). The twin then differs from its baseline by a last bit from the start, as strategies
    differ by the order of their sums, and its per-step drift shows how much each step's conditioning amplifies such a
    bit: at tiny.yaml's own size another micro-batch alone gave bit-identical ZeRO-0 runs, and no tolerance."""

    def attach(self, engine) -> None:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in engine.module.parameters():
                up = (torch.rand(param.shape, generator=generator) < 0.5).to(param.device)
                toward = torch.where(up, math.inf, -math.inf).to(param.dtype)
                param.copy_(torch.nextafter(param, toward))
        super().attach(engine)
