"""A checkpoint that finds the disk full, on one rank of two: every rank ends with exit 28 (which slurm/train.sbatch
does not requeue), one line on the console and no traceback; the partial tag is gone, `latest` and the published tags
are untouched. The error is injected at the write, through the seam every
checkpoint file of ours is opened by (dstrain.checkpoint.integrity.open_for_write), and in the one copy DeepSpeed makes
past it: an NVMe run's swap files (shutil.copytree inside engine.save_checkpoint)."""

import errno
import os
from pathlib import Path

import pytest

from ranks import spawn_ranks
from train_helpers import nvme_config, small_recipe, train_argv

pytestmark = pytest.mark.distributed


class FullDisk:
    """A file on a full filesystem: every write fails as the kernel would fail it."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
        pass


def assert_one_full_disk_line_and_step2_kept(codes: list[int], err: str, run: Path) -> Path:
    """Every rank exited DISK_FULL_EXIT with one line and no traceback; the partial tag is gone, `latest` and the
    published step-2 checkpoint are intact. Returns the checkpoints folder."""
    from dstrain.checkpoint.store import damage, published_tags
    from dstrain.errors import DISK_FULL_EXIT

    assert codes == [DISK_FULL_EXIT, DISK_FULL_EXIT]
    assert "Traceback" not in err and "Error in sys.excepthook" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("dstrain")]
    assert line.startswith("dstrain: error: ") and "is full (No space left on device)" in line
    assert "GiB free, a checkpoint needs ~" in line and "`latest` is untouched" in line
    checkpoints = run / "checkpoints"
    assert not list(checkpoints.glob("*.partial"))
    assert (checkpoints / "latest").read_text() == "global_step2"
    assert published_tags(checkpoints) == ["global_step2"] and damage(checkpoints / "global_step2") is None
    return checkpoints


def train_with_full_disk_at(argv: list[str], step: int, rank: int, logs_too: bool) -> int:
    """Rank target: train; on ``rank`` every checkpoint file of step ``step`` (and with ``logs_too`` from then on the
    rank's own log) meets a full disk."""
    from dstrain.checkpoint import integrity
    from dstrain.train.process import console
    from dstrain.train.run import main

    here = int(os.environ["RANK"]) == rank
    opened = integrity.open_for_write

    def open_for_write(path: str):
        if here and f"global_step{step}.partial" in path:
            if logs_too and console._session is not None and console._session.log.file is not None:
                console._session.log.file = FullDisk()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return opened(path)

    integrity.open_for_write = open_for_write
    return main(argv)


@pytest.mark.parametrize(
    "background, rank, logs_too",
    [(False, 1, False), (True, 0, True)],
    ids=["synchronous-rank1", "background-rank0-logs-too"],
)
def test_a_full_disk_ends_every_rank_in_one_line_and_keeps_the_published_checkpoints(
    tmp_path, corpus, capfd, background, rank, logs_too
):
    train = {"steps": 6, "checkpoint_interval": 2, "keep_last": 3, "async_checkpoint": background}
    recipe = small_recipe(tmp_path, corpus, train=train)
    run = tmp_path / "run"
    codes = spawn_ranks(2, train_with_full_disk_at, train_argv(recipe, "zero1", run), 4, rank, logs_too, timeout=300)
    assert_one_full_disk_line_and_step2_kept(codes, capfd.readouterr().err, run)


def train_with_full_disk_in_the_swap_copy(argv: list[str], step: int, rank: int) -> int:
    """Rank target: train; on ``rank`` DeepSpeed's copy of the NVMe swap files into the checkpoint of step ``step``
    (engine.save_checkpoint's shutil.copytree, which our checkpoint engine never sees) meets a full disk."""
    import shutil

    from dstrain.train.run import main

    here = int(os.environ["RANK"]) == rank
    copyfile = shutil.copyfile

    def full_copyfile(src, dst, *args, **kwargs):
        if here and f"global_step{step}.partial" in str(dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return copyfile(src, dst, *args, **kwargs)

    shutil.copyfile = full_copyfile
    return main(argv)


def test_a_full_disk_while_copying_the_nvme_swap_files_ends_in_one_line(tmp_path, corpus, capfd, async_io):
    if async_io:
        pytest.skip(async_io)
    # Wide enough that sub-groups of at least 1 MiB per rank are swapped (tests/test_nvme.py's model).
    model = {"d_model": 128, "vocab_size": 4096}
    recipe = small_recipe(tmp_path, corpus, model=model, train={"steps": 4, "checkpoint_interval": 2, "keep_last": 3})
    run = tmp_path / "run"
    argv = train_argv(recipe, nvme_config(tmp_path), run)
    codes = spawn_ranks(2, train_with_full_disk_in_the_swap_copy, argv, 4, 1, timeout=300)
    checkpoints = assert_one_full_disk_line_and_step2_kept(codes, capfd.readouterr().err, run)
    assert (checkpoints / "global_step2" / "offloaded_tensors").is_dir()  # the swap copy of step 2 went through
