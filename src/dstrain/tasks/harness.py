"""lm-evaluation-harness as the referee: its ``hf`` model scores an exported Hugging Face folder on the same items.

For each task a YAML is written that includes lm-eval's own definition of the format (``formats.HARNESS_TASKS``),
changing only where the documents come from (the task's .jsonl file, or its Hub dataset, subset and split), so the
prompts, choices, gold answers and metrics are lm-eval's code, not ours. lm-eval is an optional extra
(``pip install -e '.[harness]'``); training never imports it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from dstrain.config import TaskConfig
from dstrain.errors import DstrainError
from dstrain.tasks.formats import HARNESS_TASKS
from dstrain.tasks.loading import is_local


def lm_eval_tasks_dir() -> Path:
    try:
        import lm_eval
    except ImportError:
        raise DstrainError(
            "--harness needs lm-evaluation-harness; install it with pip install -e '.[harness]'"
        ) from None
    return Path(lm_eval.__file__).parent / "tasks"


def harness_name(task: TaskConfig) -> str:
    return f"dstrain_{task.name}"


def task_yaml(task: TaskConfig) -> dict:
    """lm-eval's definition of the task's format, reading the task's documents; every split but ``test`` off."""
    config: dict = {
        "include": str(lm_eval_tasks_dir() / HARNESS_TASKS[task.format]),
        "task": harness_name(task),
        "tag": [],
        "training_split": None,
        "validation_split": None,
        "test_split": "test",
        "fewshot_split": None,
    }
    if is_local(task.path):
        path = str(Path(task.path).expanduser().resolve())
        config.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {"test": path}})
    else:
        config.update(dataset_path=task.path, dataset_name=task.subset, test_split=task.split)
    return config


def run_harness(folder: str, tasks: list[TaskConfig], batch_size: int, device: str) -> dict:
    """lm-eval's ``hf`` model on ``folder`` (fp32), zero-shot, the first ``limit`` items of each task:
    ``{"task/<name>/acc": ..., "task/<name>/acc_norm": ..., "task/<name>/samples": n}`` and, under ``"items"``,
    each task's items, as lists of (context, continuation, log-likelihood, is_greedy) per request."""
    lm_eval_tasks_dir()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = HFLM(pretrained=folder, dtype="float32", batch_size=batch_size, device=device)
    metrics: dict = {}
    items: dict = {}
    with tempfile.TemporaryDirectory(prefix="dstrain-harness-") as folder_of_yamls:
        for task in tasks:
            Path(folder_of_yamls, f"{task.name}.yaml").write_text(yaml.safe_dump(task_yaml(task)))
        manager = TaskManager(include_path=folder_of_yamls, include_defaults=False)
        for task in tasks:
            name = harness_name(task)
            out = lm_eval.simple_evaluate(
                model=model, tasks=[name], task_manager=manager, limit=task.limit, log_samples=True, num_fewshot=0
            )
            if out is None:
                raise DstrainError(f"lm-eval returned no results for task {task.name!r}")
            scores = out["results"][name]
            samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
            metrics[f"task/{task.name}/acc"] = scores["acc,none"]
            if "acc_norm,none" in scores:
                metrics[f"task/{task.name}/acc_norm"] = scores["acc_norm,none"]
            metrics[f"task/{task.name}/samples"] = len(samples)
            items[task.name] = [
                [(*args, float(resp[0][0]), bool(resp[0][1])) for args, resp in zip(s["arguments"], s["resps"])]
                for s in samples
            ]
    return {**metrics, "items": items}
