"""The RL objective inside the trainer: ``RLTrainStep`` is the trainer's step (it draws its own samples, not the
packed stream's), ``RLForward`` the forward that evaluation shares and that carries the step's metrics to
``RLMetrics``, the component that puts them in each train record.

Step s (counted from 0) trains on rollout s // rl.iterations: a fresh rollout whenever s is a multiple of
rl.iterations, decoded by the weights of that moment from the prompts and seeds of the rollout's index
(dstrain.train.objectives.online_rl.prompts, .rollout). A resumed run so draws the samples the uninterrupted one
drew; with more than one iteration, a checkpoint inside a rollout keeps it (each rank's share,
``RLMetrics.rank_files``), and the resumed run trains on it, on as many ranks (on another rank count it is decoded
again from the resumed weights).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dstrain.errors import DstrainError
from dstrain.objectives.rl_rewards import load_rewards
from dstrain.train.objectives.online_rl.prompts import load_prompts, step_prompts
from dstrain.train.objectives.online_rl.rollout import Rollout, from_state, rollout, to_state
from dstrain.train.objectives.online_rl.step import RLStep, StepResult
from dstrain.train.step.components import Component, Progress
from dstrain.train.step.forward import ModelForward
from dstrain.train.step.handle import RunHandle
from dstrain.train.step.steps import TrainStep


class RLForward(ModelForward):
    """ModelForward (the valid loss) carrying each RL step's metrics to RLMetrics."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_records: list[dict] = []
        self.rollout_state: dict | None = None  # the rollout in training, for a checkpoint (rollout.to_state)
        self.restored_state: dict | None = None  # the one a resumed checkpoint kept


class RLTrainStep(TrainStep):
    """One optimizer step of the RL objective (module doc)."""

    def __init__(self, recipe, strategy, engine, forward: ModelForward, components: Component) -> None:
        super().__init__(recipe, strategy, engine, forward, components)
        from dstrain.data.chat import end_of_turn_ids
        from dstrain.data.tokenizer import load_tokenizer, run_tokenizer_dir

        layouts = {"tensor": strategy.tp_size, "sequence": strategy.sp_size, "expert": strategy.ep_size}
        if parallel := [f"{name} parallelism {size}" for name, size in layouts.items() if size > 1]:
            raise DstrainError(
                f"an rl: recipe runs under ZeRO 0-3 without model parallelism, not {', '.join(parallel)}: each rank "
                f"decodes with the whole model; use a ZeRO ds_config (docs/rl.md)"
            )
        assert isinstance(forward, RLForward)
        self.rl_forward, self.cfg, self.seed = forward, recipe.rl, recipe.seed
        self.zero_stage, self.dp_rank = strategy.zero_stage, torch.distributed.get_rank()
        self.tokenizer = load_tokenizer(str(run_tokenizer_dir(recipe.data)), flag="data.sources' tokenizer")
        self.prompts = load_prompts(self.cfg, self.tokenizer, recipe.data.seq_len - self.cfg.max_new_tokens)
        chat = isinstance(self.prompts[0].prompt, list)
        self.stop_ids = end_of_turn_ids(self.tokenizer) if chat else [self.tokenizer.eos_token_id]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[-1]
        self.rewards = load_rewards(self.cfg.rewards)
        reference = _reference(recipe, engine.device) if self.cfg.beta != 0.0 else None
        self.runner = RLStep(engine, self.cfg, strategy.micro_batch, strategy.grad_accum, strategy.dp_size, reference)
        self.rollout: Rollout | None = None
        self.rollout_index = -1

    def train_step(self, batches: Iterator[dict]) -> torch.Tensor:
        start = time.perf_counter()
        step = self.rl_forward.progress.step
        index = step // self.cfg.iterations
        restored, self.rl_forward.restored_state = self.rl_forward.restored_state, None
        if restored is not None and restored["index"] == index and restored["world"] == self.strategy.dp_size:
            self.rollout_index, self.rollout, self.runner.old = from_state(restored, self.device)
        if index != self.rollout_index:
            self.components.on_mark("rollout")
            prompts = step_prompts(self.prompts, index, self.cfg.prompts_per_step, self.seed)
            self.rollout = rollout(self.engine.module, prompts, self.cfg, self.seed, index, self.rewards,
                                   self._detokenize, self.stop_ids, self.pad_id, self.zero_stage, self.dp_rank,
                                   self.strategy.dp_size)  # fmt: skip
            self.rollout_index, self.runner.old = index, []
        assert self.rollout is not None
        self.components.on_mark("the RL step's forwards and backwards")
        result = self.runner.step(self.rollout, step % self.cfg.iterations)
        self.learned_tokens = self.rollout.counts.tokens
        if self.cfg.iterations > 1:
            self.rl_forward.rollout_state = to_state(index, self.rollout, self.runner.old, self.strategy.dp_size)
        fresh = step % self.cfg.iterations == 0
        self.rl_forward.step_records.append(self._record(result, time.perf_counter() - start, fresh))
        return torch.tensor(result.loss, device=self.device)

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _record(self, result: StepResult, seconds: float, fresh: bool) -> dict:
        """The step's metrics (every rank holds the same, but the times)."""
        out = self.rollout
        assert out is not None
        tokens = max(result.sums["tokens"], 1.0)
        record = {
            "reward": out.weighted.mean().item(),
            "reward_std": out.weighted.std().item(),
            "zero_spread_groups": out.zero_spread.float().mean().item(),
            "completion_length": out.lengths.mean().item(),
            "truncated": 1.0 - out.stopped.float().mean().item(),
            "entropy": result.sums["entropy"] / tokens,
            "clip_ratio_low": result.sums["clip_low"] / tokens,
            "clip_ratio_high": result.sums["clip_high"] / tokens,
            "generation_share": out.seconds / seconds if fresh else 0.0,
        }
        if self.cfg.beta != 0.0:
            record["kl"] = result.sums["kl"] / tokens
        for i, reward in enumerate(self.rewards):
            name = reward.path.rpartition(":")[2]
            record[f"reward/{name}"] = out.rewards[:, i].mean().item()
            record[f"reward_std/{name}"] = out.rewards[:, i].std().item()
        return record


def _reference(recipe, device) -> torch.nn.Module:
    """init_from's weights as a plain GPT on this rank, frozen: the KL term's reference (beta > 0)."""
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.model.gpt import GPT

    if recipe.init_from is None:
        raise DstrainError("rl.beta > 0 needs a reference: set init_from (the model the KL term is measured to)")
    config, state, _ = load_model_source(recipe.init_from)
    model = GPT(config)
    model.load_state_dict(state)
    return model.to(device).eval().requires_grad_(False)


class RLMetrics(Component):
    """Each train record's RL metrics: the mean over the interval's steps (docs/rl.md names each); with
    rl.iterations > 1, the rollout in training in each checkpoint, one file per rank."""

    def __init__(self, forward: RLForward, rank: int) -> None:
        self.forward, self.file = forward, f"rl_rollout.rank{rank}.pt"

    def rank_files(self) -> dict:
        return {} if self.forward.rollout_state is None else {self.file: self.forward.rollout_state}

    def load_files(self, tag_dir: Path) -> None:
        from dstrain.checkpoint import safe_load

        path = tag_dir / self.file
        self.forward.restored_state = safe_load.load(path) if path.is_file() else None

    def train_record_fields(self, progress: Progress, steps: int) -> dict:
        records, self.forward.step_records = self.forward.step_records, []
        if not records:
            return {}
        keys = records[-1].keys()
        return {f"rl/{k}": sum(r.get(k, 0.0) for r in records) / len(records) for k in keys}


def build(run: RunHandle) -> RLMetrics | None:
    return RLMetrics(run.forward, run.rank) if isinstance(run.forward, RLForward) else None
