"""Shared pieces of the trainer tests: a small recipe on the real corpus, and rank targets."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import yaml

from dstrain.metrics_records import EventRecord, MetricsRecord, read_records
from dstrain.metrics_records import read_events as read_event_records
from dstrain.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]


# Qwen3's features (q/k RMSNorm per head, a head width apart from d_model / n_head) with YaRN RoPE scaling (its
# attention factor scales cos and sin): the published family the strategy suites train beside plain llama.
QWEN3_MODEL = {
    "family": "qwen3",
    "qk_norm": "head",
    "d_head": 32,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


def small_recipe(folder: Path, corpus: Path, name: str = "small", **sections) -> Path:
    """A 2-block Llama-style model on the prepared stdlib corpus: 10 steps of 8 x 32 tokens."""
    recipe = {
        "name": name,
        "seed": 7,
        "model": {"flavour": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64},
        "data": {"sources": [{"path": str(corpus)}], "seq_len": 32, "valid_fraction": 0.05},
        "train": {"global_batch": 8, "steps": 10, "log_interval": 1, "eval_samples": 32, "keep_last": 2},
        "optim": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 2},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def ds_config(folder: Path, base: str, **changes) -> Path:
    """A shipped ds_config with top-level changes (e.g. a micro-batch), written next to the test's files."""
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    config.update(changes)
    path = folder / f"{base}-{'-'.join(f'{k}{v}' for k, v in changes.items()) or 'as-shipped'}.json"
    path.write_text(json.dumps(config))
    return path


def nvme_config(folder: Path, name: str = "zero3_nvme") -> Path:
    """fp32 ZeRO-Infinity for the tests: zero3.json with parameters and optimizer offloaded to ``folder/nvme``, and
    swap buffers sized to the small model (4 x 2^18 fp32 elements = 4 MiB pinned for the parameters, 4 sub-groups of
    at most 2^20 elements = 16 MiB for the optimizer) instead of the shipped config's 2 GB per rank."""
    config = json.loads((ROOT / "ds_configs" / "zero3_offload_nvme_bf16.json").read_text())
    config.pop("bf16")
    config.pop("data_types")
    config.pop("communication_data_type")
    config.pop("activation_checkpointing")
    zero = config["zero_optimization"]
    nvme = str(folder / "nvme-swap")
    zero["sub_group_size"] = 2**20
    zero["offload_optimizer"].update(nvme_path=nvme, buffer_count=4)
    zero["offload_param"].update(nvme_path=nvme, buffer_count=4, buffer_size=2**18)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def train_argv(recipe: Path, config: str | Path, run_dir: Path, *overrides: str) -> list[str]:
    """dstrain.train's arguments; ``config`` is a ds_config file or the name of a shipped one ("zero2")."""
    config = config if str(config).endswith(".json") else ROOT / "ds_configs" / f"{config}.json"
    return ["--recipe", str(recipe), "--deepspeed_config", str(config), f"run_dir={run_dir}", *overrides]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "split" not in r]


def read_metrics(run_dir: str | Path) -> list[MetricsRecord]:
    """Train and eval records; event records (a resume) are left to read_events."""
    return read_records(RunDir(Path(run_dir)).metrics)


def read_events(run_dir: str | Path) -> list[EventRecord]:
    return read_event_records(RunDir(Path(run_dir)).metrics)


def train(argv: list[str]) -> int:
    """Rank target: run dstrain.train once, in this process group."""
    from dstrain.train.run import main

    return main(argv)


def train_each(runs: list[list[str]]) -> list[int]:
    """Rank target: run dstrain.train once per argv, one after another, in this process group."""
    from dstrain.train.run import main

    return [main(argv) for argv in runs]


def train_and_signal_at(
    argv: list[str], step: int, signum: int = signal.SIGUSR1, rank: int = 0, times: int = 1, gap_s: float = 0.0
) -> int:
    """Rank target: train, with ``rank`` sending itself ``signum`` (``times`` times, ``gap_s`` apart) right after
    optimizer step ``step``."""
    from dstrain.train.run import main
    from dstrain.train.step.step_hooks import StepHooks

    class SignalAfterStep(StepHooks):
        def stepped(self, taken: int) -> None:
            if taken == step and int(os.environ["RANK"]) == rank:
                for i in range(times):
                    time.sleep(gap_s if i else 0.0)
                    os.kill(os.getpid(), signum)

    return main(argv, SignalAfterStep())


def enable_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator reports no fp16; the fp16 tests switch it on inside their own ranks."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        get_accelerator().is_fp16_supported = lambda: True


def train_fp16_with_overflows(argv: list[str], overflow_steps: set[int] | None) -> int:
    """Rank target: fp16 training where the loss of the given optimizer steps (1-based; None = all) is made inf."""
    from dstrain.train.run import main
    from dstrain.train.step.step_hooks import StepHooks

    class Overflows(StepHooks):
        def forward(self, step, batch, forward):
            loss = forward(batch)
            if overflow_steps is None or step in overflow_steps:
                loss = loss * float("inf")  # every gradient becomes inf/nan: an overflow
            return loss

    enable_fp16_on_cpu()
    return main(argv, Overflows())


def train_fp16_each(runs: list[tuple[list[str], set[int] | None]]) -> list[int]:
    """Rank target: ``train_fp16_with_overflows`` once per (argv, overflow steps), in this process group."""
    return [train_fp16_with_overflows(argv, steps) for argv, steps in runs]


def zero0_fp16_gradient_scale() -> float:
    """Rank target (world 1): ratio of the gradient after engine.backward to the true fp16 gradient."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT, lm_loss
    from dstrain.train.process import distributed

    enable_fp16_on_cpu()
    distributed.init()
    torch.manual_seed(0)
    device = get_accelerator().current_device_name()
    model = GPT(GPTConfig(flavour="llama", vocab_size=128, max_seq_len=16, n_layer=1, n_head=2, d_model=32))
    reference = GPT(model.config).half().to(device)
    reference.load_state_dict(model.state_dict())
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "fp16": {"enabled": True, "initial_scale_power": 10},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = torch.randint(0, 128, (2, 17)).to(device)
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
    lm_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    got = engine.module.lm_head.weight.grad.float()
    want = reference.lm_head.weight.grad.float()
    return (got.norm() / want.norm()).item()


def train_with_fault(argv: list[str], step: int, fault: str, rank: int | None = None) -> int:
    """Rank target: train, and at optimizer step ``step`` (on ``rank``, or every rank if None) inject ``fault``:
    "raise" (an exception), "nan" (the loss becomes NaN), "die-in-save" (the process dies inside
    save_checkpoint after DeepSpeed wrote its files, before dstrain publishes them)."""
    from dstrain.train.run import main
    from dstrain.train.step.step_hooks import StepHooks

    here = rank is None or int(os.environ["RANK"]) == rank

    class Fault(StepHooks):
        def forward(self, taking, batch, forward):
            loss = forward(batch)
            if here and taking == step:
                if fault == "raise":
                    raise ValueError(f"injected fault at step {step}")
                if fault == "nan":
                    loss = loss * float("nan")
            return loss

    if fault == "die-in-save":
        from deepspeed.runtime.engine import DeepSpeedEngine

        save = DeepSpeedEngine.save_checkpoint

        def save_then_die(self, save_dir, tag=None, **kwargs):
            result = save(self, save_dir, tag=tag, **kwargs)
            if here and tag == f"global_step{step}.partial":
                os._exit(9)
            return result

        DeepSpeedEngine.save_checkpoint = save_then_die
    return main(argv, Fault())


def poison(first: int, end: int, factor: float = 10.0):
    """StepHooks with samples [first, end) of the train stream poisoned: the loss of a micro-batch that holds one is
    multiplied by ``factor`` (and so are its gradients), wherever in the run that sample is read."""
    from dstrain.train.step.step_hooks import StepHooks

    class Poison(StepHooks):
        def train_batch(self, samples, batch):
            return {**batch, "poisoned": any(first <= i < end for i in samples)}

        def forward(self, step, batch, forward):
            loss = forward(batch)
            return loss * factor if batch.get("poisoned") else loss

    return Poison()


def train_with_poison(argv: list[str], first: int, end: int, factor: float = 10.0) -> int:
    """Rank target: train with samples [first, end) of the train stream poisoned (``poison``)."""
    from dstrain.train.run import main

    return main(argv, poison(first, end, factor))


def train_each_with_poison(runs: list[tuple[list[str], int, int]]) -> list[int]:
    """Rank target: ``train_with_poison`` once per (argv, first, end), one after another, in this process group."""
    from dstrain.train.run import main

    return [main(argv, poison(first, end)) for argv, first, end in runs]


def sleep_in_step(marker: str) -> None:
    """What a hung rank does: nothing, for ten minutes (the watchdog's stack names this function)."""
    Path(marker).write_text(str(time.time()))
    time.sleep(600)


def train_and_hang_at(argv: list[str], step: int, rank: int, marker: str) -> int:
    """Rank target: train, with ``rank`` hanging in the forward pass of optimizer step ``step`` (the time it began
    hanging written to ``marker``)."""
    from dstrain.train.run import main
    from dstrain.train.step.step_hooks import StepHooks

    class Hang(StepHooks):
        def forward(self, taking, batch, forward):
            if taking == step and int(os.environ["RANK"]) == rank:
                sleep_in_step(marker)
            return forward(batch)

    return main(argv, Hang())


def train_with_slow_writes(argv: list[str], seconds: float, signal_step: int | None = None) -> int:
    """Rank target: train with every background checkpoint write taking ``seconds`` longer (a slow filesystem);
    with ``signal_step``, rank 0 sends itself SIGTERM right after that optimizer step."""
    from dstrain.checkpoint.background import SnapshotEngine

    write_all = SnapshotEngine.write_all

    def slow_write_all(self):
        time.sleep(seconds)
        write_all(self)

    SnapshotEngine.write_all = slow_write_all
    if signal_step is not None:
        return train_and_signal_at(argv, signal_step, signal.SIGTERM, 0)
    from dstrain.train.run import main

    return main(argv)
