"""Checkpoints of ZeRO-Infinity runs (optimizer state offloaded to NVMe), for dstrain.checkpoint.store only.

DeepSpeed 0.19.8 saves such a run in two parts: each rank's ``*_optim_states.pt`` holds the optimizer's scalars (step
count, loss scale, hyper-parameters) and the sub-groups too small to swap (under ``MIN_AIO_BYTES`` = 1 MiB per rank,
e.g. the norms), while every swapped sub-group's fp32 master and Adam moments live only in
``offloaded_tensors/rank<NN>/<id>.tensor.swp``, raw copies of the swap files. Its loader copies those files back
and skips the first part entirely, and its consolidation (zero_to_fp32, ds_to_universal) reads only the first part.
``SUBGROUPS`` (written here at save, one per rank) records which swap file holds which sub-group's fp32 master.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dstrain.checkpoint.ds_files import MODEL_FILES, OPTIM_FILES, optim_file_rank
from dstrain.errors import DstrainError

OFFLOADED = "offloaded_tensors"  # DeepSpeed's folder in a tag (engine.py save_checkpoint / load_checkpoint)
SUBGROUPS = "dstrain_subgroups.json"


def is_nvme_checkpoint(tag_dir: Path) -> bool:
    return (tag_dir / OFFLOADED).is_dir()


def rank_folder(tag_dir: Path, rank: int) -> Path:
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    return tag_dir / OFFLOADED / f"rank{dp_index_to_str(rank)}"  # as engine.save_checkpoint names it


def record_subgroups(engine, tag_dir: Path) -> None:
    """Every rank, after engine.save_checkpoint: each sub-group's partition size and, when it is swapped, the file
    that holds its fp32 master (the swap file is named by the flat tensor's ds_id)."""
    optimizer = engine.optimizer
    groups = [
        {
            "numel": int(optimizer.fp16_partitioned_groups_flat_numel[i]),
            "swap_file": f"{flat.ds_id}.tensor.swp" if optimizer._swappable_optimizer_subgroup(i) else None,
        }
        for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat)
    ]
    (rank_folder(tag_dir, swap_rank(engine)) / SUBGROUPS).write_text(json.dumps(groups))


def finish_save_after_failed_copy(engine) -> None:
    """What engine.save_checkpoint still does after its copy of the swap files, for a rank whose copy met a full
    disk: the other ranks' saves go on to these collectives, and this one's must meet them.

    DeepSpeed 0.19.8 (runtime/engine.py save_checkpoint) copies an NVMe run's swap folder into the tag with
    ``shutil.copytree``, past the checkpoint engine (so past dstrain.checkpoint.integrity's full-disk record), and
    then runs the optimizer's checkpoint_event_epilogue (ZeRO-3 gathers its persistent parameters again) and a
    barrier. tests/test_disk_full.py::test_a_full_disk_while_copying_the_nvme_swap_files_ends_in_one_line drives it."""
    import torch

    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()
    torch.distributed.barrier()


def swap_rank(engine) -> int:
    """The rank that names this rank's folder of swap files, as engine.save_checkpoint / load_checkpoint pick it."""
    return engine.local_rank if engine.use_node_local_storage() else engine.global_rank


def check_resume(tag_dir: Path, strategy) -> None:
    """Before any work: refuse, in one line, what an NVMe checkpoint cannot become (and what an NVMe run cannot
    start from)."""
    from dstrain.checkpoint.reshard import saved

    saved_topology = saved(tag_dir)
    nvme_now = strategy.offload_optimizer == "nvme"
    recorded = all((folder / SUBGROUPS).is_file() for folder in (tag_dir / OFFLOADED).glob("rank*"))
    if is_nvme_checkpoint(tag_dir) == nvme_now and (not nvme_now or (saved_topology == strategy.topology and recorded)):
        return
    fix = "resume with the ds_config and rank count it was saved with, or --resume none"
    if nvme_now and is_nvme_checkpoint(tag_dir) and not recorded:
        why = "it has no record of which swap file holds what (saved before dstrain wrote one) to resume it exactly"
        fix = "--resume none starts over (the previous run is moved aside)"
    elif nvme_now and not is_nvme_checkpoint(tag_dir):
        why = "this ds_config offloads the optimizer to NVMe and the checkpoint has no NVMe swap files to load"
    elif not nvme_now:
        why = "its optimizer state lives in NVMe swap files (offloaded_tensors/), which only an NVMe ds_config loads"
    else:
        why = (
            f"its swap files are per rank and DeepSpeed cannot repartition them "
            f"({saved_topology.describe() if saved_topology else 'unrecorded'} -> {strategy.topology.describe()})"
        )
    raise DstrainError(f"{tag_dir}: {why}; {fix}")


def restore_what_deepspeed_skips(engine, load_dir: Path, tag: str) -> None:
    """After engine.load_checkpoint of an NVMe-offloaded optimizer: restore what it leaves out.

    DeepSpeed 0.19.8 (runtime/engine.py load_checkpoint: ``if load_zero_checkpoint and not
    self.zero_nvme_offload_optimizer()``) skips _load_zero_checkpoint and only copies the swap files back and reads
    the fp32 masters from them: Adam's moments and step count (the swapped sub-groups' state is never registered with
    the swapper again, so the first step starts it from zero), the groups' hyper-parameters, the loss scale, and every
    sub-group too small to swap stay as a fresh engine made them, and the resumed run silently differs. Here they come
    from this rank's optim_states file and swap files, as _rigid_load_state_dict would restore them.
    tests/test_nvme.py::test_deepspeed_skips_the_optimizer_load_under_nvme fails when DeepSpeed loads them itself:
    then remove this."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

    from dstrain.checkpoint.reshard import read_pt

    wrapper = engine.optimizer
    saved = read_pt(Path(engine._get_zero_ckpt_name(str(load_dir), tag)))[OPTIMIZER_STATE_DICT]
    swap_files = rank_folder(Path(load_dir) / tag, swap_rank(engine))
    layout = json.loads((swap_files / SUBGROUPS).read_text())
    wrapper.checkpoint_event_prologue()  # partition every parameter before touching the partitions
    wrapper.loss_scaler = saved[LOSS_SCALER]
    wrapper.dynamic_loss_scale = saved["dynamic_loss_scale"]
    wrapper.overflow = saved["overflow"]
    base, inner = saved[OPTIMIZER_STATE_DICT], wrapper.optimizer
    wrapper._set_fp32_optimizer_param_groups()  # each group's params = its sub-groups' fp32 flats, as when saved
    try:
        flats = [p for group in inner.param_groups for p in group["params"]]
        for group, saved_group in zip(inner.param_groups, base["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    finally:
        wrapper._clear_fp32_optimizer_param_groups()
    index = {id(flat): i for i, flat in enumerate(wrapper.fp32_partitioned_groups_flat)}
    for position, flat in enumerate(flats):
        state, sub_group = base["state"].get(position, {}), index[id(flat)]
        numel = int(wrapper.fp16_partitioned_groups_flat_numel[sub_group])
        if wrapper._swappable_optimizer_subgroup(sub_group):
            # Read from the checkpoint by the ids it was saved under (an engine built after another in the same
            # process numbers its tensors on, so DeepSpeed's copied files may not be the ones it reads).
            saved_id = layout[sub_group]["swap_file"].removesuffix(".tensor.swp")
            wrapper._optimizer_states_and_gradient_swap_in(sub_group)
            flat.data.copy_(_read_swap(swap_files / f"{saved_id}.tensor.swp", numel))
            inner.state[flat] = {  # the moments were released to empty tensors before the save
                key: _read_swap(swap_files / f"{key}-{saved_id}.tensor.swp", numel) if torch.is_tensor(v) else v
                for key, v in state.items()
            }
            wrapper._reassign_or_swap_out_partitioned_parameters(sub_group)  # the module's partition from the master
            wrapper._optimizer_states_and_gradient_swap_out(sub_group)  # registers the moments, writes all out
            continue
        inner.state[flat] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        flat.data.copy_(saved[FP32_FLAT_GROUPS][sub_group].data)
        wrapper._reassign_or_swap_out_partitioned_parameters(sub_group)
    wrapper.checkpoint_event_epilogue()  # gathers the persistent parameters again, now restored


def _read_swap(path: Path, numel: int) -> torch.Tensor:
    """A swap file is the tensor's raw fp32 bytes, padded to the aio alignment."""
    return torch.from_file(str(path), size=numel, dtype=torch.float32).clone()


# --- reading: the fp32 masters of an NVMe checkpoint -------------------------------------------------------------


def spliced_copy(tag_dir: Path, out: Path) -> Path:
    """A copy of ``tag_dir`` under ``out`` that DeepSpeed's zero_to_fp32 reads: each rank's optim_states file with
    the swapped sub-groups' fp32 masters put back from its offloaded swap files (model-state files linked)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    from dstrain.checkpoint.reshard import read_pt

    target = out / tag_dir.name
    target.mkdir(parents=True)
    for path in sorted(tag_dir.glob(MODEL_FILES)):
        os.symlink(path.resolve(), target / path.name)
    for rank, path in enumerate(sorted(tag_dir.glob(OPTIM_FILES), key=optim_file_rank)):
        state = read_pt(path)
        folder = rank_folder(tag_dir, rank)
        try:
            groups = json.loads((folder / SUBGROUPS).read_text())
        except (OSError, ValueError):
            raise DstrainError(
                f"{folder / SUBGROUPS}: missing or unreadable, so the NVMe-offloaded weights of {tag_dir} cannot be "
                f"placed; export a checkpoint saved by this version of dstrain"
            ) from None
        flats = state[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS]
        for i, group in enumerate(groups):
            if group["swap_file"]:
                flats[i] = _read_swap(folder / group["swap_file"], group["numel"])
        torch.save(state, target / path.name)
    return target
