"""`dstrain doctor` against injected silent defects, one launch for all of them: each defective run must make the
doctor exit 1 naming that run and the check (the strategies' losses and norms, or a gradient-check row) at the step
the defect begins, while the clean runs beside it pass.

The defects are the classes of DeepSpeed's silent bugs (docs/troubleshooting.md's catalogue), injected through the
trainer's test seam (dstrain.train.doctor.probe.Probe is its StepHooks) or by patching the rank's DeepSpeed engine:
one bucket of ZeRO-2's reduction scaled (DeepSpeed#7718's class), one rank's first micro-batch of each step dropped
(overwritten by the second instead of accumulated: open-instruct#1498), the gradient divided by accumulation + 1,
one rank's parameters drifting (#7985), a misreported norm (#7718's 1.63 for 4.74), an optimizer step at every
micro-batch, one rank's gradient 3% large under bf16 (#7985's size), the tied embedding losing one use's gradient
under bf16 ZeRO-2 (#8224); and one rank raising alone, after which the next run must still run on both."""

import argparse
import json

import pytest
import torch

from dstrain.train.doctor.probe import Probe

from ranks import free_port, run_ranks
from train_helpers import ROOT, ds_config, small_recipe

STEPS = 4
BUCKET = 20_000  # reduce_bucket_size of the bucket defect's ZeRO-2: the small model's gradients fill several buckets


class RaisesOnOneRank(Probe):
    """Rank 1 raises after step 2 while rank 0 goes on into the step's all-reduce: the ranks meet again after the
    collective timeout, and the next run starts on both."""

    def stepped(self, step: int) -> None:
        super().stepped(step)
        if step == 2 and self.rank == 1:
            raise RuntimeError("injected: rank 1 fails alone")


class ScaledBucket(Probe):
    """ZeRO-2's average_tensor doubles every other bucket's gradients."""

    def attach(self, engine) -> None:
        average, calls = engine.optimizer.average_tensor, [0]

        def scaled_every_other(tensor, communication_data_type):
            calls[0] += 1
            if calls[0] % 2:
                tensor.mul_(2.0)
            return average(tensor, communication_data_type)

        engine.optimizer.average_tensor = scaled_every_other
        super().attach(engine)


class DroppedMicroBatch(Probe):
    """Rank 1's first micro-batch of each step adds no gradient: the second overwrote it."""

    micro = 0

    def forward(self, step, batch, forward):
        loss = forward(batch)
        self.micro += 1
        return loss.detach() + 0.0 * loss if self.rank == 1 and self.micro % 2 else loss


class WrongDivisor(Probe):
    """The loss divided by accumulation + 1 before backward (DeepSpeed divides by the accumulation)."""

    def attach(self, engine) -> None:
        backward, steps = engine.backward, engine.gradient_accumulation_steps()
        engine.backward = lambda loss, **kw: backward(loss * steps / (steps + 1), **kw)
        super().attach(engine)


class DriftingRank(Probe):
    """Rank 1's copy of one parameter moves after step 2: the ranks no longer hold the same model."""

    def stepped(self, step: int) -> None:
        if step == 2 and self.rank == 1:
            with torch.no_grad():
                next(self.engine.module.parameters()).view(-1)[0] += 1e-3
        super().stepped(step)


class MisreportedNorm(Probe):
    """DeepSpeed reports a third of the norm it clipped by."""

    def stepped(self, step: int) -> None:
        self.engine._global_grad_norm = self.engine._global_grad_norm * 0.34
        super().stepped(step)


class StepEveryMicroBatch(Probe):
    """The engine takes an optimizer step after every backward: each step is two half-batches."""

    def attach(self, engine) -> None:
        engine.is_gradient_accumulation_boundary = lambda: True
        super().attach(engine)


class ScaledRank(Probe):
    """Rank 1's gradient is 3% large (its loss's value unchanged): ~1.5% on the reduced gradient's norm."""

    def forward(self, step, batch, forward):
        loss = forward(batch)
        return loss + 0.03 * (loss - loss.detach()) if self.rank == 1 else loss


class TiedUseLost(Probe):
    """On rank 1 the tied weight's embedding lookup passes no gradient: only the head's use reaches it."""

    def attach(self, engine) -> None:
        super().attach(engine)
        if self.rank == 1:
            engine.module.embed.tok.register_forward_hook(lambda module, args, out: out.detach() + 0.0 * out)


DEFECTS = {
    "zero2_one_rank_raises": ("zero2_acc2", RaisesOnOneRank, "failed"),
    "zero2_buckets": ("zero2", ScaledBucket, "strategies"),
    "zero2_overwrite": ("zero2_acc2", DroppedMicroBatch, "strategies"),
    "zero2_divisor": ("zero2_acc2", WrongDivisor, "strategies"),
    "zero2_drift": ("zero2_acc2", DriftingRank, "ranks agree"),
    "zero2_misreport": ("zero2_acc2", MisreportedNorm, "reported norm"),
    "zero2_every_micro_batch": ("zero2_acc2", StepEveryMicroBatch, "accumulation"),
    "zero2_bf16_scaled": ("zero2_bf16_acc2", ScaledRank, "strategies"),
    "zero2_bf16_tied_lost": ("zero2_bf16_tied", TiedUseLost, "tied parameter"),
}
FIRST_STEP = {"zero2_drift": 2}  # every other defect shows from step 1


def clone(run: dict, name: str) -> dict:
    """``run`` under another name and run folder."""
    folder = next(a for a in run["argv"] if a.startswith("run_dir="))
    argv = [f"{folder.rsplit('/', 1)[0]}/{name}" if a == folder else a for a in run["argv"]]
    return {**run, "name": name, "argv": argv}


def run_with_defects(runs: list[dict], probes: dict[str, type]) -> dict:
    """Rank target: every run as the doctor's ranks run them, each under its probe (a defect's, or the doctor's)."""
    from dstrain.train.doctor.runs import run_all

    return run_all(runs, probes)


@pytest.fixture(scope="module")
def doctor_report(tmp_path_factory, corpus):
    with pytest.MonkeyPatch.context() as env:  # the ranks inherit the environment
        env.setenv("DSTRAIN_DOCTOR_PORT", str(free_port()))  # the meeting between runs, as the command sets it
        env.setenv("DSTRAIN_COLLECTIVE_TIMEOUT_S", "30")  # rank 0's wait after rank 1 raised alone
        yield launch_with_defects(tmp_path_factory, corpus)


def launch_with_defects(tmp_path_factory, corpus):
    """One launch: the clean runs of the doctor's plan for ZeRO-2 and bf16 ZeRO-2, and every defect beside them."""
    from dstrain.commands.doctor import prepare
    from dstrain.commands.doctor_report import build_report

    tmp_path = tmp_path_factory.mktemp("doctor_defects")
    recipe = small_recipe(tmp_path, corpus, model={"doc_masking": True})
    configs = [str(ROOT / "ds_configs" / f"{name}.json") for name in ("zero2", "zero2_bf16")]
    out = tmp_path / "doctor"
    args = argparse.Namespace(
        recipe=str(recipe), deepspeed_configs=configs, nproc=2, steps=STEPS, out=out, overrides=[], quick=False
    )
    args.at_recipe_size = False
    _, runs, refused, _, _, _ = prepare(args)
    runs = [run for run in runs if run["name"] != "zero1_then_zero3"]  # the resume check: the launcher test's
    by_name = {run["name"]: run for run in runs}
    bucketed = ds_config(tmp_path, "zero2", zero_optimization={"stage": 2, "reduce_bucket_size": BUCKET})
    for name, (source, _, _) in DEFECTS.items():
        runs.append(clone(by_name[source], name))
    buckets = next(run for run in runs if run["name"] == "zero2_buckets")
    buckets["argv"] = [str(bucketed) if a.endswith("zero2.json") else a for a in buckets["argv"]]
    codes = run_ranks(2, run_with_defects, runs, {name: probe for name, (_, probe, _) in DEFECTS.items()})
    assert codes[0] == codes[1] == {run["name"]: int(run["name"] == "zero2_one_rank_raises") for run in runs}
    (out / "codes.json").write_text(json.dumps(codes[0]))
    (out / "checks.json").write_text("[]")
    context = {"recipe": str(recipe), "ranks": 2, "steps": STEPS, "launch": 0, "quick": True}
    code = build_report(out, runs, refused, context)
    return code, json.loads((out / "doctor.json").read_text()), out


@pytest.mark.distributed
def test_every_injected_defect_fails_naming_its_run_check_and_step(doctor_report):
    code, report, out = doctor_report
    assert code == 1
    status = {s["name"]: s for s in report["strategies"]}
    rows = {row["name"]: row for row in report["gradient_checks"]}
    for name, (_, _, check) in DEFECTS.items():
        step = FIRST_STEP.get(name, 1)
        if check == "failed":
            assert status[name]["status"] == "failed" and "injected: rank 1 fails alone" in status[name]["reason"]
        elif check == "strategies":
            assert status[name]["status"] == "MISMATCH", status[name]
            assert status[name]["first_diverging_step"] == step, (name, status[name])
        else:
            assert any(f.startswith(f"{name}: step {step}:") for f in rows[check]["failures"]), (name, rows[check])
    assert "zero2_bf16_scaled" in (out / "report.md").read_text()


@pytest.mark.distributed
def test_the_clean_runs_beside_the_defects_pass_every_check(doctor_report):
    """Every layout accumulates (ZeRO-2 at 2 beside its shipped accumulation 1), the tolerances come from the twins,
    and a clean run fails no row: the rows' failures are the defects' alone."""
    _, report, _ = doctor_report
    status = {s["name"]: s for s in report["strategies"]}
    clean = ("zero2", "zero2_acc2", "zero2_bf16_acc2", "zero2_bf16_tied")
    for name in clean:
        assert status[name]["status"] == "ok", status[name]
    assert (status["zero2"]["accumulation"], status["zero2_acc2"]["accumulation"]) == (1, 2)
    assert status["zero0_reordered"]["status"] == "twin" and status["zero1_bf16"]["status"] == "baseline"
    # fp32: at most 10 x the twin and at least 1e-6 at every step; bf16 tighter than the former fixed 2e-2
    assert max(status["zero2_acc2"]["tolerances"]) <= 1e-5
    assert max(status["zero2_bf16_acc2"]["tolerances"]) < 1e-2
    assert status["zero2_bf16_scaled"]["max_norm_rel"] < 2e-2  # what the fixed 2e-2 against fp32 let by
    for row in report["gradient_checks"]:
        assert not any(f.split(":")[0] in clean for f in row["failures"]), row
        assert set(clean) <= set(row["checked"]) or row["name"] == "tied parameter", row
    assert "zero2_bf16_tied" in {r for row in report["gradient_checks"] for r in row["checked"]}
    norms = next(row for row in report["gradient_checks"] if row["name"] == "reported norm")
    assert norms["worst"] is not None and norms["worst"] > 0.5  # the misreport's 0.66, beside clean ones at ~1e-7
