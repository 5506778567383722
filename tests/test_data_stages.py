"""Mixtures that change over training (data.stages) and per-source repetition caps (max_epochs): exact shares,
sources that go on across stages, an order that only the recipe, the seed and the sample index decide."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from dstrain.data.dataset import BlendedDataset, build_dataset
from dstrain.data.index import build_staged_blend
from dstrain.data.prepare import prepare
from dstrain.errors import DstrainError
from dstrain.recipe_file import load_recipe

from data_fixtures import corpus_file

SEQ_LEN = 32


def _shares(source: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(source, minlength=n) / max(source.size, 1)


def test_every_stage_realises_its_weights_within_half_a_percent():
    """300 random layouts of 2-5 sources and 1-4 stages of 2,000-9,000 samples, some weights 0."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 6))
        lengths = rng.integers(2000, 9000, size=int(rng.integers(1, 5)))
        firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        stages = []
        for first in firsts:
            weights = rng.random(n) * (rng.random(n) > 0.2)
            weights[int(rng.integers(n))] += 0.1  # at least one positive
            stages.append((int(first), weights.tolist()))
        blend = build_staged_blend(stages, int(lengths.sum()), [None] * n)
        for (first, weights), length in zip(stages, lengths.tolist()):
            realised = _shares(blend["source"][first : first + length], n)
            assert np.abs(realised - np.asarray(weights) / sum(weights)).max() <= 0.005


def test_sources_go_on_across_stages_without_repeating():
    stages = [(0, [1.0, 1.0, 0.0]), (3000, [0.0, 1.0, 3.0]), (5000, [2.0, 1.0, 1.0])]
    blend = build_staged_blend(stages, 9000, [None] * 3)
    for k in range(3):
        taken = blend["sample"][blend["source"] == k]
        assert np.array_equal(taken, np.arange(taken.size))  # each source's samples in order, each once
    assert set(blend["source"][:3000].tolist()) == {0, 1} and 0 not in blend["source"][3000:5000]
    assert (blend["exhausted"] == -1).all()


def test_prefix_does_not_depend_on_the_run_length():
    stages = [(0, [3.0, 1.0]), (2500, [1.0, 4.0])]
    short, long = build_staged_blend(stages, 4000, [None, 300]), build_staged_blend(stages, 9000, [None, 300])
    for key in ("source", "sample"):
        assert np.array_equal(short[key], long[key][:4000])


def test_a_capped_source_runs_out_and_the_others_share_its_weight():
    stages = [(0, [1.0, 1.0, 2.0]), (4000, [1.0, 0.0, 1.0])]
    blend = build_staged_blend(stages, 8000, [None, None, 1000])
    source = blend["source"]
    out = int(blend["exhausted"][2])
    assert (source == 2).sum() == 1000 and source[out - 1] == 2 and 2 not in source[out:]
    assert 1500 < out < 2500  # half of the first stage's samples come from source 2
    after = _shares(source[out:4000], 3)
    assert abs(after[0] - 0.5) <= 0.005 and abs(after[1] - 0.5) <= 0.005
    assert (source[4000:] == 0).all()  # stage 2's other source has run out: source 0 alone
    with pytest.raises(DstrainError, match="every source of the mixture from sample 4000 on has run out"):
        build_staged_blend(stages, 8000, [3000, None, 1000])


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_corpus) -> list[Path]:
    tmp = tmp_path_factory.mktemp("stages")
    folders = [tiny_corpus]
    for skip, name in ((300, "code"), (450, "hq")):
        out = tmp / name
        prepare(corpus_file(tmp, 150, skip), out, tokenizer=str(tiny_corpus / "tokenizer"), num_proc=1, progress=False)
        folders.append(out)
    return folders


def test_staged_dataset_reads_each_source_in_its_own_order(sources, tmp_path):
    """Sample i of the staged blend is sample ``sample[i]`` of its source's own packed stream; the realised mix of
    the second stage is its weights'; a shorter run's samples are the longer run's first ones."""
    pairs = [(str(f), w) for f, w in zip(sources, [1.0, 1.0, 0.0])]
    stages = [(2400, [0.0, 1.0, 3.0])]
    data = build_dataset(pairs, "train", SEQ_LEN, 3, 4400, 0.05, tmp_path, stages, [None, None, None])
    assert isinstance(data, BlendedDataset) and len(data) == 4400
    mix = data.mix(2400, 4400)
    assert mix["mix_code"] == pytest.approx(0.25, abs=0.005) and mix["mix_hq"] == pytest.approx(0.75, abs=0.005)
    assert data.mix(0, 2400)["mix_hq"] == 0.0
    shorter = build_dataset(pairs, "train", SEQ_LEN, 3, 3000, 0.05, tmp_path, stages, [None, None, None])
    for i in (0, 1, 2399, 2400, 2999):
        assert np.array_equal(shorter[i]["tokens"], data[i]["tokens"])
    hq = build_dataset([(str(sources[2]), 1.0)], "train", SEQ_LEN, 3, None, 0.05, tmp_path)
    first_hq = int(np.flatnonzero(data.source == 2)[0])
    assert np.array_equal(data[first_hq]["tokens"], hq[0]["tokens"])


def test_max_epochs_caps_a_source_at_its_epochs(sources, tmp_path):
    pairs = [(str(f), 1.0) for f in sources]
    hq_epoch = build_dataset([pairs[2]], "train", SEQ_LEN, 3, None, 0.05, tmp_path).samples_per_epoch
    data = build_dataset(pairs, "train", SEQ_LEN, 3, 3 * 4 * hq_epoch, 0.05, tmp_path, None, [None, None, 2.0])
    assert (data.source == 2).sum() == 2 * hq_epoch and data.exhausted.tolist()[:2] == [-1, -1]


def _recipe(tmp_path: Path, sources: list[Path], **data) -> Path:
    recipe = {
        "name": "staged",
        "model": {"flavour": "llama", "n_layer": 1, "n_head": 2, "d_model": 32, "vocab_size": 512},
        "data": {"sources": [{"path": str(f)} for f in sources], "seq_len": SEQ_LEN, **data},
        "train": {"global_batch": 8, "steps": 100},
    }
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_stage_starts_by_step_tokens_or_fraction(tmp_path, sources):
    stages = [
        {"start_step": 11, "weights": [1, 0, 1]},
        {"start_tokens": 8 * SEQ_LEN * 40 + 1, "weights": [0, 1, 1]},
        {"start_fraction": 0.9, "weights": [0, 0, 1]},
    ]
    recipe = load_recipe(_recipe(tmp_path, sources, stages=stages))
    assert [first for first, _ in recipe.stage_starts()] == [0, 10, 41, 90]


@pytest.mark.parametrize(
    "stages, message",
    [
        ([{"weights": [1, 1, 1]}], r"data.stages\[0\]: set exactly one of start_step, start_tokens, start_fraction"),
        ([{"start_step": 5, "start_fraction": 0.5, "weights": [1, 1, 1]}], "set exactly one of"),
        ([{"start_step": 5, "weights": [1, 1]}], r"weights has 2 entries for 3 data.sources"),
        ([{"start_step": 5, "weights": [0, 0, 0]}], r"data.stages\[0\].weights are all 0"),
        ([{"start_step": 5, "weights": [1, -1, 1]}], r"data.stages\[0\].weights\[1\]"),
        (
            [{"start_step": 101, "weights": [1, 1, 1]}],
            r"starts at step 101, which is not after .* inside the run's 100",
        ),
        (
            [{"start_step": 50, "weights": [1, 1, 1]}, {"start_fraction": 0.3, "weights": [1, 1, 1]}],
            r"data.stages\[1\] starts at step 31, which is not after the stage before \(step 50\)",
        ),
    ],
)
def test_bad_stages_are_one_line_errors(tmp_path, sources, stages, message):
    with pytest.raises(DstrainError, match=message) as error:
        load_recipe(_recipe(tmp_path, sources, stages=stages))
    assert "\n" not in str(error.value) and "staged.yaml" in str(error.value)


def test_the_shipped_anneal_recipe_starts_its_anneal_with_the_wsd_decay():
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "gpt2-125m-anneal.yaml")
    (_, first), (anneal, second) = recipe.stage_starts()
    assert anneal == recipe.total_steps - round(recipe.schedule.decay_fraction * recipe.total_steps)
    assert first[2] == 0.0 and second == [0.3, 0.1, 0.6] and recipe.data.sources[2].max_epochs == 4


def test_compare_plots_the_realised_mix(tmp_path):
    from dstrain.commands.compare import build_report
    from dstrain.commands.compare_runs import read_run

    run = tmp_path / "zero1"
    run.mkdir()
    records = [{"step": s, "loss": 5.0, "mix_web": 1.0 - s / 10, "mix_hq": s / 10} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    row = read_run(run)
    assert row.mix == [(s, {"web": 1.0 - s / 10, "hq": s / 10}) for s in range(1, 5)]
    build_report(tmp_path, [row], "staged", [])
    assert (tmp_path / "mix.png").stat().st_size > 0 and "mix.png" in (tmp_path / "report.md").read_text()
    assert "mix" not in (tmp_path / "results.csv").read_text().splitlines()[0]
