"""What the metrics count (issue 12 items 8, 10, 11): training time only in throughput, each data source's valid
loss on its own, and the MFU peak of the exact device variant."""

import argparse
import json
import time

import pytest

from ranks import run_ranks
from train_helpers import ROOT, read_metrics, small_recipe

PAUSE_S = 0.5  # added to every evaluation and checkpoint of the slowed run: far above a 10-step tiny interval
EVAL_RTOL = 1e-6  # `dstrain eval` against the trainer's eval of the same samples (tests/test_export.py measured 2e-8)


# --- metrics.jsonl's one reader -------------------------------------------------------------------------


def test_read_records_skips_events_and_a_line_cut_short(tmp_path):
    from dstrain.metrics_records import drop_records_after, read_events, read_records

    metrics = tmp_path / "metrics.jsonl"
    assert read_records(metrics) == [] and read_events(metrics) == []  # a run that logged nothing yet
    lines = [
        {"step": 1, "loss": 9.0, "lr": 1e-3},
        {"step": 2, "event": "resume", "tag": "global_step1", "changed": {}},
        {"step": 2, "split": "valid", "loss": 8.5, "ppl": 4914.8, "samples": 32},
        [1, 2],  # JSON, but not a record
    ]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "lo')
    assert read_records(metrics) == [lines[0], lines[2]]
    assert read_events(metrics) == [lines[1]]
    drop_records_after(metrics, 1)  # a rollback to step 1 drops step 2's records, the event and the cut line
    assert read_records(metrics) == [lines[0]] and read_events(metrics) == []


# --- the interval clock -------------------------------------------------------------------------------


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_interval_clock_counts_pauses_apart_from_training():
    from dstrain.metrics import IntervalClock

    now = FakeTime()
    clock = IntervalClock(now)
    now.t += 2.0
    with clock.paused("eval"):
        now.t += 5.0
    now.t += 1.0
    with clock.paused("checkpoint"):
        now.t += 3.0
    with clock.paused("eval"):
        now.t += 0.25
    assert clock.lap() == {"train_s": 3.0, "eval_s": 5.25, "checkpoint_s": 3.0}
    now.t += 4.0
    assert clock.lap() == {"train_s": 4.0, "eval_s": 0.0, "checkpoint_s": 0.0}  # each lap starts afresh


def test_interval_clock_counts_a_pause_that_raises():
    from dstrain.metrics import IntervalClock

    now = FakeTime()
    clock = IntervalClock(now)
    with pytest.raises(RuntimeError), clock.paused("checkpoint"):
        now.t += 1.5
        raise RuntimeError("disk full")
    assert clock.lap()["checkpoint_s"] == 1.5


# --- the MFU peak -------------------------------------------------------------------------------------

GB = 10**9
GIB = 2**30


@pytest.mark.parametrize(
    "name, memory, precision, variant, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 85017493504, "bf16", "H100 SXM", 989.5),  # as torch reports the lent H100
        ("NVIDIA H100 80GB HBM3", 79.1 * GIB, "fp32", "H100 SXM", 67.0),
        ("NVIDIA H100 PCIe", 79.1 * GIB, "bf16", "H100 PCIe", 756.5),
        ("NVIDIA H100 PCIe", 79.1 * GIB, "fp16", "H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 93.6 * GIB, "bf16", "H100 NVL", 835.5),
        ("NVIDIA H100", 93.6 * GIB, "bf16", "H100 NVL", 835.5),  # the name alone is ambiguous: 94 GB is the NVL
        ("NVIDIA H100", 79.1 * GIB, "bf16", None, None),  # 80 GB: SXM or PCIe, a third slower; no guess
        ("NVIDIA H200", 140.4 * GIB, "bf16", "H200 SXM", 989.5),
        ("NVIDIA H200 NVL", 140.4 * GIB, "bf16", "H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", 94.5 * GIB, "bf16", "GH200", 989.5),
        ("NVIDIA A100-SXM4-40GB", 39.4 * GIB, "bf16", "A100 40GB", 312.0),
        ("NVIDIA A100-SXM4-80GB", 79.2 * GIB, "bf16", "A100 80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 79.2 * GIB, "fp32", "A100 80GB", 19.5),
        ("NVIDIA L40S", 44.4 * GIB, "bf16", "L40S", 362.05),
        ("NVIDIA L40", 44.4 * GIB, "bf16", "L40", 181.05),
        ("NVIDIA L4", 22.0 * GIB, "bf16", "L4", 121.0),
        ("NVIDIA A10", 22.0 * GIB, "bf16", "A10", 125.0),
        ("NVIDIA A10G", 22.0 * GIB, "bf16", None, None),  # no vendor datasheet
        ("Tesla V100-SXM2-32GB", 31.7 * GIB, "fp16", "V100 SXM2", 125.0),
        ("Tesla V100-PCIE-16GB", 15.8 * GIB, "fp16", "V100 PCIe", 112.0),
        ("Tesla V100-SXM2-16GB", 15.8 * GIB, "bf16", "V100 SXM2", None),  # no bf16 on Volta
        ("AMD Instinct MI300X", 192 * GB, "bf16", "MI300X", 1307.4),
    ],
)
def test_peak_of_each_device_variant(name, memory, precision, variant, tflops):
    from dstrain.devices import lookup_peak

    assert lookup_peak(name, int(memory), precision) == (variant, tflops)


def test_the_first_lines_name_the_peak(monkeypatch):
    from dstrain.devices import device_peak

    monkeypatch.setenv("DSTRAIN_PEAK_TFLOPS", "400")
    assert device_peak("bf16") == (400.0, "MFU against 400 TFLOP/s per device (DSTRAIN_PEAK_TFLOPS)")
    monkeypatch.delenv("DSTRAIN_PEAK_TFLOPS")
    peak, line = device_peak("bf16")
    assert peak is None and line.startswith("MFU not logged") and "DSTRAIN_PEAK_TFLOPS" in line  # a CPU


# --- a 2-source run, slowed in eval and save ----------------------------------------------------------


def train_slowed(argv: list[str]) -> int:
    """Rank target: train with every evaluation and checkpoint PAUSE_S longer."""
    from dstrain.train.loop import Trainer
    from dstrain.train.run import main

    evaluate, save = Trainer.evaluate, Trainer.save

    def slow(method):
        def slowed(self, *args, **kwargs):
            time.sleep(PAUSE_S)
            return method(self, *args, **kwargs)

        return slowed

    Trainer.evaluate, Trainer.save = slow(evaluate), slow(save)
    try:
        return main(argv)
    finally:
        Trainer.evaluate, Trainer.save = evaluate, save


def train_then_eval(train_argvs: list[list[str]], eval_argvs: list[list[str]]) -> list:
    """Rank target: the runs, then `dstrain eval` of each eval argv, in one process group."""
    from dstrain.commands import evaluate

    codes = [train_slowed(argv) for argv in train_argvs]
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return [codes, [evaluate.evaluate(parser.parse_args([str(a) for a in args])) for args in eval_argvs]]


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, corpus):
    """The corpus (weight 0.1) and a small other source (weight 0.9): 2-rank runs of the whole valid splits and of
    8 samples per source, then `dstrain eval` of both."""
    from dstrain.data.prepare import prepare

    from data_fixtures import corpus_file

    tmp = tmp_path_factory.mktemp("metrics")
    small = tmp / "small_source"
    prepare(
        str(corpus_file(tmp, n_docs=60, skip_docs=300)),
        str(small),
        tokenizer=str(corpus / "tokenizer"),
        num_proc=1,
        progress=False,
    )
    sources = [{"path": str(corpus), "weight": 0.1}, {"path": str(small), "weight": 0.9}]
    recipe = small_recipe(
        tmp,
        corpus,
        data={"sources": sources},
        train={"steps": 6, "log_interval": 2, "eval_interval": 2, "checkpoint_interval": 4, "eval_samples": None},
    )
    config = ROOT / "ds_configs" / "zero1.json"
    whole, few = tmp / "whole", tmp / "few"
    runs = [
        ["--recipe", recipe, "--deepspeed_config", config, f"run_dir={run}", *extra]
        for run, extra in ((whole, []), (few, ["train.eval_samples=8"]))
    ]
    codes, evals = run_ranks(2, train_then_eval, [[str(a) for a in r] for r in runs], [[whole], [few, "--samples", 8]])[
        0
    ]
    assert codes == [0, 0]
    return {
        "whole": whole,
        "few": few,
        "eval_whole": evals[0],
        "eval_few": evals[1],
        "names": [corpus.name, small.name],
    }


@pytest.mark.distributed
def test_throughput_counts_training_time_only(two_sources):
    """Each record's time is split into train_s, eval_s and checkpoint_s; tokens/s divides by train_s."""
    records = [r for r in read_metrics(two_sources["whole"]) if "split" not in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    tokens = 2 * 8 * 32  # log_interval x global batch x seq_len
    for r in records:
        assert r["train_s"] > 0 and r["tokens_per_s"] == pytest.approx(tokens / r["train_s"], rel=1e-12)
    for previous, r in zip(records, records[1:]):  # the three parts make up the interval's wall time
        wall = r["elapsed_s"] - previous["elapsed_s"]
        # elapsed_s is read after the record's collective (the memory peak of all ranks), whose wait for the other
        # rank differs from record to record: more than 0.05 s where 2 cores are shared with another test's ranks
        assert r["train_s"] + r["eval_s"] + r["checkpoint_s"] == pytest.approx(wall, abs=0.25)
    # the eval after step 2 falls in the interval of steps 3-4; the eval and the checkpoint after step 4 in 5-6
    assert [r["eval_s"] > PAUSE_S for r in records] == [False, True, True]
    assert [r["checkpoint_s"] > PAUSE_S for r in records] == [False, False, True]
    assert records[0]["eval_s"] == records[0]["checkpoint_s"] == 0.0
    evals = [r for r in read_metrics(two_sources["whole"]) if r.get("split") == "valid"]
    assert all(r["duration_s"] > PAUSE_S for r in evals)


@pytest.mark.distributed
def test_each_source_is_evaluated_on_its_own(two_sources):
    """valid/<source> per source, over its whole valid split; valid is their weight-averaged loss."""
    big, small = two_sources["names"]
    records = read_metrics(two_sources["whole"])
    final = {r["split"]: r for r in records if r["step"] == 6 and "split" in r}
    assert list(final) == [f"valid/{big}", f"valid/{small}", "valid"]  # the total last
    sizes = {s: final[f"valid/{s}"]["samples"] for s in (big, small)}
    assert sizes[big] > 4 * sizes[small] > 0  # very different valid sizes
    expected = 0.1 * final[f"valid/{big}"]["loss"] + 0.9 * final[f"valid/{small}"]["loss"]
    assert final["valid"]["loss"] == pytest.approx(expected, rel=1e-12)
    evaluated = two_sources["eval_whole"]
    for name in (big, small):  # `dstrain eval` of the final checkpoint, source by source
        assert evaluated["sources"][name]["samples"] == sizes[name]
        assert evaluated["sources"][name]["loss"] == pytest.approx(final[f"valid/{name}"]["loss"], rel=EVAL_RTOL)
    assert evaluated["loss"] == pytest.approx(final["valid"]["loss"], rel=EVAL_RTOL)
    assert [r["step"] for r in records if r.get("split") == f"valid/{small}"] == [2, 4, 6]


@pytest.mark.distributed
def test_eval_samples_applies_per_source(two_sources):
    big, small = two_sources["names"]
    final = {r["split"]: r for r in read_metrics(two_sources["few"]) if r["step"] == 6 and "split" in r}
    assert final[f"valid/{big}"]["samples"] == final[f"valid/{small}"]["samples"] == 8
    evaluated = two_sources["eval_few"]
    for name in (big, small):
        assert evaluated["sources"][name]["samples"] == 8
        assert evaluated["sources"][name]["loss"] == pytest.approx(final[f"valid/{name}"]["loss"], rel=EVAL_RTOL)
    expected = 0.1 * final[f"valid/{big}"]["loss"] + 0.9 * final[f"valid/{small}"]["loss"]
    assert final["valid"]["loss"] == pytest.approx(expected, rel=1e-12) == evaluated["loss"]
