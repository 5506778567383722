"""The prompts of an ``rl:`` recipe: a Hugging Face dataset (a Hub id, a folder saved by ``save_to_disk``, or a
.jsonl/.json/.parquet/.csv file) whose ``rl.prompt_column`` is text or a conversation (a list of {role, content},
rendered by the tokenizer's chat template up to the assistant's turn), its other columns passed to the rewards.

Rollout r takes the prompts at positions r x P .. (r + 1) x P - 1 of a stream of epochs, each a permutation of the
dataset's rows drawn from (recipe seed, epoch): the prompts of a step depend on the seed and the step only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dstrain.errors import DstrainError
from dstrain.train.objectives.online_rl.rollout import Prompt

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(source: str, split: str, subset: str | None = None):
    """The dataset ``rl.prompts`` names."""
    import datasets

    path = Path(source)
    try:
        if path.is_file():
            if path.suffix not in FILE_FORMATS:
                raise DstrainError(f"rl.prompts {source}: a file must be one of {', '.join(FILE_FORMATS)}")
            return datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train")
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()):
            return datasets.load_from_disk(str(path))
        return datasets.load_dataset(source, subset, split=split)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DstrainError(f"rl.prompts {source}: cannot load it ({str(e).splitlines()[0]}); fix the path") from None


def load_prompts(cfg, tokenizer, max_prompt_tokens: int) -> list[Prompt]:
    """Every row as a Prompt, tokenized; a row whose prompt is empty or longer than ``max_prompt_tokens`` (seq_len -
    max_new_tokens) is refused naming its index."""
    rows = load_rows(cfg.prompts, cfg.split, cfg.subset)
    if cfg.prompt_column not in rows.column_names:
        raise DstrainError(
            f"rl.prompts {cfg.prompts} has no column {cfg.prompt_column!r} (it has {', '.join(rows.column_names)}); "
            f"set rl.prompt_column"
        )
    others = [c for c in rows.column_names if c != cfg.prompt_column]
    prompts = []
    for index, row in enumerate(rows):
        prompt = row[cfg.prompt_column]
        if isinstance(prompt, str):
            prompt += cfg.prompt_suffix
            if cfg.as_user_message:
                prompt = [{"role": "user", "content": prompt}]
        ids = encode(tokenizer, prompt)
        if not ids or len(ids) > max_prompt_tokens:
            raise DstrainError(
                f"rl.prompts {cfg.prompts}: row {index}'s prompt has {len(ids)} tokens; it must have 1 to "
                f"{max_prompt_tokens} (data.seq_len - rl.max_new_tokens): raise data.seq_len or drop the row"
            )
        prompts.append(Prompt(index, ids, prompt, {c: row[c] for c in others}))
    return prompts


def encode(tokenizer, prompt) -> list[int]:
    """A text's tokens, or a conversation's rendered up to the assistant's turn."""
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    return tokenizer(prompt)["input_ids"]


def step_prompts(prompts: list[Prompt], rollout_index: int, per_step: int, seed: int) -> list[Prompt]:
    """The prompts of rollout ``rollout_index`` (module doc)."""
    n = len(prompts)
    orders: dict[int, np.ndarray] = {}
    out = []
    for position in range(rollout_index * per_step, (rollout_index + 1) * per_step):
        epoch, offset = divmod(position, n)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng((seed, epoch)).permutation(n)
        out.append(prompts[int(orders[epoch][offset])])
    return out
