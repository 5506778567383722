"""The runs of one `dstrain doctor` launch: which ds_configs, at which micro-batches, against which baseline.

Every checked strategy runs with gradient accumulation of at least 2 (its micro-batch chosen so each rank takes
two or more micro-batches per step: ZeRO's partitioned accumulation, its reduction at the boundary and the
division by the accumulation count are where DeepSpeed's silent bugs have lived), and also as shipped where that
is accumulation 1: DeepSpeed's ZeRO-1/2 reduce at every backward then, another code path. Each precision is held
against ZeRO-0 in the same precision, its tolerance set by that ZeRO-0 at another micro-batch (its twin: the same
sums in another order). A bf16 ZeRO-2 run of the model with its head tied to the embedding (a parameter used twice
in one backward, DeepSpeed#8224) is added where bf16 runs here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dstrain.errors import DstrainError

SHIPPED = Path(__file__).resolve().parents[3] / "ds_configs"
BASELINE = "zero0"
TWIN = "zero0_reordered"  # ZeRO-0 with another micro-batch split: the same math, its sums in another order
RESUMED = "zero1_then_zero3"  # stopped after half the steps under ZeRO-1, resumed under ZeRO-3
QUICK = ("zero1", "zero2", "zero3", "zero1_bf16", "zero2_bf16")  # --quick: one config per ZeRO stage, and bf16


@dataclass
class PlannedRun:
    """One run of the launch. ``baseline``: the run it is compared with; ``twin``: the run whose difference from
    that baseline sets its per-step tolerance; ``role``: baseline | twin | strategy | tied."""

    name: str
    config: str
    argv: list[str]
    baseline: str
    twin: str
    role: str = "strategy"
    accumulation: int = 1
    stop_after: int | None = None
    resume_argv: list[str] | None = None
    nudge: bool = False  # its weights one last bit off before step 1 (train.doctor.probe.NudgedProbe: the fp32 twin)


def baseline_config(precision: str) -> Path:
    """ZeRO-0 in fp32; in half precision ZeRO-1, the simplest layout dstrain accepts there (ZeRO-0 would sum the
    gradients in bf16: strategy.resolve refuses it)."""
    return SHIPPED / ("zero0.json" if precision == "fp32" else f"zero1_{precision}.json")


def baseline_names(precision: str) -> tuple[str, str]:
    stem = baseline_config(precision).stem
    return (BASELINE, TWIN) if precision == "fp32" else (stem, f"{stem}_reordered")


def resolved(recipe_file: str, config: Path, overrides: list[str], nproc: int):
    """(Strategy, None) or (None, why ``config`` cannot run here, in one line): it does not parse, the recipe or
    world size refuses it, or this machine lacks what it needs (fp16, bf16, an NVMe folder)."""
    from deepspeed.accelerator import get_accelerator

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.strategy.resolve import load_ds_config, offload_of, precision_of, resolve

    try:
        ds = load_ds_config(config)
        device = get_accelerator().device_name()
        if precision_of(ds) == "fp16" and not get_accelerator().is_fp16_supported():
            return None, f"{device} has no fp16 (DeepSpeed's accelerator says so): skipped, fp16's checks need a GPU"
        if precision_of(ds) == "bf16" and not get_accelerator().is_bf16_supported():
            return None, f"{device} has no bf16 (DeepSpeed's accelerator says so)"
        if "nvme" in (offload_of(ds, "offload_optimizer"), offload_of(ds, "offload_param")):
            zero = ds.get("zero_optimization", {})
            folder = zero.get("offload_param", zero.get("offload_optimizer", {})).get("nvme_path", "")
            if not (Path(folder).is_dir() and os.access(folder, os.W_OK)):
                return None, f"zero_optimization's nvme_path {folder!r} is no writable folder here"
        return resolve(load_recipe_and_source(recipe_file, overrides)[0], recipe_file, ds, str(config), nproc), None
    except DstrainError as e:
        return None, str(e)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # a config DeepSpeed's parser rejects
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def refusal(recipe_file: str, config: Path, overrides: list[str], nproc: int) -> str | None:
    return resolved(recipe_file, config, overrides, nproc)[1]


def with_micro_batch(config: Path, micro_batch: int, path: Path) -> Path:
    """A copy of ``config`` at ``micro_batch`` samples per rank."""
    data = json.loads(config.read_text())
    data["train_micro_batch_size_per_gpu"] = micro_batch
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def accumulating_micro_batch(global_batch: int, dp: int, micro_batch: int) -> int | None:
    """The largest micro-batch below ``micro_batch`` giving accumulation >= 2 (None: one sample per replica)."""
    per_replica = global_batch // dp
    for size in range(min(micro_batch, per_replica // 2), 0, -1):
        if per_replica % size == 0:
            return size
    return None


class Planner:
    """Builds the runs (module doc) for one recipe, world size and report folder."""

    def __init__(self, recipe_file: str, overrides: list[str], nproc: int, out: Path) -> None:
        from dstrain.checkpoint.model_source import load_recipe_and_source

        self.recipe_file, self.overrides, self.nproc, self.out = recipe_file, overrides, nproc, out
        self.global_batch = load_recipe_and_source(recipe_file, overrides)[0].train.global_batch
        self.runs: list[PlannedRun] = []
        self.refused: dict[str, str] = {}
        self.notes: list[str] = []
        self.ready: dict[str, bool] = {}  # precision -> its ZeRO-0 baseline and twin run here

    def argv(self, config: Path, name: str, extra: list[str]) -> list[str]:
        folder = self.out / "runs" / name
        return ["--recipe", self.recipe_file, "--deepspeed_config", str(config), f"run_dir={folder}"] + [
            *self.overrides,
            *extra,
        ]

    def add(self, name: str, config: Path, precision: str, role: str, accumulation: int, extra=()) -> PlannedRun:
        baseline, twin = baseline_names(precision)
        if role == "tied":
            baseline = f"{baseline}_tied"
        run = PlannedRun(name, str(config), self.argv(config, name, list(extra)), baseline, twin, role, accumulation)
        self.runs.append(run)
        return run

    def path(self, name: str) -> Path:
        return self.out / "configs" / f"{name}.json"

    def baselines(self, precision: str) -> bool:
        """The baseline in ``precision`` (baseline_config) and its twin at a smaller micro-batch; False (and a
        refusal) if it cannot run here. A half-precision baseline is held against fp32 ZeRO-0 (LOW_PRECISION_RTOL)."""
        if precision in self.ready:
            return self.ready[precision]
        base, twin = baseline_names(precision)
        config = baseline_config(precision)
        strategy, why = resolved(self.recipe_file, config, self.overrides, self.nproc)
        twin_micro = strategy and accumulating_micro_batch(self.global_batch, strategy.dp_size, strategy.micro_batch)
        self.ready[precision] = bool(twin_micro)
        if strategy is None or not twin_micro:
            self.refused[base] = why or f"a global batch of {self.global_batch} on {self.nproc} ranks cannot accumulate"
            return False
        run = self.add(base, config, precision, "baseline", strategy.grad_accum)
        run.baseline = BASELINE
        twin_accumulation = strategy.grad_accum * strategy.micro_batch // twin_micro
        twin_run = self.add(
            twin, with_micro_batch(config, twin_micro, self.path(twin)), precision, "twin", twin_accumulation
        )
        twin_run.nudge = precision == "fp32"  # a bf16 twin differs enough by its micro-batch alone (~1e-3)
        return True

    def strategy(self, config: Path, quick: bool) -> None:
        """``config`` as shipped where that is accumulation 1 (not under --quick), and at accumulation >= 2."""
        strategy, why = resolved(self.recipe_file, config, self.overrides, self.nproc)
        if strategy is None:
            self.refused[config.stem] = why or ""
            return
        precision = strategy.precision
        base = baseline_names(precision)[0]
        if not self.baselines(precision):
            self.refused[config.stem] = f"its baseline {base} cannot run here: {self.refused[base]}"
            return
        if config.stem == base:  # the baseline and its twin (accumulation >= 2) are this config's runs
            return
        if strategy.grad_accum >= 2:
            self.add(config.stem, config, precision, "strategy", strategy.grad_accum)
            return
        if not quick:
            self.add(config.stem, config, precision, "strategy", 1)
        micro = accumulating_micro_batch(self.global_batch, strategy.dp_size, strategy.micro_batch)
        if micro is None:
            self.notes.append(f"{config.stem}: one sample per replica per step, no accumulation possible")
            return
        accumulation = strategy.micro_batch // micro
        name = f"{config.stem}_acc{accumulation}"
        self.add(name, with_micro_batch(config, micro, self.path(name)), precision, "strategy", accumulation)

    def tied(self, precisions: set[str]) -> None:
        """ZeRO-2 against the baseline in each half precision a checked ZeRO-2 config uses, with the head tied to the
        embedding, at accumulation 2 (a refusal where the device lacks the precision)."""
        tie = ["model.tie_embeddings=true"]
        for precision in sorted(precisions - {"fp32"}):
            shipped, name = SHIPPED / f"zero2_{precision}.json", f"zero2_{precision}_tied"
            strategy, why = resolved(self.recipe_file, shipped, [*self.overrides, *tie], self.nproc)
            base = baseline_names(precision)[0]
            if strategy is None or not self.baselines(precision):
                self.refused[name] = why or f"its baseline {base} cannot run here: {self.refused.get(base, '')}"
                continue
            baseline = self.runs[[r.name for r in self.runs].index(base)]
            self.add(f"{base}_tied", Path(baseline.config), precision, "baseline", baseline.accumulation, tie)
            self.runs[-1].baseline = self.runs[-1].name
            micro = accumulating_micro_batch(self.global_batch, strategy.dp_size, strategy.micro_batch) or 1
            accumulation = strategy.grad_accum * strategy.micro_batch // micro
            self.add(name, with_micro_batch(shipped, micro, self.path(name)), precision, "tied", accumulation, tie)

    def resume(self, steps: int) -> None:
        """Stopped after half the steps under ZeRO-1, resumed under ZeRO-3, in one run folder."""
        first, second = SHIPPED / "zero1.json", SHIPPED / "zero3.json"
        strategy = resolved(self.recipe_file, first, self.overrides, self.nproc)[0]
        if strategy is None or refusal(self.recipe_file, second, self.overrides, self.nproc):
            return
        run = self.add(RESUMED, first, "fp32", "strategy", strategy.grad_accum)
        run.config, run.stop_after = f"{first} then {second}", max(1, steps // 2)
        run.resume_argv = self.argv(second, RESUMED, [])


def plan_runs(
    recipe_file: str, configs: list[Path], out: Path, overrides: list[str], nproc: int, steps: int, quick: bool = False
) -> tuple[list[dict], dict[str, str], list[str]]:
    """(runs for the ranks, {name: refusal}, notes): the fp32 baseline and twin first."""
    planner = Planner(recipe_file, overrides, nproc, out)
    if not planner.baselines("fp32"):
        raise DstrainError(f"the baseline {SHIPPED / 'zero0.json'} cannot run here: {planner.refused[BASELINE]}")
    for config in configs:
        if config.stem not in (BASELINE, TWIN):
            planner.strategy(config, quick)
    planner.tied(zero2_precisions(configs))
    if not quick:
        planner.resume(steps)
    return [asdict(run) for run in planner.runs], planner.refused, planner.notes


def zero2_precisions(configs: list[Path]) -> set[str]:
    """The precisions of the ZeRO-2 configs among ``configs`` (those that parse)."""
    from dstrain.strategy.resolve import precision_of

    found: set[str] = set()
    for config in configs:
        try:
            data = json.loads(config.read_text())
            if data.get("zero_optimization", {}).get("stage") == 2:
                found.add(precision_of(data))
        except (OSError, ValueError, AttributeError):
            continue
    return found


def shipped_configs(quick: bool = False) -> list[Path]:
    found = sorted(p for p in SHIPPED.glob("*.json") if p.stem != BASELINE)
    return [p for p in found if p.stem in QUICK] if quick else found
