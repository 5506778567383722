"""A run folder from elsewhere never runs code: its checkpoint files are pickles that would run a command (with their
sizes and checksums re-recorded, so integrity checks pass), and resume, export, eval and generate each refuse them in
one line while the command never runs."""

import json
import os
import shutil

import pytest
import torch

from ranks import spawn_ranks
from train_helpers import small_recipe, train, train_argv


class Payload:
    """Unpickled by torch.load(weights_only=False), it runs ``touch MARKER``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path, marker) -> None:
    """Replace a checkpoint file by one whose unpickling runs the payload (tensors around it, as a real file has)."""
    torch.save({"module": {"w": torch.zeros(2)}, "payload": Payload(marker), "optimizer_state_dict": {}}, path)


def plant_tag(tag_dir, marker) -> None:
    """Every .pt of the tag replaced, its record's sizes and checksums re-recorded to match."""
    from dstrain.checkpoint.integrity import file_checksum
    from dstrain.checkpoint.record import RECORD

    record = json.loads((tag_dir / RECORD).read_text())
    for name in record["files"]:
        if name.endswith(".pt"):
            plant(tag_dir / name, marker)
            record["files"][name] = (tag_dir / name).stat().st_size
            record["checksums"][name] = file_checksum(tag_dir / name)
    (tag_dir / RECORD).write_text(json.dumps(record))


@pytest.mark.deepspeed_defect("TorchCheckpointEngine.load unpickles with weights_only=False")
def test_deepspeed_loads_checkpoints_with_weights_only_false(tmp_path):
    """What safe_load.only_weights works around: DeepSpeed 0.19.8's own loader runs a checkpoint's code. When this
    fails (DeepSpeed loads with weights_only=True), only_weights may go, once the converter and zero_to_fp32 do too."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "ran"
    plant(tmp_path / "model.pt", marker)
    TorchCheckpointEngine().load(str(tmp_path / "model.pt"))
    assert marker.exists()


def test_only_weights_makes_deepspeed_refuse_the_same_file(tmp_path):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from dstrain.checkpoint.safe_load import UnsafeCheckpoint, only_weights

    marker = tmp_path / "ran"
    plant(tmp_path / "model.pt", marker)
    with only_weights(), pytest.raises(UnsafeCheckpoint, match="model.pt: holds more than tensors"):
        TorchCheckpointEngine().load(str(tmp_path / "model.pt"))
    assert torch.load is not None and not marker.exists()
    with pytest.raises(Exception, match="Weights only load failed"):  # torch.load is itself again afterwards
        torch.load(tmp_path / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """A ZeRO-1 run of 4 steps on 2 ranks, checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("untrusted")
    recipe = small_recipe(tmp, corpus, train={"steps": 4, "checkpoint_interval": 2, "keep_last": 3})
    assert spawn_ranks(2, train, train_argv(recipe, "zero1", tmp / "run"), timeout=300) == [0, 0]
    return recipe, tmp / "run"


@pytest.fixture
def planted(run, tmp_path):
    """A copy of the run whose newest checkpoint (every file) would run ``touch marker`` when loaded."""
    recipe, source = run
    copy = tmp_path / "run"
    shutil.copytree(source, copy)
    plant_tag(copy / "checkpoints" / "global_step4", tmp_path / "marker")
    return recipe, copy, tmp_path / "marker"


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-2000:]
    return [line for line in err.splitlines() if line.startswith("dstrain")]


@pytest.mark.distributed
def test_resume_refuses_a_planted_checkpoint_in_one_line(planted, capfd, monkeypatch):
    """Both ranks of a 2-rank launch refuse before the process group starts (so here, in this process), rank 0
    in one line."""
    from dstrain.train.run import main

    recipe, copy, marker = planted
    monkeypatch.setenv("WORLD_SIZE", "2")
    codes = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        codes.append(main(train_argv(recipe, "zero1", copy, "train.steps=6")))
    assert codes == [2, 2]
    (line,) = error_lines(capfd.readouterr().err)
    assert "global_step4/" in line and "holds more than tensors and plain data" in line and "posix" in line
    assert not marker.exists()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "command",
    [
        ["export", "{run}", "--out", "{tmp}/hf"],
        ["eval", "{run}", "--samples", "4"],
        ["generate", "{run}", "--prompt", "The", "--max-new-tokens", "2"],
    ],
    ids=["export", "eval", "generate"],
)
def test_commands_refuse_a_planted_checkpoint_in_one_line(planted, command, tmp_path, capfd):
    from dstrain.commands.cli import main

    _, copy, marker = planted
    assert main([a.format(run=copy, tmp=tmp_path) for a in command]) == 2
    (line,) = error_lines(capfd.readouterr().err)
    assert line.startswith("dstrain: error: ") and "holds more than tensors and plain data" in line
    assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.distributed
def test_deepspeed_readers_refuse_a_planted_checkpoint(planted):
    """Past the up-front check, DeepSpeed's own readers refuse too: the universal converter (a resume on another
    layout) and zero_to_fp32 (export of ZeRO checkpoints)."""
    from dstrain.checkpoint import consolidate, reshard
    from dstrain.checkpoint.safe_load import UnsafeCheckpoint

    _, copy, marker = planted
    tag = copy / "checkpoints" / "global_step4"
    with pytest.raises(UnsafeCheckpoint):
        reshard._ds_to_universal(tag, copy / "universal")
    with pytest.raises(UnsafeCheckpoint):
        consolidate.module_state_dict(tag)
    assert not marker.exists()
