"""bench_dpo.py's trainer part: the DPO step against the SFT step through dstrain's Trainer on the same pair folder,
and the reference pass against one epoch of training (bench_dpo.py's docstring says what each side runs). Also what
bench/gpu_features.py's preference part builds its pair folder and recipe with."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2  # steps of a block that are not timed


@dataclasses.dataclass
class Seconds:
    wall: float
    cpu: float  # the process's CPU time


def pair_folder(tmp: Path, docs: int = 300, max_pairs: int | None = None) -> Path:
    """The stdlib pairs prepared with a BPE tokenizer trained on ``docs`` stdlib documents, under role-lines."""
    from dstrain.data.chat_corpus import write_pair_corpus
    from dstrain.data.corpus import write_stdlib_corpus
    from dstrain.data.prepare import prepare

    write_stdlib_corpus(tmp / "docs.jsonl", max_docs=docs)
    prepare(str(tmp / "docs.jsonl"), str(tmp / "docs"), train_tokenizer=512, num_proc=1, progress=False)
    write_pair_corpus(tmp / "pairs.jsonl", max_examples=max_pairs)
    template = ROOT / "recipes" / "chat_templates" / "role-lines.jinja"
    prepare(
        str(tmp / "pairs.jsonl"), str(tmp / "pairs"), tokenizer=str(tmp / "docs" / "tokenizer"), chat=True,
        chat_template=str(template), num_proc=1, progress=False,
    )  # fmt: skip
    return tmp / "pairs"


def reference_folder(tmp: Path, pairs: Path, n_layer: int = 4, d_model: int = 128) -> Path:
    """init_from: a random Llama of the tiny recipe's shape (4 blocks, d 128), as a Hugging Face folder."""
    import torch

    from dstrain.data.manifest import read_manifest
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model

    vocab = -(-read_manifest(pairs).vocab_size // 64) * 64
    config = GPTConfig(flavour="llama", n_layer=n_layer, n_head=4, n_kv_head=2, d_model=d_model, vocab_size=vocab)
    torch.manual_seed(3)
    to_hf_model(config, GPT(config).state_dict()).save_pretrained(tmp / "reference")
    return tmp / "reference"


def dpo_recipe(pairs: Path, reference: Path, run_dir: Path, steps: int, ds_file: Path, micro: int, seq: int = 128):
    """(recipe, strategy): recipes/dpo-tiny.yaml on ``pairs`` from ``reference``, ``steps`` steps of ``seq``-token
    samples, no checkpoint or evaluation inside them; a world of one."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, resolve

    overrides = [
        f"init_from={reference}", f"data.sources=[{{path: {pairs}}}]", f"run_dir={run_dir}", f"train.steps={steps}",
        "train.log_interval=1", f"train.eval_interval={steps + 1}", f"train.checkpoint_interval={steps + 1}",
        "schedule.warmup_steps=1", f"data.seq_len={seq}",
    ]  # fmt: skip
    recipe = load_recipe_and_source(ROOT / "recipes" / "dpo-tiny.yaml", overrides)[0]
    raw = load_ds_config(ds_file)
    raw["train_micro_batch_size_per_gpu"] = micro
    return recipe, resolve(recipe, "recipe", raw, ds_file, 1)


def as_sft(recipe):
    """The same recipe without ``preference:``: the SFT step on the same samples (both completions learned). Built
    straight into a Trainer: the CLI refuses a pair folder under a recipe that is not a preference one."""
    return dataclasses.replace(recipe, preference=None)


def trainer(recipe, strategy, run_dir: Path):
    """A Trainer as dstrain.train.run builds one (the reference pass, if any, runs here), with a list its train
    steps' (wall, CPU) seconds are appended to: on a shared machine the process's CPU time is what load moves least."""
    from dstrain.checkpoint.model_source import model_source
    from dstrain.run_dir import RunDir
    from dstrain.train.engine.build import build_engine, build_model
    from dstrain.train.loop import Trainer
    from dstrain.train.run import training_data

    run_dir.mkdir(parents=True, exist_ok=True)
    train, valid = training_data(recipe)
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    source = model_source(recipe.init_from) if recipe.init_from else None
    built = Trainer(
        recipe, strategy, engine, train, valid, RunDir(run_dir), data_fingerprint="bench", model_source=source
    )
    built.step_seconds = []
    train_step = built.train_step

    def timed(batches):
        synchronize()
        start = time.perf_counter(), time.process_time()
        loss = train_step(batches)
        synchronize()
        built.step_seconds.append((time.perf_counter() - start[0], time.process_time() - start[1]))
        return loss

    built.train_step = timed
    return built


def timed_block(recipe, strategy, run_dir: Path, reference: bool = False) -> tuple[Seconds, Seconds | None]:
    """The median (wall, CPU) seconds of Trainer.fit's train_step past the warm-up; with ``reference``, also those of
    its reference pass before step 1, with no kept scores (deleted first: it computes them and keeps them again)."""
    from dstrain.train.objectives.preference.steps import PreferenceMetrics

    if reference:
        shutil.rmtree(Path(recipe.data.sources[0].path) / "reference_scores", ignore_errors=True)
    built = trainer(recipe, strategy, run_dir)
    passes: list[Seconds] = []
    for component in built.components.members:
        if isinstance(component, PreferenceMetrics):
            component.on_train_start = timed_pass(component.on_train_start, passes)  # type: ignore[method-assign]
    built.fit()
    timed = built.step_seconds[WARMUP:]
    step = Seconds(statistics.median(w for w, _ in timed), statistics.median(c for _, c in timed))
    return step, (passes[0] if reference else None)


def timed_pass(on_train_start, passes: list[Seconds]):
    """``on_train_start`` (the reference pass), its seconds appended to ``passes``."""

    def timed() -> None:
        synchronize()
        start = time.perf_counter(), time.process_time()
        on_train_start()
        synchronize()
        passes.append(Seconds(time.perf_counter() - start[0], time.process_time() - start[1]))

    return timed


def synchronize() -> None:
    """Wait for the device's queued work (a GPU's kernels run behind the host)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def epoch_steps(recipe) -> float:
    """Optimizer steps in one epoch of the train split's pairs."""
    from dstrain.data.dataset import build_dataset

    d = recipe.data
    one = build_dataset([(d.sources[0].path, 1.0)], "train", d.seq_len, recipe.seed, None, d.valid_fraction,
                        overlong=d.overlong)  # fmt: skip
    return len(one) / recipe.train.global_batch


def trainer_part(args) -> dict:
    """Prints the figures and returns them (bench_dpo.py --json writes them: the GPU check's preference part)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dstrain.train.process import distributed

    distributed.init()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        pairs = args.pair_folder or pair_folder(tmp, max_pairs=args.pairs)
        reference = reference_folder(tmp, pairs, args.layers, args.d_model)
        config = ROOT / "ds_configs" / "zero1.json"
        recipe, strategy = dpo_recipe(pairs, reference, tmp / "run", args.steps, config, 8, args.seq_len)
        steps = epoch_steps(recipe)
        sft, dpo, passes = [], [], []
        for block in range(args.blocks):  # SFT, DPO and its reference pass, SFT, ...: background load hits all alike
            sft.append(timed_block(as_sft(recipe), strategy, tmp / f"sft{block}")[0])
            step, seconds = timed_block(recipe, strategy, tmp / f"dpo{block}", reference=True)
            dpo.append(step)
            passes.append(seconds)
    tokens = recipe.train.global_batch * recipe.data.seq_len
    print(f"dpo-tiny's recipe on a llama of {args.layers} blocks, d_model {args.d_model}: "
          f"{recipe.train.global_batch} x {recipe.data.seq_len} tokens a step ({tokens}), ZeRO-1 fp32, micro-batch 8, "
          f"one rank; median of {args.blocks} blocks of {args.steps - WARMUP} steps (range)")  # fmt: skip
    figures: dict = {"tokens_per_step": tokens, "epoch_steps": steps}
    for clock in ("wall", "cpu"):
        ratios = [getattr(d, clock) / getattr(s, clock) for d, s in zip(dpo, sft)]
        epochs = [steps * getattr(d, clock) for d in dpo]
        per_epoch = [getattr(p, clock) / e for p, e in zip(passes, epochs)]
        figures[clock] = {
            "sft_step_s": statistics.median(getattr(s, clock) for s in sft),
            "dpo_step_s": statistics.median(getattr(d, clock) for d in dpo),
            "dpo_over_sft": statistics.median(ratios),
            "reference_pass_s": statistics.median(getattr(p, clock) for p in passes),
            "epoch_s": statistics.median(epochs),
            "reference_over_epoch": statistics.median(per_epoch),
        }
        f = figures[clock]
        print(f"{clock:>4}: SFT step {f['sft_step_s'] * 1e3:.1f} ms, DPO step {f['dpo_step_s'] * 1e3:.1f} ms: DPO / "
              f"SFT {f['dpo_over_sft']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}; target <= 1.05); reference pass "
              f"{f['reference_pass_s']:.2f} s, epoch {f['epoch_s']:.2f} s ({steps:.1f} steps x the block's DPO step): "
              f"reference / epoch {f['reference_over_epoch']:.3f} "
              f"({min(per_epoch):.3f}-{max(per_epoch):.3f})")  # fmt: skip
    return figures
