"""Resuming on another topology: a checkpoint saved under one world size, ZeRO stage, precision, pipeline or
tensor-parallel layout, loaded under another.

Every checkpoint records the topology it was saved with (``topology`` in its client state and in
``dstrain_checkpoint.json``). When a run resumes under a different one, global rank 0 converts the tag
once into DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``) inside the tag
folder, the other ranks wait, and the engine loads it with ``"checkpoint": {"load_universal": true}``:

    checkpoints/global_step40/            the checkpoint as saved (DeepSpeed's layout)
    checkpoints/global_step40/universal/  fp32 weight + Adam moments per parameter, under GPT's own names
    checkpoints/global_step40/zero0/      a ZeRO-0 checkpoint built from it, only when resuming under ZeRO-0

DeepSpeed 0.19.8 leaves gaps that ``_bridge_deepspeed_gaps`` and ``repair_after_load`` fill (each
named there); ZeRO-0 checkpoints, which DeepSpeed's converter and loader do not handle at all, are
translated in ``dstrain.checkpoint.ds_files``; pipeline parameter names are mapped by
``_pipeline_names``. tests/test_topology.py fails when a DeepSpeed upgrade changes any behaviour worked
around here. Refused: fp16 runs (dynamic loss scale), ZeRO-0 bf16 and ZeRO-0 pipeline runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from pathlib import Path

import torch

from dstrain.checkpoint import safe_load
from dstrain.checkpoint.ds_files import (
    MODEL_FILES,
    STAGE0_OPTIM_FILES,
    ZERO3_MODEL_FILE,
    ZERO12_MODEL_FILE,
    check_groups,
    group_names,
    read_pt,
    universal_from_zero0,
    zero0_from_universal,
)
from dstrain.checkpoint.record import read_record
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.strategy.resolve import Strategy
from dstrain.strategy.topology import Topology

UNIVERSAL = "universal"
ZERO0 = "zero0"


# --- what a checkpoint was saved with -------------------------------------------------------------------


def saved(tag_dir: Path) -> Topology | None:
    """The topology recorded with a published tag; None where its record is unreadable."""
    record = read_record(tag_dir)
    return record.topology if record else None


def needs_conversion(old: Topology, new: Topology) -> bool:
    """Replicated state (ZeRO-0 fp32) loads at any world size; partitioned state needs the same partition count
    and precision (ZeRO names its bf16 partition files differently). Under sequence parallelism ZeRO partitions
    over the SP ranks too (DeepSpeed's sequence-data-parallel group): dp x sp partitions."""
    if (old.zero_stage, old.tp_size, old.pp_stages, old.ep_size, old.pipe_schedule) != (
        new.zero_stage,
        new.tp_size,
        new.pp_stages,
        new.ep_size,
        new.pipe_schedule,
    ):
        return True
    old_parts, new_parts = old.dp_size * old.sp_size, new.dp_size * new.sp_size
    return (_partitioned(old) or _partitioned(new)) and (old_parts, old.precision) != (new_parts, new.precision)


def _partitioned(t: Topology) -> bool:
    # ZeRO-0 bf16 is refused for new runs (strategy/resolve.py: DeepSpeed cannot accumulate it in fp32); a checkpoint
    # of one made before that refusal is treated as partitioned, and check_convertible refuses to convert it.
    return t.zero_stage > 0 or t.precision == "bf16"


# --- the resume hook (dstrain.train.run) --------------------------------------------------------------


def prepare_resume(
    checkpoint_dir: Path, tag: str, strategy: Strategy, model_config: GPTConfig, weight_decay: float, on_rank0
) -> bool:
    """On every rank, before the engine is built: if ``tag`` was saved under another topology, convert it
    (``on_rank0(fn, what)`` runs the conversion on global rank 0 while the others wait) and set up the ds_config to
    load the conversion. Returns True when a conversion is used."""
    tag_dir = checkpoint_dir / tag
    old, new = saved(tag_dir), strategy.topology
    if old is None or not needs_conversion(old, new):
        return False

    if strategy.ds_config.get("optimizer", {}).get("type") == "Muon":
        # ds_to_universal and universal_from_zero0 carry fp32 weights and Adam moments: Muon's momentum would be lost.
        raise DstrainError(
            f"{tag_dir}: a Muon run cannot change topology ({old.describe()} -> {new.describe()}): the universal "
            f"checkpoint does not carry Muon's momentum; resume with the saved ds_config (ZeRO-0 fp32 resumes on any "
            f"number of ranks)"
        )

    def convert_once() -> None:
        check_convertible(tag_dir, old, new, moe=model_config.moe is not None)
        print(f"{tag} was saved under {old.describe()}; converting it for {new.describe()}", flush=True)
        convert(tag_dir, old, new, model_config, weight_decay)

    on_rank0(convert_once, f"convert {tag_dir}")
    if new.zero_stage > 0:  # ZeRO-0 loads the plain checkpoint written into zero0/
        strategy.ds_config["checkpoint"] = {**strategy.ds_config.get("checkpoint", {}), "load_universal": True}
    return True


def load_source(engine, tag_dir: Path) -> tuple[Path, str]:
    """(load_dir, tag) for ``engine.load_checkpoint``: the conversion if ``prepare_resume`` made one."""
    if engine.load_universal_checkpoint():
        return tag_dir, UNIVERSAL
    old = saved(tag_dir)
    if old is not None and engine.zero_optimization_stage() == 0 and old.zero_stage > 0:
        return tag_dir, ZERO0
    return tag_dir.parent, tag_dir.name


def check_convertible(tag_dir: Path, old: Topology, new: Topology, moe: bool = False) -> None:
    """Refuse, in one line, what no converter here handles."""
    if moe:
        # DeepSpeed 0.19.8's ds_to_universal knows AutoEP experts only: classic MoE layers keep their experts in
        # per-expert files and their optimizer state in expert-data-parallel partitions, which it does not read.
        raise DstrainError(
            f"{tag_dir}: an MoE run cannot change topology ({old.describe()} -> {new.describe()}): DeepSpeed's "
            f"universal checkpoint does not convert its expert optimizer partitions "
            f"(https://github.com/deepspeedai/DeepSpeed/issues/5716); resume with the saved ds_config and rank "
            f"count, or continue from the weights (dstrain export, then init_from)"
        )
    for t in (old, new):
        what = (
            "fp16 (dynamic loss scale)"
            if t.precision == "fp16"
            else "ZeRO-0 bf16 (DeepSpeed's BF16_Optimizer)"
            if t.zero_stage == 0 and t.precision == "bf16"
            else "ZeRO-0 pipeline (optimizer state kept per stage)"
            if t.zero_stage == 0 and t.pp_stages > 1
            else None
        )
        if what:
            raise DstrainError(
                f"{tag_dir}: a {what} run cannot change topology here ({old.describe()} -> {new.describe()}); "
                f"resume with the saved ds_config and rank count"
            )


# --- conversion (global rank 0 only) ------------------------------------------------------------------


def convert(tag_dir: Path, old: Topology, new: Topology, model_config: GPTConfig, weight_decay: float) -> None:
    """Write tag_dir/universal (and tag_dir/zero0 for a ZeRO-0 target) unless already there.

    Built under a temporary name and renamed, so a conversion killed half-way is simply redone."""
    universal = tag_dir / UNIVERSAL
    if not universal.is_dir():
        work = tag_dir / f".{UNIVERSAL}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        if old.zero_stage == 0:
            universal_from_zero0(tag_dir, work / UNIVERSAL, model_config, weight_decay)
        else:
            _ds_to_universal(tag_dir, work / UNIVERSAL)
            if old.pp_stages > 1:
                _groups_of_every_stage(tag_dir, work / UNIVERSAL)
        _bridge_deepspeed_gaps(work / UNIVERSAL)
        if old.pp_stages > 1:
            for plain, piped in _pipeline_names(model_config).items():
                os.replace(work / UNIVERSAL / "zero" / piped, work / UNIVERSAL / "zero" / plain)
        os.replace(work / UNIVERSAL, universal)
        shutil.rmtree(work)  # also holds the `latest_universal` file ds_to_universal writes beside its output
    if new.pp_stages > 1:  # a pipeline engine looks its parameters up under its own names
        for plain, piped in _pipeline_names(model_config).items():
            if not (universal / "zero" / piped).exists():
                os.symlink(plain, universal / "zero" / piped)
    if new.zero_stage == 0 and not (tag_dir / ZERO0).is_dir():
        work = tag_dir / f".{ZERO0}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        zero0_from_universal(universal, work, model_config, weight_decay)
        os.replace(work, tag_dir / ZERO0)


def _ds_to_universal(tag_dir: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    source = _sp_view(tag_dir, out.parent / ".sp_view") if getattr(saved(tag_dir), "sp_size", 1) > 1 else tag_dir
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), safe_load.only_weights():
            ds_to_universal.main(args)
    except DstrainError:  # an unsafe pickle, said in one line by safe_load
        raise
    except Exception as e:
        raise DstrainError(
            f"{tag_dir}: DeepSpeed's universal-checkpoint conversion failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; resume with the saved ds_config and rank count"
        ) from None


def _groups_of_every_stage(tag_dir: Path, universal: Path) -> None:
    """DeepSpeed 0.19.8's ds_to_universal keeps the first pipeline stage's parameter groups only
    (``_save_optimizer_state`` reads pp_index 0), and a stage has none of a group it holds no parameter of (the
    engine drops empty groups: train/engine/grad_norm.py::pad_group_norms), so a first stage of matrices only would
    leave
    the no-decay group out. The groups of every stage instead, by name: the fullest stage's, then any it lacks."""
    path = universal / "zero" / "optimizer_state.pt"
    optim = read_pt(path)
    files = sorted(tag_dir.glob(STAGE0_OPTIM_FILES))
    stages: list[list[dict]] = [
        read_pt(f)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"] for f in files
    ]
    groups = list(max(stages, key=len, default=optim["param_groups"]))
    names = set(group_names(groups))
    for stage in stages:
        for name, group in zip(group_names(stage), stage):
            if name not in names:
                groups.append(group)
                names.add(name)
    optim["param_groups"] = groups
    torch.save(optim, path)


def _sp_view(tag_dir: Path, view: Path) -> Path:
    """The tag as ds_to_universal reads it: DeepSpeed 0.19.8 records an SP checkpoint's tp_degree as the SP size
    (engine._checkpoint_parallel_metadata asks the SP mpu for its model-parallel size), then wants one model-state
    file per TP rank. Symlinks, and model-state files with tp_degree 1 (test_sequence.py notices a fix upstream)."""
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for path in (p for p in tag_dir.iterdir() if p.is_file()):
        if path.match(MODEL_FILES):
            state = read_pt(path)
            state["checkpoint_parallel_dimensions"]["tp_degree"] = 1
            torch.save(state, view / path.name)
        else:
            os.symlink(path.resolve(), view / path.name)
    return view


def _bridge_deepspeed_gaps(universal: Path) -> None:
    """Make one universal folder load under ZeRO-1, 2 and 3, whichever stage it came from.

    DeepSpeed 0.19.8 writes a universal checkpoint in its source stage's own dialect, and each stage's
    loader reads only its own, so crossing between ZeRO-1/2 and ZeRO-3 fails in both directions:
      1. the engine reads the model-state file of the *current* stage's name (mp_rank_00_... for ZeRO-1/2,
         zero_pp_rank_0_mp_rank_00_... for ZeRO-3), and the conversion copies only the source's;
      2. the ZeRO-3 loader reads zero/optimizer_state.pt["optimizer_state_dict"] (step, param_groups),
         which only a ZeRO-3 source writes; the ZeRO-1/2 loader asserts a "ds_version" only they write;
      3. the ZeRO-1/2 loader reads per-parameter {"param": tensor} dicts and a step.pt, while the ZeRO-3
         conversion writes bare flat tensors and no step.
    """
    model_files = sorted(universal.glob(MODEL_FILES))
    model_state = read_pt(model_files[0])
    for name in (ZERO12_MODEL_FILE, ZERO3_MODEL_FILE):
        if not (universal / name).exists():
            shutil.copyfile(model_files[0], universal / name)
    zero = universal / "zero"
    optim = read_pt(zero / "optimizer_state.pt")
    params = sorted(p for p in zero.iterdir() if p.is_dir())
    if "optimizer_state_dict" in optim:  # from ZeRO-3
        step = optim["optimizer_state_dict"]["state"][0]["step"]
    else:
        step = read_pt(next(p / "step.pt" for p in params if (p / "step.pt").exists()))
    optim.pop("fp32_flat_groups", None)  # the ZeRO-3 conversion keeps rank 0's whole partition; unused
    optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
    optim.setdefault("ds_version", model_state["ds_version"])
    optim.setdefault("clip_grad", model_state["ds_config"].get("gradient_clipping", 0.0))
    torch.save(optim, zero / "optimizer_state.pt")
    shapes = {k: v for group in model_state.get("param_shapes") or [] for k, v in group.items()}
    for folder in params:  # (a tied weight's second name has only fp32.pt, from the ZeRO-1/2 module state)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            state = read_pt(folder / f"{key}.pt") if (folder / f"{key}.pt").exists() else None
            if torch.is_tensor(state):
                torch.save({"param": state.view(shapes[folder.name])}, folder / f"{key}.pt")
        if (folder / "exp_avg.pt").exists() and not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")


def repair_after_load(engine, tag_dir: Path) -> None:
    """After a universal load: refuse a parameter-group mismatch, and under ZeRO-3 undo two slips of
    DeepSpeed 0.19.8's ZeRO-3 universal loader (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3),
    which the ZeRO-1/2 loader does not make:
      1. it copies the *first* group's hyper-parameters into every group, so norms and biases would be
         weight-decayed like matrices from then on: give each group back its own;
      2. it hands every sub-group the *same* `step` tensor, which torch's Adam increments in place, so the
         bias correction of all but the first sub-group would run ahead by one step per sub-group."""
    if not engine.load_universal_checkpoint():
        return
    saved_groups = read_pt(tag_dir / UNIVERSAL / "zero" / "optimizer_state.pt")["param_groups"]
    saved_names, names = group_names(saved_groups), group_names(engine.optimizer.param_groups)
    if engine.zero_optimization_stage() == 3 and len(names) == len(saved_names):
        names = saved_names  # slip 1 below gave every group the first one's name; ZeRO-3 has no stages to lack one
    check_groups(tag_dir, saved_names, names)
    if engine.zero_optimization_stage() != 3:
        return
    optimizer = engine.optimizer
    for group, saved_group in zip(optimizer.optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[flat]
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _pipeline_names(model_config: GPTConfig) -> dict[str, str]:
    """Plain GPT parameter name -> the PipelineModule's name of it (dstrain.model.pipe's layer list).

    The universal folder keeps the plain names, so one conversion serves plain, AutoTP and pipeline engines."""
    from dstrain.model.gpt import GPT
    from dstrain.model.pipe import TIED_KEY, layer_prefixes

    with torch.device("meta"):
        names = [name for name, _ in GPT(model_config).named_parameters()]  # a tied head is not listed
    layers = [(i, p) for i, p in enumerate(layer_prefixes(model_config)) if p is not None]
    piped = {}
    for name in names:
        if model_config.tied and name.startswith("embed."):  # the embedding is a tied module of the pipeline
            piped[name] = f"tied_modules.{TIED_KEY}.{name.removeprefix('embed.')}"
            continue
        index, (plain, own) = next((i, p) for i, p in layers if name.startswith(p[0]))
        piped[name] = f"{index}.{own}{name.removeprefix(plain)}"
    return piped


def fp32_masters(tag_dir: Path, model_config: GPTConfig) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a checkpoint whose optimizer keeps them apart from the 16-bit module weights
    (bf16 under any ZeRO stage, pipeline or TP), under GPT's own names, read through DeepSpeed's universal
    format: the tag's universal/ folder if a resume made one, else a conversion in a temporary folder."""
    import tempfile

    from dstrain.model.gpt import GPT

    with tempfile.TemporaryDirectory(prefix="dstrain-universal-") as tmp:
        universal = tag_dir / UNIVERSAL
        if not universal.is_dir():
            universal = Path(tmp) / UNIVERSAL
            _ds_to_universal(tag_dir, universal)
        zero = universal / "zero"
        old = saved(tag_dir)
        piped = _pipeline_names(model_config) if old and old.pp_stages > 1 else {}
        with torch.device("meta"):
            shapes = {name: t.shape for name, t in GPT(model_config).state_dict().items()}  # tied: both names
        state = {}
        for name, shape in shapes.items():
            folder = zero / name if (zero / name).is_dir() else zero / piped.get(name, name)
            if folder.is_dir():
                tensor = read_pt(folder / "fp32.pt")  # a {"param": ...} dict, or a bare flat tensor from ZeRO-3
                state[name] = (tensor["param"] if isinstance(tensor, dict) else tensor).float().reshape(shape)
        extra = [folder for folder in zero.iterdir() if folder.name not in shapes]
        if extra and not piped:  # parameters beside the GPT's own (a lora: run's adapters), as the engine shaped them
            trained = trained_shapes(tag_dir)
            for folder in extra:
                if folder.name in trained:
                    tensor = read_pt(folder / "fp32.pt")
                    param = tensor["param"] if isinstance(tensor, dict) else tensor
                    state[folder.name] = param.float().reshape(trained[folder.name])
    if "lm_head.weight" not in state and "embed.tok.weight" in state:  # tied: the embedding is the head
        state["lm_head.weight"] = state["embed.tok.weight"]
    return state


def trained_shapes(tag_dir: Path) -> dict[str, torch.Size]:
    """{name: shape} of the parameters the optimizer held, as the engine recorded them (param_shapes)."""
    model_file = next(iter(sorted(tag_dir.glob("*model_states.pt"))), None)
    if model_file is None:
        return {}
    groups = read_pt(model_file).get("param_shapes") or []
    return {name: torch.Size(shape) for group in groups for name, shape in group.items()}
