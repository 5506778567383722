"""The recipe: a typed, documented description of one experiment.

A recipe (YAML) owns the math of a run: model, data, global batch, optimiser
hyper-parameters, LR schedule, length and cadence. How the run is executed
(ZeRO stage, precision, micro-batch, offload, parallelism) belongs to the
ds_config and is resolved against the recipe in ``strategy/resolve.py``.

Every field can be overridden on the command line as ``section.key=value``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from dstrain.adapters.config import LoraConfig
from dstrain.model.config import GPTConfig
from dstrain.objectives.preference_config import PreferenceConfig
from dstrain.objectives.rl_config import RLConfig
from dstrain.ranges import NonEmpty, Range

Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]
Beta = Annotated[float, Range(ge=0, lt=1)]


@dataclass
class DataSource:
    path: str  # a folder written by `dstrain prepare`
    weight: Annotated[float, Range(ge=0)] = 1.0  # relative sampling weight when blending (0: only in later stages)
    max_epochs: Annotated[float, Range(gt=0)] | None = (
        None  # most passes over this source's train split (OLMo-core's max_repetition_factor); None = no cap
    )


@dataclass
class DataStage:
    """From its start on (exactly one of start_step, start_tokens, start_fraction), the run samples the sources by
    ``weights`` instead; stages apply in order. A step boundary: a stage starts with a whole global batch."""

    weights: list[Annotated[float, Range(ge=0)]]  # one per data.sources entry, in that order; 0 leaves a source out
    start_step: Annotated[int, Range(ge=1)] | None = None  # the first step (counted from 1) of this stage
    start_tokens: Annotated[int, Range(ge=1)] | None = None  # the first step whose consumed tokens reach this
    start_fraction: Annotated[float, Range(gt=0, lt=1)] | None = None  # after this fraction of the steps (as wsd)


@dataclass
class DataConfig:
    sources: list[DataSource]  # prepared folders and their blending weights (those of the first stage)
    seq_len: Positive  # tokens per training sample (the model sees seq_len inputs, predicts seq_len labels)
    tokenizer: Annotated[str, NonEmpty("name a tokenizer folder, or remove the key")] | None = (
        None  # tokenizer folder; None = the first source's `tokenizer/`; must match every manifest
    )
    valid_fraction: Annotated[float, Range(gt=0, lt=1)] = (
        0.01  # fraction of documents held out for the valid split (document-level, seeded)
    )
    stages: list[DataStage] = field(default_factory=list)  # later mixtures (e.g. an anneal on high-quality data)
    sft: bool = False  # instruction tuning: some sources are `dstrain prepare --chat` folders, whose loss mask says
    # which tokens are learned (text sources mixed in learn every token); false refuses --chat folders
    overlong: Literal["truncate", "drop"] = "truncate"  # a --chat conversation longer than seq_len + 1 tokens: cut
    # to it (its tail is not learned) or left out (dstrain.data.chat_packing)


@dataclass
class MuonConfig:
    """Muon (optim.kind: muon), run by DeepSpeed's MuonWithAuxAdam. Which parameters go where is DeepSpeed's rule
    (deepspeed.set_optimizer_flags): every parameter of 2 or more dimensions whose name holds neither "embed" nor
    "lm_head" (the blocks' attention and MLP matrices) takes Muon; the embeddings, the head, norms and biases take
    AdamW with optim.lr, betas and eps. Both decay their matrices by optim.weight_decay (decoupled: w -= lr x wd x w);
    both lrs follow the recipe's schedule. Clipping (optim.grad_clip) scales the raw gradient by its global norm
    before Muon's momentum and Newton-Schulz see it, under every accepted strategy."""

    lr: Annotated[float, Range(gt=0)] = 0.02  # the Muon group's peak lr, in units of spectral norm per update
    momentum: Beta = 0.95  # momentum of the gradient buffer that Newton-Schulz orthogonalises
    nesterov: Literal[True] = True  # Nesterov momentum: DeepSpeed 0.19.8's call sites always use it (no switch)
    ns_steps: Annotated[int, Range(ge=5, le=5)] = 5  # Newton-Schulz iterations: fixed at 5 by DeepSpeed 0.19.8
    ns_method: Literal["gram", "standard"] = (
        "gram"  # Newton-Schulz on the Gram matrix (fp16 where the device has it, else fp32) or the original (bf16)
    )


@dataclass
class OptimConfig:
    kind: Literal["adamw", "muon"] = "adamw"  # the optimizer; muon: Muon for hidden matrices + AdamW (optim.muon)
    lr: Annotated[float, Range(gt=0)] = 3e-4  # peak learning rate, reached at the end of warmup
    min_lr: Annotated[float, Range(ge=0)] = 3e-5  # learning rate at the end of the decay
    betas: tuple[Beta, Beta] = (0.9, 0.95)  # Adam betas
    eps: Annotated[float, Range(gt=0)] = 1e-8  # Adam epsilon
    weight_decay: Annotated[float, Range(ge=0)] = (
        0.1  # decoupled weight decay, applied to matrices only (not to norms, biases)
    )
    grad_clip: Annotated[float, Range(ge=0)] = 1.0  # global gradient-norm clipping; 0 disables
    muon: MuonConfig = field(default_factory=MuonConfig)  # optim.kind: muon only


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "linear", "wsd"] = "cosine"  # decay after warmup; wsd = warmup-stable-decay
    warmup_steps: NonNegative = 0  # linear warmup: update s (from 0) uses optim.lr * s / warmup_steps
    decay_fraction: Annotated[float, Range(ge=0, le=1)] = (
        0.2  # wsd only: the final fraction of steps that decays linearly to min_lr
    )


@dataclass
class SpikeGuardConfig:
    """Loss-spike rollback (dstrain.train.features.spike_guard). A spike: the step's ``metric`` above ``factor`` x the
    median of
    its last ``window`` values (a median, not a mean: one earlier spike or a slow drift does not move it). Then every
    rank reloads the newest complete checkpoint, skips the global batches from its consumed_samples through the spiking
    step, and goes on; more than ``max_rollbacks`` spikes within ``rollback_window`` steps stop the run."""

    enabled: bool = False  # off: no statistic is kept and nothing is ever rolled back
    metric: Literal["loss", "grad_norm"] = "loss"  # the step's mean loss, or its pre-clip global gradient norm
    window: Annotated[int, Range(ge=3)] = 50  # steps in the running median; the guard waits until it is full
    factor: Annotated[float, Range(gt=1)] = 2.0  # a spike: metric > factor x median of the last `window` steps
    max_rollbacks: Positive = 3  # more spikes than this within rollback_window steps stop the run with one line
    rollback_window: Positive = 1000  # steps (by spiking step) over which max_rollbacks counts
    lr_factor: Annotated[float, Range(gt=0, le=1)] = 1.0  # the lr is multiplied by this for lr_steps after a rollback
    lr_steps: NonNegative = 0  # steps of lowered lr after a rollback; 0 = none


@dataclass
class WatchdogConfig:
    """Hang watchdog (dstrain.train.features.watchdog): a step running longer than ``factor`` x the median step time
    (after
    ``warmup_steps``), kept within [floor_s, ceiling_s], dumps every thread's stack to run_dir/hang/rank<r>.txt,
    names the ranks that did not get as far, and ends every rank with exit status 124. Evaluation, checkpoints and
    the steps before the median exists are bounded by ceiling_s alone."""

    enabled: bool = False  # off: no watchdog thread
    factor: Annotated[float, Range(gt=1)] = 10.0  # bound = factor x median step time of the last 50 steps
    floor_s: Annotated[float, Range(gt=0)] = 60.0  # the bound is never below this (jitter, a slow eval-free step)
    ceiling_s: Annotated[float, Range(gt=0)] = 1800.0  # the bound is never above this; also bounds eval/checkpoint
    warmup_steps: NonNegative = 5  # steps (compilation, allocator warm-up) left out of the median


@dataclass
class EarlyStopConfig:
    """Early stopping on the valid loss (dstrain.train.features.early_stop): the run stops cleanly, as a finished one (a
    checkpoint, summary.json with status "stopped"), after ``patience`` evaluations in a row whose ``valid`` loss is
    not below the best so far by more than ``min_delta``. Needs train.eval_interval."""

    patience: NonNegative = 0  # evaluations without an improvement before the run stops; 0 = off
    min_delta: Annotated[float, Range(ge=0)] = 0.0  # an improvement is a loss below the best by more than this


@dataclass
class TaskConfig:
    """A downstream task scored at each evaluation (dstrain.tasks; docs/evaluation.md): its first ``limit``
    items, each choice scored by the log-likelihood of its continuation, as lm-evaluation-harness scores them
    zero-shot, with the run's tokenizer."""

    name: str  # names its metrics: task/<name>/acc, task/<name>/acc_norm, task/<name>/samples
    format: Literal["hellaswag", "arc", "piqa", "winogrande", "lambada"]  # the Hugging Face dataset format of its items
    path: str  # a .jsonl file (one item a line, in that format) or a Hugging Face dataset id
    subset: str | None = None  # Hub datasets only: the dataset's configuration, e.g. ARC-Easy
    split: str = "validation"  # Hub datasets only: the split scored
    limit: Positive | None = 200  # the first `limit` items, in the file's order; None = every item


@dataclass
class AveragingConfig:
    """Weight averaging (dstrain.train.features.averaging; docs/recipes.md): an fp32 average of the weights beside the
    live ones, updated after every optimizer step from step ``start_step`` + 1 on, kept where the strategy keeps
    each parameter, saved in every checkpoint, evaluated as split valid/averaged, exported by export --averaged."""

    ema_half_life_tokens: Annotated[int, Range(ge=1)] | None = (
        None  # EMA: tokens after which a step's weight in the average halves (decay per step 0.5^(batch tokens/this))
    )
    last_n: Annotated[int, Range(ge=2)] | None = None  # last-N merge: the mean of the last N sampled states
    last_n_every: Positive = 1  # last-N samples the steps that are multiples of this (a window of (N-1) x this)
    start_step: NonNegative = 0  # averaging starts after this step (e.g. leaves the warmup's weights out)

    @property
    def enabled(self) -> bool:
        return self.ema_half_life_tokens is not None or self.last_n is not None


@dataclass
class TrainConfig:
    global_batch: Positive  # samples per optimizer step, whatever the world size, micro-batch or accumulation
    steps: NonNegative | None = None  # optimizer steps; exactly one of steps / tokens
    tokens: NonNegative | None = None  # train tokens; steps = ceil(tokens / (global_batch * seq_len))
    log_interval: Positive = 10  # steps between metrics lines
    eval_interval: NonNegative = 0  # steps between evaluations on the valid split; 0 = only at the end
    eval_samples: Positive | None = None  # samples of each source per evaluation; None = each whole valid split
    checkpoint_interval: NonNegative = 0  # steps between checkpoints; 0 = only at the end
    keep_last: Positive = 2  # checkpoints kept; older ones are deleted (never the newest)
    max_skipped_steps: Positive = 50  # fp16: consecutive overflow-skipped steps before the run aborts
    async_checkpoint: bool = False  # write checkpoints in the background from a host-memory snapshot
    spike_guard: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)  # loss-spike rollback
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)  # hang watchdog
    tasks: list[TaskConfig] = field(default_factory=list)  # downstream tasks scored at each evaluation
    averaging: AveragingConfig = field(default_factory=AveragingConfig)  # EMA / last-N average of the weights
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)  # stop when the valid loss stops improving
    # every published checkpoint of a multiple of this many steps also as a Hugging Face folder, run_dir/hf/<tag>/
    # (dstrain.train.features.hf_export; what `dstrain export --tag` writes); 0 = off
    export_every: NonNegative = 0


@dataclass
class Recipe:
    name: Annotated[str, NonEmpty("name the run (its folder is runs/<name>)")]  # names the run directory and reports
    # architecture; model.vocab_size None = the data's vocabulary rounded up to a multiple of 64. With init_from, the
    # fields left out (or the whole section) come from the folder's config.json; the fields given must agree with it.
    model: GPTConfig
    data: DataConfig
    train: TrainConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    seed: NonNegative = 1234  # model init and data order
    run_dir: Annotated[str, NonEmpty("name a folder, or remove the key for runs/<name>")] | None = (
        None  # None = runs/<name>
    )
    init_from: Annotated[str, NonEmpty("name a model folder or run, or remove the key")] | None = (
        None  # a Hugging Face model folder or a dstrain run (its newest checkpoint) to start from
    )
    # the preference objective (DPO and its variants, docs/preference-tuning.md): set for a pair folder (prepared
    # with chosen/rejected), absent for every other source; init_from is the reference (simpo needs none). Each
    # objective's section is a field here; which one is set chooses it (dstrain.objectives.registry)
    preference: PreferenceConfig | None = None
    # low-rank adapters (LoRA, docs/adapters.md): set, only the adapters (and lora.modules_to_save) train and the
    # rest of the model (usually init_from's) stays frozen; absent, every parameter trains
    lora: LoraConfig | None = None
    # online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO; docs/rl.md): the prompts, the reward functions, the
    # sampling and the loss; data.sources then give the tokenizer and the valid split
    rl: RLConfig | None = None

    @property
    def total_steps(self) -> int:
        if self.train.steps is not None:
            return self.train.steps
        assert self.train.tokens is not None  # validation requires exactly one of steps / tokens
        return -(-self.train.tokens // (self.train.global_batch * self.data.seq_len))

    def stage_starts(self) -> list[tuple[int, list[float]]]:
        """(first step, counted from 0, weights) of every mixture: data.sources' weights from step 0, then stages."""
        steps_of_tokens = self.train.global_batch * self.data.seq_len
        starts = [(0, [s.weight for s in self.data.sources])]
        for stage in self.data.stages:
            if stage.start_step is not None:
                first = stage.start_step - 1
            elif stage.start_tokens is not None:
                first = -(-stage.start_tokens // steps_of_tokens)
            else:
                assert stage.start_fraction is not None  # validate: exactly one start
                # Counted as wsd counts its decay (the last round(T * fraction) steps): 1 - decay_fraction aligns.
                first = self.total_steps - round(round(1 - stage.start_fraction, 12) * self.total_steps)
            starts.append((first, list(stage.weights)))
        return starts


def to_dict(recipe: Recipe) -> dict:
    """Plain data (tuples as lists) for the resolved recipe.yaml a run leaves, and for checkpoints."""
    return json.loads(json.dumps(dataclasses.asdict(recipe)))


def recipe_changes(old: dict, new: dict, prefix: str = "") -> dict:
    """{dotted key: [saved, current]} for every recipe value that differs from the checkpoint's."""
    changed = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed.update(recipe_changes(a, b, f"{prefix}{key}."))
        elif a != b and f"{prefix}{key}" != "run_dir":
            changed[f"{prefix}{key}"] = [a, b]
    return changed


def run_folder(recipe: Recipe) -> Path:
    """Where a recipe's run lives: its run_dir, by default runs/<name>."""
    return Path(f"runs/{recipe.name}" if recipe.run_dir is None else recipe.run_dir)


def recipe_paths(recipe: Recipe) -> dict[str, str]:
    """{dotted key: path as written} of every file or folder a recipe names."""
    paths = {f"data.sources[{i}].path": s.path for i, s in enumerate(recipe.data.sources)}
    if recipe.data.tokenizer is not None:
        paths["data.tokenizer"] = recipe.data.tokenizer
    if recipe.init_from is not None:
        paths["init_from"] = recipe.init_from
    return paths
