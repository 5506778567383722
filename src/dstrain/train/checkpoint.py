"""Checkpoints in DeepSpeed's layout, published atomically.

DeepSpeed writes each tag folder in place and then its `latest` file, so a job killed
mid-save can leave a partial folder behind. We save under `<tag>.partial`, record every
file's size in `dstrain_checkpoint.json`, rename the folder to `<tag>` and only then
replace `latest`: a published tag is always complete, and at resume a tag whose files no
longer match its record (truncated, deleted) is skipped with a warning.

The record also numbers the saves of a run folder (``save_seq``): keep-last prunes and a resume
without a usable ``latest`` picks in that order, so a tag left by a longer branch never outranks the
checkpoint just written.

Each checkpoint also records the topology it was saved under (ZeRO stage, world, data-parallel,
tensor-parallel and pipeline sizes, precision) and DeepSpeed's universal-checkpoint info, so that a run
can resume under another one (dstrain.train.topology).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from dstrain.data.manifest import write_text_atomic
from dstrain.errors import DstrainError
from dstrain.run_dir import TAG, RunDir, tag_for
from dstrain.strategy import Topology
from dstrain.train import nvme, topology

PARTIAL = ".partial"
RECORD = "dstrain_checkpoint.json"


def rng_state() -> dict:
    """Tensors, ints and tuples only, so that the checkpoint's client state loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.array(keys)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def published_tags(checkpoint_dir: Path) -> list[str]:
    """Published tags, oldest save first (tags without a save number, from before it was recorded, by step)."""
    if not checkpoint_dir.is_dir():
        return []
    steps = {p.name: int(m.group(1)) for p in checkpoint_dir.iterdir() if p.is_dir() and (m := TAG.match(p.name))}
    return sorted(steps, key=lambda t: (save_seq(checkpoint_dir / t), steps[t]))


def read_record(tag_dir: Path) -> dict | None:
    try:
        return json.loads((tag_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None


def save_seq(tag_dir: Path) -> int:
    record = read_record(tag_dir)
    return int(record.get("save_seq", -1)) if isinstance(record, dict) else -1


def is_complete(tag_dir: Path) -> bool:
    try:
        record = json.loads((tag_dir / RECORD).read_text())
        return all((tag_dir / name).stat().st_size == size for name, size in record["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def newest_complete(checkpoint_dir: Path) -> str | None:
    """The tag ``latest`` names when it is complete, else the most recently saved complete one; broken ones are
    reported and passed over."""
    try:
        latest = (checkpoint_dir / "latest").read_text().strip()
    except OSError:
        latest = None
    if latest and TAG.match(latest) and is_complete(checkpoint_dir / latest):
        return latest
    for tag in reversed(published_tags(checkpoint_dir)):
        if is_complete(checkpoint_dir / tag):
            return tag
        warnings.warn(f"checkpoint {checkpoint_dir / tag} is incomplete or corrupt; skipping it", stacklevel=2)
    return None


def save(
    engine, checkpoint_dir: Path, step: int, client_state: dict, keep_last: int, identity: dict | None = None
) -> str:
    """Save on every rank, publish on rank 0, then drop the oldest saves beyond ``keep_last``, never this one.

    ``identity`` (what makes the checkpoint meaningless for another experiment) goes into the record, where a
    resume compares it with its recipe before writing anything."""
    tag = tag_for(step)
    client_state = prepare(engine, checkpoint_dir, tag, client_state)
    write_partial(engine, checkpoint_dir, tag, client_state)
    torch.distributed.barrier()  # every rank's shards are on disk
    publish(checkpoint_dir, step, client_state["topology"], keep_last, identity)
    torch.distributed.barrier()
    return tag


def write_partial(engine, checkpoint_dir: Path, tag: str, client_state: dict) -> None:
    """This rank's files of ``tag`` into its ``.partial`` folder (through the engine's checkpoint engine)."""
    engine.save_checkpoint(str(checkpoint_dir), tag=tag + PARTIAL, client_state=client_state, save_latest=False)
    if engine.zero_nvme_offload_optimizer():
        nvme.record_subgroups(engine, checkpoint_dir / (tag + PARTIAL))


def prepare(engine, checkpoint_dir: Path, tag: str, client_state: dict) -> dict:
    """Every rank, before a save of ``tag``: the client state with the topology and DeepSpeed's universal-checkpoint
    info added; a ``.partial`` folder of ``tag`` left by a killed save is gone."""
    from deepspeed.checkpoint.constants import (
        PIPELINE_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    client_state = {**client_state, "topology": Topology.from_engine(engine).to_record()}
    # AutoTP engines record their own; DeepSpeed 0.19.8's MoE save raises KeyError on the key in client_state (and
    # dstrain converts no MoE checkpoint: topology.check_convertible); test_moe_router.py has the canary.
    if getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None and not engine.has_moe_layers:
        # What Megatron-DeepSpeed records for ds_to_universal. Our parameters need no TP/vocab patterns; a
        # pipeline's tied embedding module is kept on the first and the last stage, and only the first stage's
        # copy is whole (the last stage never updates gpt2's position table), so the converter must take that one.
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\."],
        }
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(checkpoint_dir / (tag + PARTIAL), ignore_errors=True)  # left by a save that was killed
    torch.distributed.barrier()
    return client_state


def publish(checkpoint_dir: Path, step: int, shape: dict, keep_last: int, identity: dict | None) -> None:
    """Rank 0, once every rank's files of ``step`` are in its ``.partial`` folder: record their sizes, rename the
    folder to its tag, point ``latest`` at it, and drop the oldest published tags beyond ``keep_last``."""
    if torch.distributed.get_rank() != 0:
        return
    tag = tag_for(step)
    folder = checkpoint_dir / (tag + PARTIAL)
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    seq = 1 + max((save_seq(checkpoint_dir / t) for t in published_tags(checkpoint_dir)), default=0)
    record = {"step": step, "save_seq": seq, "files": files, "topology": shape, "identity": identity}
    write_text_atomic(folder / RECORD, json.dumps(record, indent=1))
    shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)  # a re-save of the same step after a resume
    os.replace(folder, checkpoint_dir / tag)
    write_text_atomic(checkpoint_dir / "latest", tag)
    older = [t for t in published_tags(checkpoint_dir) if t != tag]
    for old in older[: max(0, len(older) - (max(1, keep_last) - 1))]:
        shutil.rmtree(checkpoint_dir / old, ignore_errors=True)


def load(engine, checkpoint_dir: Path, tag: str) -> dict:
    """Restore model, optimizer, scheduler and loss scale; return our client state.

    A tag saved under another topology loads from the conversion topology.prepare_resume made in it."""
    load_dir, load_tag = topology.load_source(engine, checkpoint_dir / tag)
    path, client_state = engine.load_checkpoint(
        str(load_dir), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint_dir / tag}")
    if engine.zero_nvme_offload_optimizer():
        nvme.restore_what_deepspeed_skips(engine, load_dir, load_tag)
    topology.repair_after_load(engine, checkpoint_dir / tag)
    return client_state


# --- reading: a tag of any strategy as one plain state dict --------------------------------------------------------


def load_run(run_dir: str | os.PathLike, tag: str | None):
    """(recipe, tag folder) of a run directory; tag None = the newest complete checkpoint."""
    from dstrain.config import load_recipe

    files = RunDir(Path(run_dir))
    if not files.recipe.is_file():
        raise DstrainError(f"{files.recipe}: no such file; pass a run directory written by dstrain.train")
    recipe = load_recipe(files.recipe)
    checkpoints = files.checkpoints
    tag = tag or newest_complete(checkpoints)
    if tag is None:
        raise DstrainError(f"{checkpoints}: no complete checkpoint; train the run first or pass --tag")
    if not is_complete(checkpoints / tag):
        raise DstrainError(f"--tag {tag}: no complete checkpoint {checkpoints / tag}; omit --tag for the newest")
    return recipe, checkpoints / tag


EXPERT_FILES = "layer_*_expert_*_mp_rank_*_model_states.pt"  # DeepSpeed MoE: one file per layer and expert


def weights_kind(tag_dir: Path) -> str:
    """ "fp32 master" for a bf16 run, whose checkpoint keeps them apart from its bf16 module weights (ZeRO and fp16
    runs read through zero_to_fp32 get their masters too), else "module"."""
    saved = topology.saved(tag_dir)
    if any(tag_dir.glob(EXPERT_FILES)):  # MoE: the masters sit in expert-data-parallel partitions; the module's own
        return "module"
    return "fp32 master" if saved and saved.precision == "bf16" else "module"


def consolidated_state_dict(tag_dir: Path, model_config) -> dict[str, torch.Tensor]:
    """fp32 weights of GPT(model_config), from a checkpoint of any strategy: the fp32 masters of a bf16 run (its
    module weights are a rounding of them), otherwise the module's own, widened to fp32."""
    if nvme.is_nvme_checkpoint(tag_dir):  # ZeRO-3 with its masters partly in swap files: fp32 masters either way
        return {name: tensor.float().contiguous() for name, tensor in module_state_dict(tag_dir).items()}
    if weights_kind(tag_dir) == "fp32 master":
        return topology.fp32_masters(tag_dir, model_config)
    return {name: tensor.float().contiguous() for name, tensor in module_state_dict(tag_dir).items()}


def module_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The module's weights in the checkpoint, in the model's dtype (fp32 masters for ZeRO, read by zero_to_fp32)."""
    if any(tag_dir.glob(EXPERT_FILES)):
        # DeepSpeed's MoE checkpoint: the dense weights, then one file per expert named by its global index.
        state = topology.read_pt(tag_dir / topology.ZERO12_MODEL_FILE)["module"]
        for path in sorted(tag_dir.glob(EXPERT_FILES)):
            state.update(torch.load(path, map_location="cpu", weights_only=True))
        return state
    if any(tag_dir.glob("layer_*-model_states.pt")) or any(tag_dir.glob("mp_rank_01_model_states.pt")):
        # Pipeline layer files / AutoTP shards: the model-parallel converter of dstrain.model consolidates them.
        from dstrain.model.convert import read_checkpoint

        return read_checkpoint(tag_dir)[1]
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):  # ZeRO-1/2/3 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # DeepSpeed's own consolidation (it loads its files with weights_only=False itself); its progress
        # prints would land in `dstrain generate`'s output. It reads only the optim_states files, which under NVMe
        # offload lack the swapped masters: it reads a copy with them put back.
        with contextlib.redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory(prefix="dstrain-nvme-") as tmp:
            folder = nvme.spliced_copy(tag_dir, Path(tmp)) if nvme.is_nvme_checkpoint(tag_dir) else tag_dir
            return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    return topology.read_pt(tag_dir / topology.ZERO12_MODEL_FILE)[
        "module"
    ]  # ZeRO-0 and BF16_Optimizer: the whole model


# --- a model to evaluate or sample from: a run's checkpoint or a Hugging Face folder ---


def load_model_source(path: str | os.PathLike, tag: str | None = None):
    """(GPTConfig, fp32 state dict, the run's recipe or None) of a run directory or a Hugging Face model folder."""
    from dstrain.model.hf import from_hf

    path = Path(path)
    if (path / "config.json").is_file():
        if tag:
            raise DstrainError(f"--tag {tag}: {path} is a Hugging Face model folder, which has no checkpoints")
        config, state = from_hf(path)
        return config, {k: v.float() for k, v in state.items()}, None
    if RunDir(path).recipe.is_file():
        recipe, tag_dir = load_run(path, tag)
        return recipe.model, consolidated_state_dict(tag_dir, recipe.model), recipe
    raise DstrainError(f"{path}: neither a run directory (recipe.yaml) nor a Hugging Face model folder (config.json)")
