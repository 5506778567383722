"""dstrain on one GPU, in one command that fits a short loan: speed and MFU, precision, memory, CUDA tests, kernels.

    python3 bench/gpu_check.py OUT --budget-s 420 --skip-done bench/gpu_check_done.json     (on the GPU machine)
    .venv/bin/python bench/gpu_check.py OUT --dry-run      (CPU, toy sizes: the same code paths, for CI)

The parts run in a fixed priority order (bench/gpu_plan.py, with their estimates). The plan (each part and its
estimated seconds) is printed before the first part starts; a part whose estimate no longer fits what is left of
--budget-s is skipped, saying so;
--skip-done FILE (the gpu_check.json of an earlier loan) skips the parts it measured and carries their figures
over, so two or three short loans add up to the whole table. After every part OUT/gpu_check.json (every figure),
OUT/gpu_check.md (the tables) and OUT/logs.tar.gz are rewritten: a command cut off at its limit still returns
what it finished. Run folders, configs and the unpacked wheels live in --work (default: a temporary folder).

Installs nothing over the machine's torch: wheels from --wheels (built here by `scripts/gpu-wheels`) are unpacked
into WORK/site and put on the path of every run; the demo corpus (data/pydocs) is carried with the working tree
(prepared here if missing). FusedAdam is the one thing compiled there (its JIT build is timed in `precision`).
Exit 1 if a check fails, 2 if --skip-done cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import gpu_parts as parts
from gpu_plan import Part, plan_parts
from gpu_report import write_report

ROOT = Path(__file__).resolve().parents[1]


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def setup_environment(work: Path, wheels: Path | None) -> dict:
    """PYTHONPATH for every run: the repository's src, then the unpacked wheels (never over the machine's torch)."""
    paths = [str(ROOT / "src")]
    if wheels and any(wheels.glob("*.whl")):
        site = work / "site"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        subprocess.run([*pip, "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
        paths.append(str(site))
    # A rendezvous the caller had (a test process that started a process group, say) may still hold its port: each
    # of the check's runs is a world of one that takes a free port of its own.
    inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env = dict(
        inherited,
        PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HUB_OFFLINE="1",
        NVIDIA_TF32_OVERRIDE="0",
        PYTHONUNBUFFERED="1",
    )
    sys.path[:0] = paths
    return env


def ensure_data(data: Path, env: dict) -> None:
    """The demo corpus, prepared as scripts/demo does; carried to the GPU machine, so made there only if missing."""
    if (data / "manifest.json").exists():
        return
    raw = ROOT / "data" / "raw" / "pydocs.jsonl"
    subprocess.run([sys.executable, "-m", "dstrain.data.corpus", str(raw)], env=env, check=True)
    prepare = ["prepare", "--dataset", str(raw), "--train-tokenizer", "4096", "--out", str(data)]
    subprocess.run([sys.executable, "-m", "dstrain", *prepare], env=env, check=True)


def machine() -> dict:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": torch.version.cuda,
        "accelerator": get_accelerator().device_name(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    return info


def read_done(path: Path | None) -> dict:
    """{part: its entry} of the parts an earlier loan measured; a file not there yet means none."""
    if path is None:
        return {}
    if not path.exists():
        print(f"--skip-done {path}: not there yet, so no part was measured before", flush=True)
        return {}
    try:
        earlier = json.loads(path.read_text())
        entries = earlier["parts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"gpu_check: error: --skip-done {path}: not a gpu_check.json ({type(e).__name__}: {e})", file=sys.stderr)
        raise SystemExit(2) from None
    when = earlier.get("started", "?")
    return {
        name: {**entry, "measured": entry.get("measured", when)}
        for name, entry in entries.items()
        if entry.get("status") == "done"
    }


def calibration(done: dict, dry_run: bool) -> float:
    """Measured over estimated seconds of the parts an earlier loan ran: the factor for this loan's estimates."""
    timed = [e for e in done.values() if e.get("seconds") and e.get("estimated_s")]
    if dry_run or not timed:
        return 1.0
    scale = sum(e["seconds"] for e in timed) / sum(e["estimated_s"] for e in timed)
    print(f"estimates x {scale:.2f}: measured over estimated seconds of the {len(timed)} parts done before", flush=True)
    return scale


def print_plan(plan: list[Part], done: dict, budget_s: float | None) -> None:
    print(f"plan ({'no budget' if budget_s is None else f'budget {budget_s:.0f} s'}), in priority order:", flush=True)
    total = 0.0
    for part in plan:
        if part.name in done:
            print(f"  {part.name:<18} done on {done[part.name]['measured']}: skipped", flush=True)
            continue
        total += part.estimate_s
        print(f"  {part.name:<18} ~{part.estimate_s:5.0f} s   (cumulative ~{total:.0f} s)", flush=True)


def run_part(part: Part, check: parts.Check) -> dict:
    started = time.monotonic()
    try:
        entry = {"status": "done", "rows": part.run(check)}
    except parts.Skipped as e:
        entry = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # a broken part must not cost the loan the parts after it
        (check.work / "logs" / f"{part.name}.error.log").write_text(traceback.format_exc())
        entry = {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        check.failures.append(f"{part.name}: {entry['reason']}")
    entry.update(seconds=round(time.monotonic() - started, 1), estimated_s=round(part.estimate_s))
    return entry


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.md, gpu_check.json and logs.tar.gz")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds this command may take in all")
    parser.add_argument("--skip-done", type=Path, default=None, help="an earlier gpu_check.json: skip what it measured")
    parser.add_argument("--parts", nargs="+", default=None, help="only these parts (default: all, in priority order)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheelhouse from scripts/gpu-wheels")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "pydocs", help="prepared corpus (made if missing)")
    parser.add_argument("--work", type=Path, default=None, help="run folders, configs, logs (default: a temp folder)")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on any device (CI runs this on a CPU)")
    args = parser.parse_args()
    plan = plan_parts(args.dry_run)
    unknown = sorted(set(args.parts or []) - {p.name for p in plan})
    if unknown:
        parser.error(f"--parts {' '.join(unknown)}: no such part; choose from {' '.join(p.name for p in plan)}")
    plan = [p for p in plan if args.parts is None or p.name in args.parts]
    done = read_done(args.skip_done)
    scale = calibration(done, args.dry_run)
    for part in plan:
        part.estimate_s *= scale
    print_plan(plan, done, args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dstrain-gpu-check-"))
    check = parts.Check(args.out, work, args.data, args.dry_run, setup_environment(work, args.wheels))
    ensure_data(args.data, check.env)
    figures = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "machine": machine(),
        "parts": {},
    }
    for part in plan:
        left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
        if part.name in done:
            figures["parts"][part.name] = done[part.name]
        elif left is not None and part.estimate_s > left:
            reason = f"estimated {part.estimate_s:.0f} s, {max(left, 0):.0f} s of the budget left"
            figures["parts"][part.name] = {"status": "skipped", "reason": reason, "estimated_s": round(part.estimate_s)}
        else:
            figures["parts"][part.name] = run_part(part, check)
        write_report(args.out, work, figures, plan, check.failures)  # after every part: a cut-off command keeps it
        entry = figures["parts"][part.name]
        print(f"{part.name}: {entry['status']} ({entry.get('reason') or str(entry.get('seconds')) + ' s'})", flush=True)
    print((args.out / "gpu_check.md").read_text())
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
