"""The GPU check's parts for this round's features (bench/gpu_check.py runs them after the headline figures): what
each changes on a GPU path, against the same run without it. Each part: a correctness verdict (fp32, the features'
own tolerance) and, on a GPU, the speed and peak memory it costs or saves.

- loss_chunking: the loss whole (``tiling.loss`` 1) against chunked (fused linear cross-entropy: the head's
  gradients formed in the loss's forward, model/chunked_loss.py), on gpt2-125m at the speed part's micro-batch, where
  the default ("auto") already chunks: 12·T·V of the whole loss is 18.4 GiB at micro-batch 32. Expected: the chunked
  rows (the speed part's) at least as fast as the whole loss's, with less peak memory;
- latent_attention: DeepSeek's MLA with doc masking on the device against the CPU's dense mask, and its speed
- moe_recompute: a mixture of experts with activation checkpointing against without (the router losses' gradient
  reaches the router through the checkpoint), Mixtral's router and Llama 4's (input scaling, a shared expert) with
  the sequence-wise balancing loss, then its speed on a GPU;
- windowed_attention: sliding windows (3 local blocks, 1 global, as Gemma 3's pattern) with sinks (GPT-OSS) through
  FlexAttention's block mask on a GPU against the dense mask on the CPU, then its speed against full attention;
- sft_loss: instruction tuning's masked loss (scripts/demo-sft's conversations) on a GPU against the CPU;
- chunked_attention: Llama 4's attention (issue 50: 32-token chunks on 3 blocks, a block without RoPE with temperature
  tuning, the weightless q/k norm) through FlexAttention's block mask on a GPU against the dense mask on the CPU.
- doctor: `dstrain doctor` on tiny, every shipped strategy the GPUs can run against ZeRO-0, and the kernel checks.
- preference_step: the DPO step (recipes/dpo-tiny.yaml on the stdlib pairs, a random tiny init_from) under ZeRO-2
  against ZeRO-0 on the device (fp32, 1e-5: losses and pre-clip grad norms), then bench/bench_dpo.py's trainer part
  on it: the DPO step over the SFT step through the Trainer on the same pairs (target <= 1.05), and the reference
  pass over one epoch of training.
- rl_decode: bench/bench_rl.py on the device: the KV-cache decode's greedy tokens against the CPU's (fp32, token for
  token), tokens generated per second with and without the cache, the generation share of an RL step.
- long_context: a 131,072-token step of a 1B llama (llama-1b-32k's model) with the long-context levers (activation
  checkpoints held on the host, the chunked loss, the tiled MLP; sequence parallelism over the loan's devices, none
  on a world of one), its peak device memory against `dstrain estimate`'s.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_parts import CONFIGS, ROOT, Check, compare, peak_gib, speed, status

ON_CPU = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}  # the reference run of a device comparison
WINDOWED = [
    "model.sliding_window=32",
    "model.layer_types=[sliding_attention, sliding_attention, sliding_attention, full_attention]",
    "model.attention_sinks=true",
]

CHUNKED = [
    "model.attention_chunk=32",
    "model.layer_types=[chunked_attention, chunked_attention, chunked_attention, full_attention]",
    "model.nope_layers=[3]",
    "model.qk_norm=l2",
    "model.attn_temperature_floor=16",
]


LLAMA4_MOE = [
    "model.moe.top_k=1",
    "model.moe.input_scaling=true",
    "model.moe.n_shared_experts=1",
    "model.moe.aux_loss_kind=sequence",
]


def _config(check: Check, name: str, base: str, **sections) -> object:
    return check.config_file(name, json.loads((CONFIGS / base).read_text()) | sections)


def loss_chunking(check: Check, steps: int, speed_plan: tuple | None) -> list[dict]:
    """Chunked against whole on tiny (fp32, 1e-6 relative), then gpt2-125m's speed and memory with the loss whole
    beside the speed part's rows (chunked by default, fused: no recompute of the head)."""
    whole = check.train("loss-whole", "tiny", _config(check, "loss-whole", "zero1.json", tiling={"loss": 1}), [], steps)
    chunked = check.train(
        "loss-chunked", "tiny", _config(check, "loss-chunked", "zero1.json", tiling={"loss": 4}), [], steps
    )
    rows = [compare(check, "chunked loss (4) vs whole", chunked, whole, 1e-6, steps)]
    if speed_plan:
        recipe, seq, micros, _ = speed_plan
        rows += speed(check, recipe, seq, micros, ["loss_whole"], steps)
    return rows


def moe_recompute(check: Check, steps: int, on_gpu: bool) -> list[dict]:
    """tiny-moe with activation checkpointing against without (fp32, 1e-6), then both in bf16 for speed and memory."""
    plain = _config(check, "moe-plain", "zero1.json")
    recompute = _config(check, "moe-recompute", "zero1.json", activation_checkpointing={})
    runs = {
        name: check.train(f"moe-{name}", "tiny-moe", path, [], steps)
        for name, path in (("plain", plain), ("recompute", recompute))
    }
    rows = [compare(check, "MoE recompute vs not", runs["recompute"], runs["plain"], 1e-6, steps)]
    llama4 = {  # Llama 4's experts (input scaled by the score before the dispatch) and the sequence-wise loss
        name: check.train(f"moe-llama4-{name}", "tiny-moe", path, LLAMA4_MOE, steps)
        for name, path in (("plain", plain), ("recompute", recompute))
    }
    name = "Llama 4 MoE, sequence-wise loss: recompute vs not"
    rows.append(compare(check, name, llama4["recompute"], llama4["plain"], 1e-6, steps))
    if on_gpu:
        for name, base, sections in (
            ("plain-bf16", "zero1_bf16.json", {}),
            ("recompute-bf16", "zero1_bf16.json", {"activation_checkpointing": {}}),
        ):
            run = check.train(f"moe-{name}", "tiny-moe", _config(check, f"moe-{name}", base, **sections), [], steps)
            rows.append(_speed_row(f"tiny-moe {name}", run))
    return rows


def windowed_attention(check: Check, steps: int) -> list[dict]:
    """tiny with WINDOWED on this device against the CPU's dense mask (fp32, 1e-4, as document masking), then its
    speed and peak memory beside full attention's."""
    import torch

    config = _config(check, "window-zero1", "zero1.json")
    windowed = check.train("window-device", "tiny", config, WINDOWED, steps)
    if not torch.cuda.is_available():
        return [check.verdict("windows and sinks, this device", windowed["rc"] == 0, f"{status(windowed)}; no CUDA")]
    dense = check.train("window-cpu", "tiny", config, WINDOWED, steps, env=ON_CPU)
    full = check.train("window-full", "tiny", config, [], steps)
    return [
        compare(check, "windows and sinks: FlexAttention (GPU) vs dense mask (CPU)", windowed, dense, 1e-4, steps),
        _speed_row("tiny windowed", windowed),
        _speed_row("tiny full attention", full),
    ]


def chunked_attention(check: Check, steps: int) -> list[dict]:
    """tiny with CHUNKED on this device against the CPU's dense mask (fp32, 1e-4), then its speed and peak memory."""
    import torch

    config = _config(check, "chunk-zero1", "zero1.json")
    chunked = check.train("chunk-device", "tiny", config, CHUNKED, steps)
    if not torch.cuda.is_available():
        return [check.verdict("Llama 4's chunks, this device", chunked["rc"] == 0, f"{status(chunked)}; no CUDA")]
    dense = check.train("chunk-cpu", "tiny", config, CHUNKED, steps, env=ON_CPU)
    return [
        compare(check, "Llama 4's chunks: FlexAttention (GPU) vs dense mask (CPU)", chunked, dense, 1e-4, steps),
        _speed_row("tiny chunked (Llama 4)", chunked),
    ]


# DeepSeek's latent attention (model/mla.py) with doc masking: FlexAttention with v narrower than q and k
LATENT = [
    "model.n_kv_head=null",
    "model.doc_masking=true",
    "model.mla={kv_lora_rank: 32, q_lora_rank: 48, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 24}",
]


def latent_attention(check: Check, steps: int) -> list[dict]:
    """tiny with LATENT on this device against the CPU's dense mask (fp32, 1e-4, as document masking), then its speed
    and peak memory beside the plain attention's."""
    import torch

    config = _config(check, "mla-zero1", "zero1.json")
    latent = check.train("mla-device", "tiny", config, LATENT, steps)
    if not torch.cuda.is_available():
        return [check.verdict("latent attention, this device", latent["rc"] == 0, f"{status(latent)}; no CUDA")]
    dense = check.train("mla-cpu", "tiny", config, LATENT, steps, env=ON_CPU)
    plain = check.train("mla-plain", "tiny", config, ["model.doc_masking=true"], steps)
    return [
        compare(check, "latent attention: FlexAttention (GPU) vs dense mask (CPU)", latent, dense, 1e-4, steps),
        _speed_row("tiny latent attention", latent),
        _speed_row("tiny GQA attention", plain),
    ]


def sft_loss(check: Check, steps: int) -> list[dict]:
    """tiny from random weights tuned on scripts/demo-sft's conversations (prepared with the demo corpus's tokenizer,
    --chat: the loss mask) on this device, against the same run on the CPU (fp32, 1e-4)."""
    import torch

    chat = check.work / "pydocs-chat"
    if not (chat / "manifest.json").exists():
        raw = check.work / "pydocs-chat.jsonl"
        corpus = [sys.executable, "-m", "dstrain.data.chat_corpus", str(raw), "--max-examples", "400"]
        subprocess.run(corpus, env=check.env, check=True, capture_output=True)
        template = ROOT / "recipes" / "chat_templates" / "role-lines.jinja"
        prepare = ["prepare", "--dataset", str(raw), "--tokenizer", str(check.data / "tokenizer"), "--chat"]
        prepare += ["--chat-template", str(template), "--out", str(chat)]
        subprocess.run([sys.executable, "-m", "dstrain", *prepare], env=check.env, check=True, capture_output=True)
    config = _config(check, "sft-zero1", "zero1.json")
    tuning = [f"data.sources=[{{path: {chat}}}]", "data.sft=true", "data.overlong=truncate"]
    run = check.train("sft-device", "tiny", config, tuning, steps)
    if not torch.cuda.is_available():
        return [check.verdict("SFT masked loss, this device", run["rc"] == 0, f"{status(run)}; no CUDA")]
    reference = check.train("sft-cpu", "tiny", config, tuning, steps, env=ON_CPU)
    return [compare(check, "SFT masked loss: GPU vs CPU", run, reference, 1e-4, steps)]


LONG_CONTEXT = ("llama-1b-32k", 131072)  # (recipe, tokens per sample) on a GPU
DRY_LONG_CONTEXT = ("tiny", 256)
LONG_CONTEXT_STEPS = 4


def long_context(check: Check, steps: int, dry: bool) -> list[dict]:
    """Peak device memory of one long sample's steps against the estimate's device peak (and its host memory)."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.plan.memory import estimate_file

    recipe_name, seq = DRY_LONG_CONTEXT if dry else LONG_CONTEXT
    steps = min(steps, LONG_CONTEXT_STEPS)  # a memory figure: a few steps (~15 s each on an H100)
    levers = {
        "train_micro_batch_size_per_gpu": 1,
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True},
        "tiling": {"loss": 4 if dry else "auto", "mlp": 4},
    }
    path = _config(check, "long-context", "zero1.json" if dry else "zero3_bf16.json", **levers)
    overrides = [f"data.seq_len={seq}", "train.global_batch=1", f"model.max_seq_len={seq}"]
    recipe_file = ROOT / "recipes" / f"{recipe_name}.yaml"
    recipe = load_recipe_and_source(recipe_file, overrides + [f"data.sources=[{{path: {check.data}}}]"])[0]
    est = estimate_file(recipe, path, 1, 1)
    run = check.train("long-context", recipe_name, path, overrides, steps)
    measured = max((r.get("mem_peak_bytes") or 0 for r in run["records"]), default=0)
    detail = f"{status(run)}; {seq} tokens, world of one (SP 1), host-held checkpoints, chunked loss, tiled MLP"
    row = check.verdict(f"long context: {recipe_name} at {seq} tokens", run["rc"] == 0, detail)
    row.update(
        measured_gib=round(measured / 2**30, 2),
        estimated_gib=round(est.peak("device") / 2**30, 2),
        error=round(est.peak("device") / measured - 1, 3) if measured else None,
        host_gib=round(est.peak("cpu") / 2**30, 2),
        seconds=run["seconds"],
    )
    return [row]


def _speed_row(name: str, run: dict) -> dict:
    """Tokens per second (the best logged step after the first third) and peak device memory of one run."""
    timed = run["records"][len(run["records"]) // 3 :]
    return {
        "check": name,
        "ok": run["rc"] == 0,
        "detail": status(run),
        "tokens_per_s": max((r.get("tokens_per_s") or 0 for r in timed), default=None),
        "mem_peak_gib": peak_gib(run),
    }


def doctor(check: Check, dry: bool) -> list[dict]:
    """`dstrain doctor` on tiny as a user runs it: every shipped strategy this machine can run against ZeRO-0, the
    kernels (FusedAdam, FlexAttention, the chunked loss) and the collectives; on every device here (a dry run on
    the CPU: ZeRO-2 only, 2 ranks). One row per strategy and per kernel check; the part fails if doctor does."""
    import torch

    out = check.work / "doctor"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "dstrain", "doctor", "--recipe", str(ROOT / "recipes" / "tiny.yaml")]
    command += ["--out", str(out), f"data.sources=[{{path: {check.data}}}]"]
    if dry or not torch.cuda.is_available():
        command += ["--nproc", "2", "--deepspeed_configs", str(CONFIGS / "zero2.json")]
    done = subprocess.run(command, env=check.env, capture_output=True, text=True)
    (check.work / "logs" / "doctor.log").write_text(" ".join(command) + "\n\n" + done.stdout + done.stderr)
    if not (out / "doctor.json").exists():
        return [check.verdict("dstrain doctor", False, f"exit {done.returncode}: {done.stderr.strip()[-300:]}")]
    report = json.loads((out / "doctor.json").read_text())
    rows = [check.verdict("dstrain doctor", done.returncode == 0, f"exit {done.returncode}; {out / 'report.md'}")]
    for s in report["strategies"]:
        if s["status"] not in ("baseline", "cannot run here"):
            figures = f"loss {s['max_loss_rel']}, grad norm {s['max_norm_rel']} (tolerance {s['tolerance']})"
            rows.append({"check": f"doctor: {s['name']}", "ok": s["status"] in ("ok", "twin"), "detail": figures})
    rows += [
        {"check": f"doctor: {c['name']}", "ok": c["ok"], "detail": f"{c['value']}: {c['detail']}"}
        for c in report["checks"]
    ]
    return rows


# bench/bench_dpo.py's trainer part: a dry run's toy size, and on a GPU a model large enough to outweigh the launches
DRY_DPO_BENCH = ["--blocks", "1", "--steps", "3", "--seq-len", "64"]
DPO_BENCH = ["--blocks", "2", "--steps", "10", "--seq-len", "512", "--d-model", "512", "--layers", "8"]


def _pair_folder(check: Check, conversations: int) -> Path:
    """The stdlib pairs (dstrain.data.chat_corpus --pairs) prepared with the demo corpus's tokenizer, role-lines."""
    pairs = check.work / "pydocs-pairs"
    if not (pairs / "manifest.json").exists():
        raw = check.work / "pydocs-pairs.jsonl"
        corpus = [sys.executable, "-m", "dstrain.data.chat_corpus", str(raw), "--pairs"]
        subprocess.run([*corpus, "--max-examples", str(conversations)], env=check.env, check=True, capture_output=True)
        template = ROOT / "recipes" / "chat_templates" / "role-lines.jinja"
        prepare = ["prepare", "--dataset", str(raw), "--tokenizer", str(check.data / "tokenizer"), "--chat"]
        prepare += ["--chat-template", str(template), "--out", str(pairs)]
        subprocess.run([sys.executable, "-m", "dstrain", *prepare], env=check.env, check=True, capture_output=True)
    return pairs


def preference_step(check: Check, steps: int, dry: bool) -> list[dict]:
    """ZeRO-2 against ZeRO-0 on this device (fp32, 1e-5), then the DPO step over the SFT step and the reference pass
    over an epoch (bench/bench_dpo.py, wall clock: its ratio is reported against the target, not judged)."""
    from bench_dpo_trainer import reference_folder

    pairs = _pair_folder(check, 40 if dry else 400)
    tuning = [f"init_from={reference_folder(check.work, pairs)}", f"data.sources=[{{path: {pairs}}}]"]
    runs = {
        stage: check.train(f"dpo-{stage}", "dpo-tiny", _config(check, f"dpo-{stage}", f"{stage}.json"), tuning, steps)
        for stage in ("zero0", "zero2")
    }
    rows = [compare(check, "DPO step: ZeRO-2 vs ZeRO-0, this device", runs["zero2"], runs["zero0"], 1e-5, steps)]
    figures = check.work / "bench-dpo.json"
    command = [sys.executable, str(ROOT / "bench" / "bench_dpo.py"), "--part", "trainer", "--pair-folder", str(pairs)]
    command += ["--json", str(figures), *(DRY_DPO_BENCH if dry else DPO_BENCH)]
    done = subprocess.run(command, env=check.env, capture_output=True, text=True)
    (check.work / "logs" / "bench-dpo.log").write_text(" ".join(command) + "\n\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        return rows + [check.verdict("DPO step / SFT step (Trainer)", False, f"exit {done.returncode}")]
    wall = json.loads(figures.read_text())["wall"]
    detail = (
        f"DPO {wall['dpo_step_s'] * 1e3:.1f} ms / SFT {wall['sft_step_s'] * 1e3:.1f} ms a step "
        f"(target <= 1.05); reference pass {wall['reference_pass_s']:.2f} s / epoch {wall['epoch_s']:.2f} s"
    )
    ratios = {key: round(wall[key], 3) for key in ("dpo_over_sft", "reference_over_epoch")}
    return rows + [check.verdict("DPO step / SFT step, reference pass / epoch (Trainer)", True, detail, **ratios)]


def rl_decode(check: Check, dry: bool) -> list[dict]:
    """bench/bench_rl.py on the device: the KV-cache decode's greedy tokens against the CPU's (fp32, token for token),
    tokens generated per second with and without the cache, and the generation share of an RL step."""
    figures = check.work / "bench-rl.json"
    command = [sys.executable, str(ROOT / "bench" / "bench_rl.py"), "--check-cpu", "--json", str(figures)]
    command += ["--batch", "8", "--new-tokens", "16"] if dry else ["--batch", "64", "--new-tokens", "256"]
    done = subprocess.run(command, env=check.env, capture_output=True, text=True)
    (check.work / "logs" / "bench-rl.log").write_text(" ".join(command) + "\n\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        return [check.verdict("RL decode (KV cache)", False, f"exit {done.returncode}")]
    f = json.loads(figures.read_text())
    same = f["greedy_same_as_cpu"] == 1.0
    detail = (
        f"greedy tokens equal to the CPU's: {f['greedy_same_as_cpu']:.3f}; {f['cached_tokens_per_s']:.0f} tokens/s "
        f"with the cache, {f['kv_cache_speedup']:.1f}x without; generation share of a step {f['generation_share']:.2f}"
    )
    keys = ("cached_tokens_per_s", "kv_cache_speedup", "generation_share")
    return [check.verdict("RL decode: device greedy = CPU greedy", same, detail, **{k: round(f[k], 3) for k in keys})]
