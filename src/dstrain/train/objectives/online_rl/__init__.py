"""Online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO; a recipe's rl:, dstrain.objectives.online_rl,
docs/rl.md): the rollout by the policy's own KV-cache decode, the rewards, the losses, the step and its metrics."""

from __future__ import annotations

from dstrain.train.objectives.online_rl import training
from dstrain.train.objectives.training import ObjectiveTraining

TRAINING = ObjectiveTraining(forward=training.RLForward, step=training.RLTrainStep, components=(training.build,))
