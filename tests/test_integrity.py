"""Damaged checkpoints are never trained on or exported. One trained run per layout (ZeRO-1, ZeRO-3, pipeline, NVMe),
copied per case; the newest checkpoint of each copy is damaged (bytes overwritten mid-file at the same size and
mtime, a file truncated, a file missing); every resume falls back to the intact one before it and continues as the
uninterrupted run did, bit for bit, and export/eval/generate/verify refuse the damaged tag naming the intact one."""

import os
import shutil

import pytest

from ranks import run_ranks
from train_helpers import nvme_config, small_recipe, train_argv, train_each, train_losses

pytestmark = pytest.mark.distributed

NVME_MODEL = {"d_model": 128, "vocab_size": 4096}  # as test_nvme.py: big enough for DeepSpeed to swap sub-groups


def overwrite_middle(path) -> None:
    """16 bytes in the middle of ``path`` inverted; its size and mtime as before (silent corruption)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        data = f.read(16)
        f.seek(before.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# (layout, damage, which file of the newest tag): model files hold the module's weights, optimizer files the
# partitioned masters and moments, NVMe swap files the swapped sub-groups' masters and moments.
CASES = [
    ("zero1", overwrite_middle, "mp_rank_00_model_states.pt"),
    ("zero1", overwrite_middle, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("zero1", truncate, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("zero1", os.remove, "mp_rank_00_model_states.pt"),
    ("zero3", overwrite_middle, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("zero3", overwrite_middle, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("pp2_zero1", overwrite_middle, "layer_01-model_states.pt"),
    ("pp2_zero1", overwrite_middle, "zero_pp_rank_*_optim_states.pt"),
    ("nvme", overwrite_middle, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("nvme", overwrite_middle, "offloaded_tensors/rank01/*.tensor.swp"),
]
IDS = [f"{layout}-{damage.__name__}-{name.split('/')[-1]}" for layout, damage, name in CASES]


def train_and_resume_damaged(tmp, corpus, layouts: dict, cases: list[int]) -> dict:
    """In one process group: each layout's run (4 steps, checkpoints at 2 and 4), then one resume per case of a copy
    whose global_step4 is damaged. ``layouts``: layout -> (recipe sections, ds_config)."""
    train_section = {"steps": 4, "checkpoint_interval": 2, "keep_last": 3}
    recipes = {
        name: small_recipe(tmp, corpus, name=name, train=train_section, **extra) for name, (extra, _) in layouts.items()
    }
    originals = {name: tmp / name for name in layouts}
    argvs = [train_argv(recipes[name], config, originals[name]) for name, (_, config) in layouts.items()]
    assert run_ranks(2, train_each, argvs, timeout=900)[0] == [0] * len(layouts)
    copies, damaged, resumes = {}, {}, []
    for case in cases:
        layout, damage, pattern = CASES[case]
        copies[case] = tmp / f"case{case}"
        shutil.copytree(originals[layout], copies[case])
        path = sorted((copies[case] / "checkpoints" / "global_step4").glob(pattern))[-1]
        damage(path)
        damaged[case] = path.name
        resumes.append(train_argv(recipes[layout], layouts[layout][1], copies[case]))
    codes = run_ranks(2, train_each, resumes, timeout=900)
    return {
        "originals": originals,
        "copies": copies,
        "damaged": damaged,
        "codes": {case: [rank[i] for rank in codes] for i, case in enumerate(cases)},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    layouts = {"zero1": ({}, "zero1"), "zero3": ({}, "zero3"), "pp2_zero1": ({}, "pp2_zero1")}
    cases = [i for i, case in enumerate(CASES) if case[0] in layouts]
    return train_and_resume_damaged(tmp_path_factory.mktemp("integrity"), corpus, layouts, cases)


@pytest.fixture(scope="module")
def nvme_runs(tmp_path_factory, corpus, async_io):
    if async_io:
        pytest.skip(async_io)  # the NVMe cases need DeepSpeed's async_io op
    tmp = tmp_path_factory.mktemp("integrity_nvme")
    layouts = {"nvme": ({"model": NVME_MODEL}, nvme_config(tmp))}
    cases = [i for i, case in enumerate(CASES) if case[0] == "nvme"]
    return train_and_resume_damaged(tmp, corpus, layouts, cases)


def check_resume(runs, case: int) -> None:
    layout, copy, name = CASES[case][0], runs["copies"][case], runs["damaged"][case]
    assert runs["codes"][case] == [0, 0]
    log = (copy / "logs" / "rank0.log").read_text()
    (warning,) = [line for line in log.splitlines() if "is damaged, skipping it" in line]
    assert "global_step4" in warning and name in warning
    assert "resumed from global_step2" in log
    assert train_losses(copy) == train_losses(runs["originals"][layout])
    assert len(train_losses(copy)) == 4


NVME_CASES = [i for i, case in enumerate(CASES) if case[0] == "nvme"]
OTHER_CASES = [i for i in range(len(CASES)) if i not in NVME_CASES]


@pytest.mark.parametrize("case", OTHER_CASES, ids=[IDS[i] for i in OTHER_CASES])
def test_a_damaged_checkpoint_is_skipped_and_the_resume_continues_exactly(runs, case):
    check_resume(runs, case)


@pytest.mark.parametrize("case", NVME_CASES, ids=[IDS[i] for i in NVME_CASES])
def test_a_damaged_nvme_checkpoint_is_skipped_and_the_resume_continues_exactly(nvme_runs, case):
    check_resume(nvme_runs, case)


@pytest.mark.parametrize("command", ["export", "eval", "generate", "verify"])
def test_commands_refuse_a_damaged_checkpoint_naming_an_intact_one(runs, command, tmp_path, capsys):
    from dstrain.commands.cli import main

    copy = tmp_path / "run"
    shutil.copytree(runs["originals"]["zero1"], copy)
    overwrite_middle(copy / "checkpoints" / "global_step4" / "mp_rank_00_model_states.pt")
    argv = {
        "export": ["export", str(copy), "--out", str(tmp_path / "hf")],
        "eval": ["eval", str(copy), "--samples", "4"],
        "generate": ["generate", str(copy), "--prompt", "The", "--max-new-tokens", "2"],
        "verify": ["verify", str(copy)],
    }[command]
    code = main(argv)
    out, err = capsys.readouterr()
    if command == "verify":
        assert code == 1
        assert out.splitlines()[0].startswith("global_step2: intact (")
        assert out.splitlines()[1].startswith("global_step4 (latest): damaged: ")
        assert "mp_rank_00_model_states.pt has checksum" in out
        return
    assert code == 2 and not (tmp_path / "hf").exists()
    (line,) = [line for line in err.splitlines() if line.startswith("dstrain")]
    assert "global_step4 is damaged" in line and "mp_rank_00_model_states.pt has checksum" in line
    assert line.endswith("pass --tag global_step2 (intact)")
