"""Hugging Face export and import, `dstrain eval` and `dstrain generate`, on short real 2-rank runs."""

import argparse
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from ranks import run_ranks
from train_helpers import ROOT, read_metrics, small_recipe, train_each

pytestmark = pytest.mark.distributed

LOGITS_ATOL = 1e-4  # HF vs our GPT, fp32: measured ~2e-6 (different kernels, same weights)
# Our eval vs the trainer's on the same samples, measured: 0 to 2e-8 relative (a last-bit difference in one
# micro-batch's float32 loss, where the engine's forward rounds differently: gathered ZeRO-3 weights, AutoTP's
# sharded matmuls, pipeline stages); the same between 1 and 2 ranks. A wrong weight moves it by 1e-3 or more.
EVAL_RTOL = 1e-6
HF_CLASS = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
RUNS = [(flavour, strategy) for flavour in ("llama", "gpt2") for strategy in ("zero0", "zero1", "zero2", "zero3")]
RUNS += [("llama", s) for s in ("pp2_zero1", "tp2_zero1") if (ROOT / "ds_configs" / f"{s}.json").exists()]
# bf16 runs keep fp32 masters apart from their bf16 module weights (BF16_Optimizer: ZeRO-1, pipeline, TP)
BF16_RUNS = [("llama", s) for s in ("zero1_bf16", "pp2_zero1_bf16", "tp2_zero1_bf16")]
DATA_FLAGS = ["--seq-len", "32", "--seed", "7", "--valid-fraction", "0.05", "--micro-batch", "4"]  # small_recipe's


def argv(recipe, strategy, run_dir, *overrides):
    return [
        "--recipe",
        str(recipe),
        "--deepspeed_config",
        str(ROOT / "ds_configs" / f"{strategy}.json"),
        f"run_dir={run_dir}",
        *overrides,
    ]


def recipe_for(tmp, corpus, flavour, model=None, **sections):
    model = {**({"flavour": "gpt2", "n_kv_head": 4} if flavour == "gpt2" else {}), **(model or {})}
    return small_recipe(tmp, corpus, flavour, model=model, **sections)


def cli(*args) -> int:
    from dstrain.commands.cli import main

    return main([str(a) for a in args])


def eval_each(argvs: list[list[str]]) -> list[dict]:
    """Rank target: `dstrain eval` once per argv."""
    from dstrain.commands import evaluate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return [evaluate.evaluate(parser.parse_args([str(a) for a in args])) for args in argvs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """3 steps of each flavour under each strategy on 2 ranks, each exported: {(flavour, strategy): (run, hf)}."""
    tmp = tmp_path_factory.mktemp("export")
    recipes = {f: recipe_for(tmp, corpus, f, train={"steps": 3}) for f in ("llama", "gpt2")}
    dirs = {key: tmp / "-".join(key) for key in RUNS + BF16_RUNS}
    codes = run_ranks(2, train_each, [argv(recipes[f], s, dirs[f, s]) for f, s in dirs])
    assert codes == [[0] * len(dirs)] * 2
    for run in dirs.values():
        assert cli("export", run, "--out", tmp / "hf" / run.name) == 0
    return {key: (run, tmp / "hf" / run.name) for key, run in dirs.items()}


@pytest.mark.parametrize("flavour,strategy", RUNS)
@torch.no_grad()
def test_export_computes_what_our_model_computes(runs, flavour, strategy):
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.model.gpt import GPT

    run, hf_dir = runs[flavour, strategy]
    assert (hf_dir / "model.safetensors").is_file() and (hf_dir / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf).__name__ == HF_CLASS[flavour] and hf.dtype == torch.float32
    recipe, tag = load_run(run, None)
    ours = GPT(recipe.model).eval()
    ours.load_state_dict(consolidated_state_dict(tag, recipe.model))
    ids = torch.randint(0, recipe.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (ours(ids) - hf(ids).logits).abs().max().item() <= LOGITS_ATOL
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert tokenizer.eos_token_id == hf.config.eos_token_id == 0  # the trained BPE's <|endoftext|>


@pytest.fixture(scope="module")
def evals(runs, corpus):
    """On 2 ranks: each run and its exported folder, evaluated on the trainer's 32 samples; one on the whole split."""
    argvs = [[run, "--samples", 32] for run, _ in runs.values()]
    argvs += [[hf, "--data", corpus, *DATA_FLAGS, "--samples", 32] for _, hf in runs.values()]
    whole = runs["llama", "zero2"][0]
    results = run_ranks(2, eval_each, argvs + [[whole]])[0]
    n = len(runs)
    return dict(zip(runs, results[:n])), dict(zip(runs, results[n : 2 * n])), results[-1]


@pytest.mark.parametrize("flavour,strategy", RUNS)
def test_eval_equals_the_trainers_own_eval(runs, evals, flavour, strategy):
    """The trainer evaluated train.eval_samples=32 samples at its end; `dstrain eval --samples 32` reads the same."""
    trainer = [r for r in read_metrics(runs[flavour, strategy][0]) if r.get("split") == "valid"][-1]
    for result in (evals[0][flavour, strategy], evals[1][flavour, strategy]):  # the run, its HF export
        assert result["samples"] == 32 and result["tokens"] == 32 * 32
        assert result["loss"] == pytest.approx(trainer["loss"], rel=EVAL_RTOL)
        assert result["ppl"] == pytest.approx(trainer["ppl"], rel=2 * EVAL_RTOL)


def test_eval_covers_the_whole_split_on_any_number_of_ranks(runs, evals, corpus):
    from dstrain.data.dataset import build_dataset

    whole_on_2 = evals[2]
    assert whole_on_2["samples"] == len(build_dataset([(str(corpus), 1.0)], "valid", 32, 7, None, 0.05)) > 32
    (whole_on_1,) = run_ranks(1, eval_each, [[runs["llama", "zero2"][0]]])[0]
    assert whole_on_1["samples"] == whole_on_2["samples"]
    assert whole_on_1["loss"] == pytest.approx(whole_on_2["loss"], rel=EVAL_RTOL)


@pytest.mark.launcher
def test_eval_under_the_deepspeed_launcher(runs, tmp_path):
    """`deepspeed --module dstrain eval`: the launcher's --local_rank comes before the command; rank 0 prints."""
    import subprocess
    import sys

    from ranks import free_port

    run = runs["llama", "zero2"][0]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    proc = subprocess.run(
        [
            launcher,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "dstrain",
            "eval",
            str(run),
            "--samples",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    trainer = [r for r in read_metrics(run) if r.get("split") == "valid"][-1]
    assert len(printed) == 1 and printed[0]["loss"] == pytest.approx(trainer["loss"], rel=EVAL_RTOL)


@torch.no_grad()
def test_generate_runs_offline_and_decodes_greedily(runs, capsys):
    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.commands.generate import generate
    from dstrain.data.tokenizer import load_run_tokenizer
    from dstrain.model.gpt import GPT

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    run, hf_dir = runs["gpt2", "zero3"]
    recipe, tag = load_run(run, None)
    tokenizer = load_run_tokenizer(run)
    ours = GPT(recipe.model).eval()
    ours.load_state_dict(consolidated_state_dict(tag, recipe.model))
    tokens = tokenizer("The module", return_tensors="pt").input_ids
    for _ in range(8):
        tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    greedy = tokenizer.decode(tokens[0], skip_special_tokens=True)
    assert generate(str(run), "The module", 8, temperature=0) == greedy
    capsys.readouterr()
    assert cli("generate", hf_dir, "--prompt", "The module", "--max-new-tokens", 8, "--temperature", 0) == 0
    assert capsys.readouterr().out.strip() == greedy
    sampled = [generate(str(hf_dir), "The module", 8, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2] and sampled[0].startswith("The module")


@pytest.fixture(scope="module")
def round_trip(runs, tmp_path_factory, corpus):
    """Runs of 0 steps starting from the exported folders (llama under ZeRO-3, gpt2 as a 2-stage pipeline, or under
    ZeRO-2 where there are no pipelines), exported again."""
    tmp = tmp_path_factory.mktemp("round_trip")
    cases = {"llama": "zero3", "gpt2": "pp2_zero1" if ("llama", "pp2_zero1") in RUNS else "zero2"}
    recipes = {
        f: recipe_for(
            tmp, corpus, f, train={"steps": 0}, schedule={"warmup_steps": 0}, init_from=str(runs[f, "zero1"][1])
        )
        for f in cases
    }
    assert run_ranks(2, train_each, [argv(recipes[f], s, tmp / f) for f, s in cases.items()]) == [[0, 0]] * 2
    for flavour in cases:
        assert cli("export", tmp / flavour, "--out", tmp / f"{flavour}-hf") == 0
    return {f: (runs[f, "zero1"][1], tmp / f"{f}-hf") for f in cases}


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_import_then_export_is_identical(round_trip, flavour):
    source, again = round_trip[flavour]
    before, after = load_file(source / "model.safetensors"), load_file(again / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert json.loads((source / "config.json").read_text()) == json.loads((again / "config.json").read_text())


def test_init_from_another_architecture_is_one_line(runs, tmp_path, corpus):
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.errors import DstrainError
    from dstrain.model.gpt import GPT
    from dstrain.train.engine.build import load_init_from

    path = recipe_for(tmp_path, corpus, "llama", init_from=str(runs["llama", "zero0"][1]), model={"n_layer": 3})
    recipe, source = load_recipe_and_source(path)
    assert source is not None
    with pytest.raises(DstrainError) as error:
        load_init_from(GPT(recipe.model), recipe, path, source, zero3=False)
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "model.n_layer=3 vs 2" in message


@pytest.mark.parametrize("strategy", [s for _, s in BF16_RUNS])
def test_a_bf16_run_exports_its_fp32_masters(runs, strategy, tmp_path):
    """The bf16 module weights are the masters rounded (BF16_Optimizer copies them down after each step): the
    export holds the masters themselves, not the module's weights widened; --dtype bf16 the module's weights."""
    from dstrain.checkpoint.consolidate import load_run, module_state_dict

    run, hf_dir = runs["llama", strategy]
    masters = load_file(hf_dir / "model.safetensors")
    assert cli("export", run, "--out", tmp_path / "bf16", "--dtype", "bf16") == 0
    halved = load_file(tmp_path / "bf16" / "model.safetensors")
    module = module_state_dict(load_run(run, None)[1])
    assert module["embed.tok.weight"].dtype == torch.bfloat16
    hf_name = {
        "embed.tok.weight": "model.embed_tokens.weight",
        "blocks.1.mlp.down_proj.weight": "model.layers.1.mlp.down_proj.weight",
        "blocks.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
    }
    for ours, theirs in hf_name.items():
        assert masters[theirs].dtype == torch.float32 and halved[theirs].dtype == torch.bfloat16
        assert torch.equal(masters[theirs].to(torch.bfloat16), module[ours]), ours
        assert torch.equal(halved[theirs], module[ours]), ours
        assert (masters[theirs] != module[ours].float()).float().mean() > 0.9, ours  # below bf16's resolution


def test_export_never_overwrites_and_names_a_missing_tag(runs, tmp_path, capsys):
    run, _ = runs["llama", "zero0"]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert cli("export", run, "--out", full) == 2
    assert cli("export", run, "--tag", "global_step99", "--out", tmp_path / "new") == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "not empty" in errors[0] and "global_step99" in errors[1]
    assert (full / "keep.txt").read_text() == "mine" and list(full.iterdir()) == [full / "keep.txt"]
    assert not (tmp_path / "new").exists()
