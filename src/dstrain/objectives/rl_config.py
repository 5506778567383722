"""The RL objective's settings, a recipe's ``rl:`` section: online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO),
sampled by the policy itself (docs/rl.md). The losses are dstrain.train.objectives.online_rl.losses's. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from dstrain.ranges import Range

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


@dataclass
class RewardConfig:
    # `package.module:function` with TRL's signature: f(prompts, completions, **columns) -> list[float], one float per
    # completion; `columns` are the prompt dataset's other columns, one value per completion
    function: str
    weight: float = 1.0  # the reward is the weighted sum of the functions' rewards (TRL's reward_weights)


@dataclass
class RLConfig:
    # the prompts: a Hugging Face dataset id, a folder of one, or a .jsonl/.json/.parquet file
    prompts: str
    rewards: list[RewardConfig]  # one or more; each completion's reward is their weighted sum
    prompt_column: str = "prompt"  # text, or a list of {role, content} messages (rendered by the chat template)
    split: str = "train"  # the dataset split the prompts come from
    subset: str | None = None  # the dataset's configuration, where it has several (GSM8K: "main")
    prompt_suffix: str = ""  # appended to a text prompt (e.g. how to write the final answer)
    as_user_message: bool = False  # a text prompt becomes one user message, rendered by the chat template
    group_size: Annotated[int, Range(ge=2)] = 8  # completions sampled per prompt (TRL's num_generations)
    prompts_per_step: Annotated[int, Range(ge=1)] = 8  # prompts per optimizer step; x group_size = train.global_batch
    max_new_tokens: Annotated[int, Range(ge=1)] = 256  # a completion longer is truncated (counted in the metrics)
    temperature: Annotated[float, Range(gt=0)] = 1.0  # the sampling temperature; the log-probs are at it too
    top_k: Annotated[int, Range(ge=0)] = 0  # sample among the k most likely tokens; 0 = all
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0  # sample among the most likely tokens of this much mass; 1 = all
    # grpo: each completion's token mean, then the mean over completions; dr_grpo: the token sum over completions x
    # max_new_tokens (no length bias); dapo: the token sum over the step's completion tokens (TRL's default)
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    # advantages divided by the std of the rewards of the prompt's group ("group"), of the whole step ("batch"), or
    # not at all ("none", Dr. GRPO's advice)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    beta: Annotated[float, Range(ge=0)] = 0.0  # the KL term's weight, to init_from's weights; 0 = no reference
    epsilon: Annotated[float, Range(ge=0)] = 0.2  # the ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: Annotated[float, Range(ge=0)] | None = None  # DAPO's clip-higher; None = epsilon
    iterations: Annotated[int, Range(ge=1)] = 1  # optimizer steps on each batch of samples (TRL's num_iterations)

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
