"""The language-model loss (pretraining on text, SFT on conversations with a loss mask): the default objective, chosen
when a recipe sets no other objective's section. Its torch side: dstrain.train.objectives.language_model (the shared
ModelForward and TrainStep of dstrain.train.step)."""

from __future__ import annotations

from dstrain.objectives.objective import Objective

OBJECTIVE = Objective(
    name="language_model",
    training="dstrain.train.objectives.language_model",
    section=None,
    data_kinds=frozenset({"text", "chat"}),
    chosen_by="the language-model loss (a recipe without an objective's section; data.sft for conversations)",
)
