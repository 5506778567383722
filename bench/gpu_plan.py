"""The GPU check's plan (bench/gpu_check.py runs it): its parts in priority order, each with what it measures, its
columns and its estimated seconds on a GPU or in the CPU dry run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_adapters as adapters
import gpu_features as features
import gpu_parts as parts
import yaml

ROOT = Path(__file__).resolve().parents[1]
MEMORY_CONFIGS = ["zero0.json", "zero1_bf16.json", "zero2_bf16.json", "zero3_bf16.json"]
MEMORY_CONFIGS += ["zero2_offload.json", "zero3_offload.json"]
SPEED_125M = ("gpt2-125m", 1024, [32, 16], ["eager", "compile"])
SPEED_1_3B = ("gpt-1.3b", 2048, [8, 4], ["eager", "compile"])
MEMORY_MODELS = [("gpt2-125m", 8, 1024), ("gpt2-350m", 8, 1024), ("gpt-1.3b", 2, 2048)]  # (recipe, micro, seq)
DRY_MEMORY = ("tiny", 2, 64)
DRY_SPEED = ("tiny", 64, [4, 2], ["eager"])  # torch.compile is left to the GPU (minutes on 2 cores)
SPEED_STEPS, PRECISION_STEPS, MEMORY_STEPS, DRY_STEPS, PROFILE_STEPS = 30, 20, 5, 4, 10

# The estimate of a part: training runs x (start-up + steps at an assumed MFU) + what compiles. Start-up is the
# process, the imports, the data index, the engine and the final evaluation; the GPU figures are guesses to be
# replaced by the times the first loan measures (gpu_check.json keeps both), the CPU ones measured here.
ASSUMED_MFU, BF16_PEAK = 0.3, 989e12  # H100 SXM dense bf16
RUN_START_S = {True: 14.0, False: 35.0}  # {dry run: seconds}
COMPILE_S, FLEX_COMPILE_S, FUSED_ADAM_BUILD_S, CPU_ADAM_BUILD_S = 90.0, 30.0, 90.0, 60.0
CHAT_PREPARE_S = 20.0  # scripts/demo-sft's conversations, built and prepared (--chat) once
HOST_ADAM_BYTES_PER_S = 4e9  # DeepSpeedCPUAdam over 16 bytes per parameter per step


def flops_per_token(recipe: str, seq: int) -> tuple[float, int]:
    from dstrain.model.config import GPTConfig
    from dstrain.model.counts import flops_per_token, num_params

    model = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["model"]
    config = GPTConfig(**{"vocab_size": 4096, **model, "max_seq_len": seq})
    return flops_per_token(config, seq), num_params(config)


def run_s(dry: bool, recipe: str, seq: int, micro: int, steps: int, offload: bool = False) -> float:
    flops, params = flops_per_token(recipe, seq)
    step = 0.05 if dry else flops * micro * seq / (BF16_PEAK * ASSUMED_MFU)
    host_adam = 16 * params / HOST_ADAM_BYTES_PER_S if offload else 0.0
    return RUN_START_S[dry] + 10 * params / 1e9 + steps * (step + host_adam)


def speed_s(dry: bool, plan: tuple, steps: int) -> float:
    recipe, seq, micros, variants = plan
    compiles = sum(COMPILE_S for v in variants if v == "compile")
    return len(variants) * run_s(dry, recipe, seq, 2 * micros[0], steps) + (0 if dry else compiles)


def memory_s(dry: bool, recipe: str, micro: int, seq: int, configs: list[str]) -> float:
    offloads = [c for c in configs if "offload" in c]
    runs = sum(run_s(dry, recipe, seq, micro, MEMORY_STEPS, offload="offload" in c) for c in configs)
    return runs + (CPU_ADAM_BUILD_S if offloads and not dry else 0.0)


@dataclass
class Part:
    name: str
    run: Callable[[parts.Check], list[dict]]
    estimate_s: float
    columns: list[str]
    title: str


VERDICT = ["check", "ok", "detail"]
SPEED = ["recipe", "variant", "seq_len", "micro_batch", "tokens_per_s", "tflops_per_device", "mfu", "mem_peak_gib"]
SPEED += ["status"]
PROFILE = ["recipe", "wall_ms_per_step", "kernel_ms_per_step", "outside_kernels_ms_per_step", "launches_per_step"]
PROFILE += ["kernel", "count", "ms", "share"]
MEMORY = ["recipe", "ds_config", "micro_batch", "seq_len", "measured_gib", "estimated_gib", "error", "status"]


def plan_parts(dry: bool) -> list[Part]:
    """Every part, in priority order, with its estimate for this mode (a dry run: toy sizes on a CPU)."""
    steps = DRY_STEPS if dry else None
    s125, s13 = (DRY_SPEED, DRY_SPEED) if dry else (SPEED_125M, SPEED_1_3B)
    mem_configs = ["zero1.json"] if dry else MEMORY_CONFIGS
    speed_steps, precision_steps, memory_steps = steps or SPEED_STEPS, steps or PRECISION_STEPS, 2 if dry else 5
    profile_steps = 5 if dry else PROFILE_STEPS  # 3 profiled after the warm-up
    recipes = ["tiny"] if dry else ["tiny", "gpt2-125m", "gpt-1.3b"]
    tiny = run_s(dry, "tiny", 128, 16, precision_steps)
    result = [
        Part(
            "profile_gpt2_125m",
            lambda c: parts.profile(c, s125[0], s125[1], s125[2][0], profile_steps),
            run_s(dry, s125[0], s125[1], 2 * s125[2][0], profile_steps),
            PROFILE,
            "Where gpt2-125m's step time goes (torch.profiler over 3 steps, eager, zero1_bf16)",
        ),
        Part(
            "speed_gpt2_125m",
            lambda c: parts.speed(c, *s125, speed_steps),
            speed_s(dry, s125, speed_steps),
            SPEED,
            "Speed and MFU of gpt2-125m (bf16, zero1_bf16, world of one; eager and compile)",
        ),
        Part(
            "loss_chunking",
            lambda c: features.loss_chunking(c, precision_steps, None if dry else SPEED_125M),
            2 * tiny + (0 if dry else speed_s(dry, (*SPEED_125M[:3], ["eager"]), speed_steps)),
            VERDICT + SPEED[:2] + SPEED[4:8],
            "The fused chunked loss against whole (tiny, fp32), then gpt2-125m with the loss whole (speed, memory)",
        ),
        Part(
            "speed_gpt_1_3b",
            lambda c: parts.speed(c, *s13, speed_steps),
            speed_s(dry, s13, speed_steps),
            SPEED,
            "Speed and MFU of gpt-1.3b (bf16, zero1_bf16, world of one; eager and compile)",
        ),
        Part(
            "precision",
            lambda c: parts.precision(c, precision_steps),
            (2 if dry else 4) * tiny + (0 if dry else FUSED_ADAM_BUILD_S),
            VERDICT,
            "bf16 and fp16 with FusedAdam against fp32 torch AdamW (tiny, world of one)",
        ),
    ]
    for recipe, micro, seq in MEMORY_MODELS:
        sized = DRY_MEMORY if dry else (recipe, micro, seq)
        result.append(
            Part(
                f"memory_{recipe.replace('-', '_').replace('.', '_')}",
                lambda c, sized=sized: parts.memory(c, *sized, mem_configs, memory_steps),
                memory_s(dry, *sized, mem_configs),
                MEMORY,
                f"Peak device memory of {sized[0]} against `dstrain estimate`",
            )
        )
    if dry:  # memory_* share one code path; in a dry run (toy sizes) the first stands for all
        result = [p for p in result if p.name not in ("speed_gpt_1_3b", "memory_gpt2_350m", "memory_gpt_1_3b")]
    return result + feature_parts(dry, tiny, precision_steps) + checks(dry, tiny, precision_steps, recipes)


def feature_parts(dry: bool, tiny: float, steps: int) -> list[Part]:
    """This round's features on a GPU path (bench/gpu_features.py), after the headline figures."""
    return [
        Part(
            "moe_recompute",
            lambda c: features.moe_recompute(c, steps, not dry),
            (4 if dry else 6) * tiny,
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "A mixture of experts with activation checkpointing against without (tiny-moe, fp32, Mixtral's and Llama "
            "4's routers; bf16 speed)",
        ),
        Part(
            "windowed_attention",
            lambda c: features.windowed_attention(c, steps),
            tiny if dry else 3 * tiny + FLEX_COMPILE_S,
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "Sliding windows and sinks: FlexAttention (GPU) against the dense mask (CPU), speed against full attention",
        ),
        Part(
            "latent_attention",
            lambda c: features.latent_attention(c, steps),
            tiny if dry else 3 * tiny + FLEX_COMPILE_S,
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "DeepSeek's latent attention with doc masking: FlexAttention (GPU) against the dense mask (CPU), speed",
        ),
        Part(
            "sft_loss",
            lambda c: features.sft_loss(c, steps),
            CHAT_PREPARE_S + (1 if dry else 2) * tiny,
            VERDICT,
            "Instruction tuning's masked loss: GPU against CPU (tiny on scripts/demo-sft's conversations, fp32)",
        ),
        Part(
            "chunked_attention",
            lambda c: features.chunked_attention(c, steps),
            tiny if dry else 2 * tiny + FLEX_COMPILE_S,
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "Llama 4's chunked attention, temperature tuning and q/k norm: FlexAttention (GPU) against the dense mask",
        ),
        Part(
            "doctor",
            lambda c: features.doctor(c, dry),
            (4 if dry else 30) * tiny,
            VERDICT,
            "`dstrain doctor`: every shipped strategy against ZeRO-0 on tiny, the kernels and the collectives",
        ),
        Part(
            "preference_step",
            lambda c: features.preference_step(c, steps, dry),
            CHAT_PREPARE_S + (5 if dry else 4) * tiny,  # two runs, then the bench (its engines, reference passes)
            VERDICT + ["dpo_over_sft", "reference_over_epoch"],
            "Preference tuning (DPO): ZeRO-2 against ZeRO-0 on the device; the DPO step over the SFT step",
        ),
        Part(
            "lora",
            lambda c: adapters.lora(c, steps, dry),
            (5 if dry else 3) * tiny + (0 if dry else 2 * run_s(dry, "gpt2-125m", 1024, 8, steps)),
            VERDICT + ["tokens_per_s", "mem_peak_gib"],
            "LoRA (issue 56): ZeRO-2/3 against ZeRO-0 with adapters (tiny, fp32); LoRA ÷ full step and peak memory",
        ),
        Part(
            "qlora",
            lambda c: adapters.qlora(c, steps),
            3 * tiny,
            VERDICT,
            "QLoRA (issue 56): the NF4 base with adapters, ZeRO-3 against ZeRO-0 (tiny, fp32); bf16 ZeRO-3 trains",
        ),
        Part(
            "rl_decode",
            lambda c: features.rl_decode(c, dry),
            60.0 if dry else 90.0,
            VERDICT + ["cached_tokens_per_s", "kv_cache_speedup", "generation_share"],
            "RL sampling: the KV-cache decode's greedy tokens against the CPU's, tokens/s, generation share of a step",
        ),
        Part(
            "long_context",
            lambda c: features.long_context(c, steps, dry),
            tiny if dry else run_s(dry, "llama-1b-32k", 131072, 1, features.LONG_CONTEXT_STEPS) * 2,  # x2: recompute
            VERDICT + ["measured_gib", "estimated_gib", "error", "host_gib"],
            "A 131,072-token step of a 1B llama with host-held checkpoints: peak memory against the estimate",
        ),
    ]


def checks(dry: bool, tiny: float, steps: int, recipes: list[str]) -> list[Part]:
    """The parts after the features: CUDA tests, document masking, a published family, every strategy's
    correctness, kernels and FLOP accounting."""
    masking_speed = None if dry else SPEED_125M
    return [
        Part("pytest_gpu", parts.cuda_tests, 30.0 if dry else 150.0, VERDICT, "CUDA tests (pytest -m gpu)"),
        Part(
            "doc_masking",
            lambda c: parts.doc_masking(c, steps, masking_speed),
            tiny + (0 if dry else tiny + FLEX_COMPILE_S + speed_s(dry, (*SPEED_125M[:3], ["eager"]), SPEED_STEPS)),
            VERDICT + SPEED[:2] + SPEED[4:7],
            "Document masking inside training (FlexAttention on a GPU)",
        ),
        Part(
            "published_family",
            lambda c: parts.published_family(c, DRY_STEPS if dry else SPEED_STEPS),
            tiny if dry else run_s(dry, "continue-qwen3-0.6b", 2048, 16, SPEED_STEPS),
            SPEED,
            "A published family's architecture at its size: Qwen3-0.6B, random weights, eager (zero1_bf16)",
        ),
        Part(
            "correctness",
            lambda c: parts.correctness(c, steps),
            (2 if dry else 7) * tiny,
            VERDICT,
            "Every ZeRO stage, offload and FusedAdam (fp32) against ZeRO-0 (tiny, world of one)",
        ),
        Part(
            "attention",
            lambda c: parts.attention(c, recipes),
            10.0 if dry else 40.0,
            ["recipe", "doc_masking", "kernel"],
            "Attention kernels (bf16 forward)",
        ),
        Part(
            "flops",
            lambda c: parts.flop_count(c, recipes),
            10.0 if dry else 40.0,
            ["recipe", "ours_per_token", "deepspeed_per_token", "ratio"],
            "FLOPs per token: ours against DeepSpeed's profiler",
        ),
    ]
