"""`dstrain eval`: loss and perplexity of a run's checkpoint or a Hugging Face model over a prepared split.

    dstrain eval runs/tiny                              # the run's valid split, exactly as its trainer evaluates
                                                        #   (its data where the run's launch found it)
    dstrain eval runs/tiny --samples 32                 # the first 32 samples only (a run's train.eval_samples)
    dstrain eval hf/tiny --data data/pydocs --seq-len 256 --micro-batch 8
    torchrun --nproc_per_node 8 -m dstrain eval runs/gpt2-125m      # or: deepspeed --module dstrain eval ...
    dstrain eval hf/policy --data data/pairs --reference hf/sft     # pairs: the DPO loss and rewards (its objective's)

Samples, their split among ranks and the averaging are the trainer's: the one evaluator
(dstrain.train.step.evaluator.Evaluator) over the same forward (each rank takes every world-th sample;
token-weighted mean of the micro-batch losses, summed in float64 across ranks), so on a run it prints
the numbers the trainer logged. With several data sources each is evaluated on its own
(``--samples`` per source) under ``sources``, and ``loss`` is their data.sources-weighted mean, as the
trainer's ``valid`` record. Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.metrics_records import evaluation_summary, perplexity
from dstrain.model.config import GPTConfig
from dstrain.objectives.preference_config import LOSSES
from dstrain.options import declared_default, given
from dstrain.run_dir import RunDir

DEFAULT_MICRO_BATCH = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a run directory or a Hugging Face model folder")
    parser.add_argument("--data", help="a prepared folder (default for a run: its recipe's data.sources)")
    parser.add_argument("--split", default="valid", choices=("valid", "train"), help="default: valid")
    parser.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sample (default: the run's data.seq_len, or the Hugging Face model's maximum length)",
    )
    parser.add_argument("--micro-batch", type=int, help="samples per forward (default: the run's micro-batch, else 4)")
    parser.add_argument(
        "--samples",
        type=int,
        help="evaluate only the first N samples of each source, as a "
        "run with train.eval_samples=N does (default: the whole split)",
    )
    parser.add_argument("--seed", type=int, help="the data split's seed (default: the run's seed, else 1234)")
    parser.add_argument("--valid-fraction", type=float, help="default: the run's data.valid_fraction, else 0.01")
    parser.add_argument("--tag", help="checkpoint tag of a run (default: the newest complete)")
    pairs = parser.add_argument_group("preference pairs (--data a pair folder; docs/preference-tuning.md)")
    pairs.add_argument(
        "--reference", metavar="DIR", help="the reference model (the policy's init_from): a run or folder"
    )
    pairs.add_argument("--loss", choices=LOSSES, help="the preference loss (default: sigmoid)")
    pairs.add_argument("--beta", type=float, help="the preference loss's beta (default: 0.1)")
    parser.add_argument(
        "--tasks",
        nargs="?",
        const="",
        metavar="YAML",
        help="score downstream tasks instead of the loss: with no value the run's train.tasks, else a YAML file "
        "holding a list of tasks in train.tasks' form (docs/evaluation.md)",
    )
    parser.add_argument(
        "--harness",
        action="store_true",
        help="with --tasks, on a Hugging Face folder: score with lm-evaluation-harness's hf model instead "
        "(pip install -e '.[harness]')",
    )


def main(args: argparse.Namespace) -> int:
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch), ("--samples", args.samples)):
        if value is not None and value <= 0:  # before anything is read; the run's own values are validated
            raise DstrainError(f"{flag} {value}: must be positive")
    if args.tasks is not None:
        result = evaluate_tasks(args)
    elif args.harness:
        raise DstrainError("--harness scores downstream tasks: add --tasks [YAML]")
    else:
        result = evaluate(args)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(json.dumps(result), flush=True)
    return 0


def evaluate(args: argparse.Namespace) -> dict:
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.config import DataConfig
    from dstrain.data.dataset import build_valid_sets
    from dstrain.model.gpt import GPT
    from dstrain.train.process import distributed

    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch), ("--samples", args.samples)):
        if value is not None and value <= 0:  # before anything is read; the run's own values are validated
            raise DstrainError(f"{flag} {value}: must be positive")
    if args.data and (own := _objectives_evaluation(args.data)):  # e.g. pairs: the preference loss and rewards
        return own(args)
    run = RunDir.find(args.model)
    sources = [(args.data, 1.0)] if args.data else None
    if run:  # before the checkpoint is read
        from dstrain.recipe_file import load_recipe

        run_recipe = load_recipe(run.recipe)
        if args.data:
            _check_run_tokenizer(args.data, run, run_recipe)
        else:
            sources = _run_sources(run, run_recipe)
    config, state, recipe = load_model_source(args.model, args.tag)
    if recipe is None and not args.data:
        raise DstrainError(f"{args.model} is a Hugging Face model folder; name the prepared data with --data DIR")
    seed = given(args.seed, recipe and recipe.seed, declared_default(Recipe, "seed"))
    valid_fraction = given(
        args.valid_fraction, recipe and recipe.data.valid_fraction, declared_default(DataConfig, "valid_fraction")
    )
    seq_len = given(args.seq_len, recipe and recipe.data.seq_len, config.max_seq_len)
    micro = given(args.micro_batch, recipe and _run_micro_batch(Path(args.model)), DEFAULT_MICRO_BATCH)
    assert sources is not None  # a run names its data, a Hugging Face folder needs --data (refused above)
    _check_data(sources[0][0], args.model, config, recipe)
    config = _masked_where_packed_whole(config, sources)
    if config.position_limit and seq_len > config.position_limit:
        raise DstrainError(f"--seq-len {seq_len} exceeds the model's {config.position_limit} positions; lower it")
    overlong = recipe.data.overlong if recipe is not None else declared_default(DataConfig, "overlong")
    sets = build_valid_sets(sources, seq_len, seed, valid_fraction, split=args.split, overlong=overlong)

    distributed.init()
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    model = GPT(config)
    model.load_state_dict(state, strict=True)
    model.to(device).eval()
    evals = _evaluator(model, device, micro).sources(sets, args.samples)
    if any(e.tokens == 0 for e in evals):
        raise DstrainError(f"the {args.split} split holds no samples to evaluate")
    return _result(args, evals)


def _result(args: argparse.Namespace, evals: list) -> dict:
    """The whole evaluation's loss, perplexity and tokens, and each source's where there are several."""
    losses = [e.loss for e in evals]
    tokens = sum(e.tokens for e in evals)
    result = {"model": str(args.model), "split": args.split, **evaluation_summary(losses), "tokens": tokens}
    if len(losses) == 1:
        return result
    result["sources"] = {
        e.loss.name: {
            "weight": e.loss.weight, "samples": e.loss.samples, "tokens": e.tokens, "loss": e.loss.loss,
            "ppl": perplexity(e.loss.loss),
        }
        for e in evals
    }  # fmt: skip
    return result


def _objectives_evaluation(folder: str):
    """The evaluation of its own of the objective that trains on ``folder``'s kind of data, None for the LM loss."""
    from dstrain.data.manifest import read_manifest
    from dstrain.train.objectives.training import evaluation_of

    return evaluation_of(read_manifest(folder).kind)


def _masked_where_packed_whole(config: GPTConfig, sources: list[tuple[str, float]]) -> GPTConfig:
    """The model reads data whose documents are packed whole (--chat) with document masking and restarting positions,
    whatever its own config says (a Hugging Face folder's never does): each conversation's loss is its loss alone,
    not one that depends on --seq-len, --micro-batch or its neighbours."""
    import dataclasses

    from dstrain.data.chat_packing import packs_whole
    from dstrain.data.manifest import read_manifest

    if config.doc_masking or not any(packs_whole(read_manifest(folder)) for folder, _ in sources):
        return config
    return dataclasses.replace(config, doc_masking=True)


def _evaluator(model, device, micro: int):
    """The trainer's evaluator on a plain model, each rank one data-parallel replica."""
    from dstrain.train.step.evaluator import Evaluator
    from dstrain.train.step.forward import ModelForward

    runner = ModelForward.of_module(model, device, model.config.doc_masking)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return Evaluator(runner, rank, world, micro, model.config.max_seq_len)


def evaluate_tasks(args: argparse.Namespace) -> dict:
    """``--tasks``: the scorer of the training loop (dstrain.tasks.scoring) on a plain model, each rank one
    data-parallel replica; with ``--harness``, lm-evaluation-harness's hf model on the Hugging Face folder."""
    from dstrain.errors import naming_files
    from dstrain.tasks.loading import load_tasks

    tasks, where = _task_configs(args)
    with naming_files(tasks=where):
        items = load_tasks(tasks)  # every task file checked before the model is read
    if args.harness:
        return _harness(args, tasks)
    from dstrain.checkpoint.consolidate import load_model_source
    from dstrain.data.tokenizer import load_run_tokenizer, load_tokenizer
    from dstrain.model.gpt import GPT
    from dstrain.tasks import scoring
    from dstrain.train.process import distributed

    config, state, recipe = load_model_source(args.model, args.tag)
    tokenizer = load_run_tokenizer(args.model) if recipe else load_tokenizer(args.model, flag="the model folder")
    micro = given(args.micro_batch, recipe and _run_micro_batch(Path(args.model)), DEFAULT_MICRO_BATCH)
    if micro <= 0:
        raise DstrainError(f"--micro-batch {micro}: must be positive")
    distributed.init()
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    model = GPT(config)
    model.load_state_dict(state, strict=True)
    model.to(device).eval()
    metrics = _evaluator(model, device, micro).tasks(scoring.prepare(items, tokenizer, config.max_seq_len))
    return {"model": str(args.model), **metrics}


def _task_configs(args: argparse.Namespace) -> tuple[list, str]:
    """(the tasks, the file that names them): --tasks YAML, else the run's recipe's train.tasks."""
    from dstrain.config import TaskConfig
    from dstrain.recipe_file import load_recipe
    from dstrain.typed_yaml import coerce, read_yaml_file

    if args.tasks:
        path = Path(args.tasks)
        if not path.is_file():
            raise DstrainError(f"--tasks {path}: no such file; pass a YAML list of tasks, or --tasks alone for a run's")
        tasks = read_yaml_file(path, "pass a YAML list of tasks in train.tasks' form")
        return coerce(list[TaskConfig], tasks, path, "tasks"), str(path)
    run = RunDir.find(args.model)
    if run is None:
        raise DstrainError(f"--tasks alone: {args.model} is not a run with train.tasks; pass --tasks FILE.yaml")
    recipe = load_recipe(run.recipe)
    if not recipe.train.tasks:
        raise DstrainError(f"{run.recipe} lists no train.tasks; pass --tasks FILE.yaml")
    return recipe.train.tasks, str(run.recipe)


def _harness(args: argparse.Namespace, tasks: list) -> dict:
    from importlib.metadata import version

    from dstrain.tasks.harness import run_harness

    if not (Path(args.model) / "config.json").is_file():
        raise DstrainError(
            f"--harness scores a Hugging Face folder; export {args.model} first (dstrain export {args.model} --out DIR)"
        )
    from deepspeed.accelerator import get_accelerator

    micro = given(args.micro_batch, DEFAULT_MICRO_BATCH)
    result = run_harness(str(args.model), tasks, micro, get_accelerator().current_device_name())
    result.pop("items")  # each request's log-likelihood: for tests/test_tasks.py, not for the console
    return {"model": str(args.model), "harness": f"lm-evaluation-harness {version('lm_eval')}", **result}


def _check_data(folder: str, model: str, config: GPTConfig, recipe: Recipe | None) -> None:
    from dstrain.data.manifest import read_manifest
    from dstrain.data.tokenizer import verify_tokenizer

    manifest = read_manifest(folder)
    vocab = manifest.vocab_size
    if vocab > config.vocab_size:
        raise DstrainError(
            f"--data {folder} has {vocab} token ids, the model {model} only {config.vocab_size}; "
            f"pass data prepared with the model's tokenizer"
        )
    if recipe is None and (Path(model) / "tokenizer_config.json").is_file():
        verify_tokenizer(manifest, folder, model)


def _check_run_tokenizer(folder: str, run: RunDir, recipe) -> None:
    """--data was prepared with the run's tokenizer: equal vocabulary sizes are no proof, hashes are."""
    from dstrain.data.manifest import read_manifest, same_tokenizer
    from dstrain.data.tokenizer import load_run_tokenizer, tokenizer_hash

    ours = tokenizer_hash(load_run_tokenizer(run.root))
    fix = f"prepare it with --tokenizer {run.tokenizer}"
    same_tokenizer(read_manifest(folder), f"--data {folder}", ours, f"the run {run.root}", fix)


def _run_sources(run: RunDir, recipe) -> list[tuple[str, float]]:
    """The run's data sources where its launch found them (a relative path meant: relative to where it was
    launched)."""
    from dstrain.data.manifest import MANIFEST_NAME
    from dstrain.run_dir import LaunchRecord

    launch = LaunchRecord.read(run.recipe).paths
    sources = []
    for i, source in enumerate(recipe.data.sources):
        at_launch = launch.get(f"data.sources[{i}].path")
        found = next((c for c in (at_launch, source.path) if c and Path(c, MANIFEST_NAME).is_file()), None)
        if found is None:
            where = f"{at_launch}, where the run was launched with {source.path}" if at_launch else source.path
            raise DstrainError(
                f"the data of run {run.root} is gone from {where}; pass --data <folder> (its new place, or other data "
                f"prepared with the run's tokenizer, {run.tokenizer})"
            )
        sources.append((found, source.weight))
    return sources


def _run_micro_batch(run_dir: Path) -> int | None:
    try:
        return json.loads(RunDir(run_dir).ds_config.read_text())["train_micro_batch_size_per_gpu"]
    except (OSError, ValueError, KeyError):
        return None
