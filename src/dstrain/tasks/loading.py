"""A task's items: the first ``limit`` documents of a .jsonl file or a Hugging Face dataset split, in their order,
turned into requests by their format (``dstrain.tasks.formats``). Every problem is one line naming the file, the
task and the fix, raised before any model is built."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from dstrain.config import TaskConfig
from dstrain.errors import InputError
from dstrain.tasks.formats import FORMATS, Item

KEYS = {
    "hellaswag": "activity_label, ctx_a, ctx_b, endings, label",
    "arc": "question, choices {text, label}, answerKey",
    "piqa": "goal, sol1, sol2, label",
    "winogrande": "sentence (with one _), option1, option2, answer",
    "lambada": "text",
}


def is_local(path: str) -> bool:
    return path.endswith((".jsonl", ".json")) or Path(path).exists() or path.startswith((".", "/", "~"))


def load_items(task: TaskConfig) -> list[Item]:
    """The task's items; a problem is an InputError of the "tasks" input, whose file (the recipe, or the --tasks
    YAML) the check phase names (dstrain.errors.naming_files)."""
    label = f"task {task.name!r}"
    if is_local(task.path):
        docs = _file_docs(Path(task.path).expanduser(), task.limit, label)
    else:
        docs = _hub_docs(task, label)
    items = []
    for number, doc in docs:
        try:
            item = FORMATS[task.format](doc)
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
            raise InputError(
                f"{label}: {task.path} item {number} is not in the {task.format} format ({type(e).__name__}: {e}); "
                f"each item needs {KEYS[task.format]}",
                input="tasks",
            ) from None
        if not 0 <= item.gold < len(item.requests):
            raise InputError(
                f"{label}: {task.path} item {number}: its answer is not one of its {len(item.requests)} choices",
                input="tasks",
            )
        items.append(item)
    if not items:
        raise InputError(f"{label}: {task.path} holds no items; point path at a file with at least one", input="tasks")
    return items


def _file_docs(path: Path, limit: int | None, label: str) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise InputError(
            f"{label}: no file {path}; set path to a .jsonl file or a Hugging Face dataset id", input="tasks"
        )
    docs: list[tuple[int, dict]] = []
    number = 0
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if limit is not None and len(docs) == limit:
                    break
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as e:
                    problem = f"{path} line {number} is not JSON ({e})"
                    raise InputError(f"{label}: {problem}; write one object per line", input="tasks") from None
                docs.append((number, doc))
    except UnicodeDecodeError:
        raise InputError(
            f"{label}: {path} line {number + 1} is not UTF-8 text; write one JSON object per line", input="tasks"
        ) from None
    return docs


def _hub_docs(task: TaskConfig, label: str) -> list[tuple[int, dict]]:
    import datasets

    try:
        data = datasets.load_dataset(task.path, task.subset, split=task.split)
    except Exception as e:  # noqa: BLE001  (the Hub's and datasets' many failures: all mean "cannot read it")
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{label}: the Hugging Face dataset {task.path} (subset {task.subset}, split {task.split}) could not "
            f"be read: {reason}; download it first, or point path at a .jsonl file",
            input="tasks",
        ) from None
    return list(enumerate(itertools.islice(iter(data), task.limit), start=1))


def load_tasks(tasks: list[TaskConfig]) -> list[tuple[str, list[Item]]]:
    return [(task.name, load_items(task)) for task in tasks]
