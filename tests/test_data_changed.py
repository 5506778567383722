"""Prepared data that no longer matches its manifest (a shard truncated, replaced at the same size, or missing,
between two launches) is refused at the start of training, in one line naming the file, before any work."""

import json
import os

import pytest

from data_fixtures import copy_prepared
from train_helpers import small_recipe, train_argv


def replace_middle(path) -> None:
    """Other bytes in the middle of ``path``, at its size and mtime: a shard replaced by another of the same size."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0x5A for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-8])


DAMAGES = {
    "replaced bin": (replace_middle, "shard_00001.bin", "its content differs from what its manifest recorded"),
    "replaced idx": (replace_middle, "shard_00000.idx", "its content differs from what its manifest recorded"),
    "truncated bin": (truncate, "shard_00001.bin", "bytes, its manifest says"),
    "missing idx": (os.remove, "shard_00002.idx", "missing, though"),
}


def test_a_prepared_folder_records_what_its_shards_are(corpus):
    from dstrain.data.manifest import check_shards, read_manifest

    manifest = read_manifest(corpus)
    assert len(manifest.shards) >= 3
    assert all(s.bin_bytes > 0 and s.idx_bytes > 0 for s in manifest.shards)
    assert all(s.bin_sampled_xxh3 and s.idx_sampled_xxh3 for s in manifest.shards)
    check_shards(corpus, manifest)  # as prepared: accepted


@pytest.mark.parametrize("case", DAMAGES)
def test_changed_data_is_refused_naming_the_file(corpus, tmp_path, case):
    from dstrain.data.manifest import check_shards, read_manifest
    from dstrain.errors import DstrainError

    damage, name, why = DAMAGES[case]
    data = copy_prepared(corpus, tmp_path / "data")
    damage(data / name)
    with pytest.raises(DstrainError) as refused:
        check_shards(data, read_manifest(data))
    assert str(refused.value).startswith(f"{data / name}: ") and why in str(refused.value)


def test_training_refuses_changed_data_at_start_in_one_line(corpus, tmp_path, capsys):
    from dstrain.train.run import main

    data = copy_prepared(corpus, tmp_path / "data")
    replace_middle(data / "shard_00001.bin")
    recipe = small_recipe(tmp_path, data)
    assert main(train_argv(recipe, "zero1", tmp_path / "run")) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert line.startswith(f"dstrain: error: {data / 'shard_00001.bin'}: its content differs from what its manifest")
    assert "dstrain prepare" in line
    assert not (tmp_path / "run").exists()  # refused before any work


def test_a_manifest_without_recorded_sizes_is_refused_by_name(corpus, tmp_path):
    """The writer always records each shard's sizes and sampled hashes; a manifest without them is not one of its
    (no sizes implied from token counts): refused in one line naming the file and the first missing key."""
    from dstrain.data.manifest import MANIFEST_NAME, read_manifest
    from dstrain.errors import DstrainError

    data = copy_prepared(corpus, tmp_path / "data")
    raw = json.loads((data / MANIFEST_NAME).read_text())
    raw["shards"] = [{k: s[k] for k in ("prefix", "documents", "tokens")} for s in raw["shards"]]
    (data / MANIFEST_NAME).write_text(json.dumps(raw))
    missing = r"manifest.json: missing required key shards\[0\]\.bin_bytes; .*dstrain prepare"
    with pytest.raises(DstrainError, match=missing):
        read_manifest(data)
