"""Continuing a published model: the recipe's architecture from init_from's config.json, training from it under
every family and layout, export back to its class with its tokenizer and generation files, data framed as the
family frames documents, and the shipped continue-recipes fitting one node."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dstrain.errors import DstrainError  # noqa: E402
from dstrain.model.gpt import GPT  # noqa: E402
from dstrain.model.hf.convert import from_hf  # noqa: E402

from family_fixtures import FAMILIES, SMALL, build_hf, hf_class_name  # noqa: E402


def published_qwen3(folder, corpus) -> transformers.PreTrainedModel:
    """A small random Qwen3 on the corpus' tokenizer, saved as a published model is: weights, tokenizer files and a
    generation_config.json of its own."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(corpus / "tokenizer")
    vocab = -(-len(tokenizer) // 64) * 64
    config = transformers.Qwen3Config(**(SMALL | dict(vocab_size=vocab, head_dim=16, initializer_range=0.02)))
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generation = transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id, do_sample=True, temperature=0.6)
    generation.save_pretrained(folder)
    return model


@pytest.mark.distributed
def test_a_recipe_without_model_continues_a_published_qwen3_and_exports_it(tmp_path, corpus):
    import yaml

    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.commands.cli import main as cli
    from dstrain.commands.generate import generate
    from dstrain.train.preflight import check_init_from

    from ranks import run_ranks
    from train_helpers import ROOT, small_recipe, train_each, train_losses

    published = tmp_path / "published"
    hf = published_qwen3(published, corpus)
    path = small_recipe(tmp_path, corpus, init_from=str(published))
    recipe = yaml.safe_load(path.read_text())
    del recipe["model"]
    path.write_text(yaml.safe_dump(recipe))
    loaded, source = load_recipe_and_source(path)
    assert loaded.model == from_hf(published)[0] and source is not None  # the architecture is the folder's config.json
    assert load_recipe_and_source(path, ["model.doc_masking=true"])[
        0
    ].model.doc_masking  # training choices: the recipe's
    with pytest.raises(DstrainError, match=r"model.n_layer=3 vs 2"):
        check_init_from(load_recipe_and_source(path, ["model.n_layer=3"])[0], str(path), [], source)  # before the data

    run = tmp_path / "run"
    argv = ["--recipe", str(path), "--deepspeed_config", str(ROOT / "ds_configs/zero1.json"), f"run_dir={run}"]
    assert run_ranks(2, train_each, [argv]) == [[0], [0]]
    losses = train_losses(run)
    assert len(losses) == 10 and losses[-1] < losses[0]

    out = tmp_path / "export"
    assert cli(["export", str(run), "--out", str(out)]) == 0
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded) is transformers.Qwen3ForCausalLM
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert not torch.equal(loaded.model.embed_tokens.weight, hf.model.embed_tokens.weight)  # it trained
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (published / name).read_bytes(), name
    assert cli(["export", str(run), "--out", str(tmp_path / "export-bf16"), "--dtype", "bf16"]) == 0
    halved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export-bf16", dtype="auto")
    assert type(halved) is transformers.Qwen3ForCausalLM and halved.dtype == torch.bfloat16
    assert torch.equal(halved.model.embed_tokens.weight, loaded.model.embed_tokens.weight.bfloat16())
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The module", return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = loaded.eval().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    assert theirs.shape[1] > ids.shape[1]
    assert generate(str(out), "The module", 12, temperature=0) == tokenizer.decode(theirs[0], skip_special_tokens=True)


def family_tokenizers(corpus) -> dict:
    """The corpus' BPE with a BOS token: added by its post-processor before every text (Llama 3's framing), or
    declared but never added (Qwen's, GPT-2's): the same vocabulary, so the same tokenizer hash."""
    from tokenizers import Tokenizer, processors

    base = transformers.AutoTokenizer.from_pretrained(corpus / "tokenizer")
    made = {}
    for name, adds_bos in (("llama3", True), ("qwen", False)):
        backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
        backend.add_special_tokens(["<|begin_of_text|>"])
        bos = backend.token_to_id("<|begin_of_text|>")
        if adds_bos:
            template = processors.TemplateProcessing(
                single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
            )
            backend.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
        made[name] = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token=base.eos_token
        )
    return made


def test_prepare_frames_documents_as_the_tokenizers_family(tmp_path, corpus):
    from dstrain.data.manifest import Framing, read_manifest
    from dstrain.data.prepare import prepare
    from dstrain.data.shards import ShardReader
    from dstrain.data.tokenizer import tokenizer_hash, verify_tokenizer

    from data_fixtures import corpus_file, read_texts

    source = corpus_file(tmp_path, n_docs=20)
    texts = read_texts(source)
    tokenizers = family_tokenizers(corpus)
    assert tokenizer_hash(tokenizers["llama3"]) == tokenizer_hash(tokenizers["qwen"])
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(tmp_path / f"{name}-tokenizer")
        manifest = prepare(
            str(source), str(tmp_path / name), tokenizer=str(tmp_path / f"{name}-tokenizer"), num_proc=2, progress=False
        )
        bos = tokenizer.bos_token_id if name == "llama3" else None
        assert manifest.framing == Framing(bos_id=bos, eos_id=tokenizer.eos_token_id)
        readers = [ShardReader.open(tmp_path / name / s.prefix) for s in manifest.shards]
        documents = [reader[i].tolist() for reader in readers for i in range(len(reader))]
        assert len(documents) == len(texts) == 20
        for text, ids in zip(texts, documents):
            assert ids == tokenizer(text).input_ids + [tokenizer.eos_token_id]
        assert (documents[0][0] == bos) == (name == "llama3")
    verify_tokenizer(read_manifest(tmp_path / "llama3"), tmp_path / "llama3", tmp_path / "llama3-tokenizer")
    with pytest.raises(DstrainError, match=r"framed as \{'bos_id': None.*frames them as \{'bos_id': \d+"):
        qwen = tmp_path / "qwen"
        verify_tokenizer(read_manifest(qwen), qwen, tmp_path / "llama3-tokenizer", flag="init_from's tokenizer")


# The recipes at real size that start from a published (or exported) model: continued pretraining, its SFT and DPO.
CONTINUE_RECIPES = sorted(
    [
        *(Path(__file__).resolve().parents[1] / "recipes").glob("continue-*.yaml"),
        *(Path(__file__).resolve().parents[1] / "recipes").glob("sft-qwen3-*.yaml"),
        *(Path(__file__).resolve().parents[1] / "recipes").glob("dpo-qwen3-*.yaml"),
    ]
)


@pytest.mark.parametrize("recipe_file", CONTINUE_RECIPES, ids=lambda p: p.stem)
def test_shipped_continue_recipe_fits_one_node_under_its_ds_config(recipe_file):
    """Each recipe names its ds_config in a `# ds_config:` line; the model: it writes out is its family's (exports to
    the published class) and `dstrain estimate` fits it on one node of 8 x 80 GiB without the weights at hand."""
    import re

    from dstrain.model.hf.families import CLASSES, check_exportable
    from dstrain.plan.memory import estimate_file
    from dstrain.plan.memory_parts import GIB
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config

    root = recipe_file.parents[1]
    ds_config = root / re.search(r"^# ds_config: (\S+)", recipe_file.read_text(), re.M).group(1)
    recipe = load_recipe(recipe_file)
    assert recipe.init_from and not (root / recipe.init_from).exists()  # answered from the recipe alone
    family = check_exportable(recipe.model, str(recipe_file))
    assert CLASSES[family][0] in recipe_file.read_text()
    est = estimate_file(recipe, recipe_file, ds_config, nodes=1, gpus_per_node=8)
    assert est.fits and est.peak() < 79 * GIB, (ds_config.name, est.peak() / GIB)
    # dstrain plan's choice for 1 x 8 H100, which says whether the loss is chunked (docs/memory.md)
    assert ds_config.parent.name == "planned" and "loss" in load_ds_config(ds_config)["tiling"]


def test_estimate_answers_from_config_json_alone(tmp_path, capsys):
    """init_from a folder holding only config.json (no weights) and a recipe without model: estimate reads the
    architecture from it; training would refuse the folder (no weights) before any work."""
    from dstrain.checkpoint.model_source import load_recipe_and_source
    from dstrain.commands.cli import main as cli
    from dstrain.train.preflight import check_init_from

    root = Path(__file__).resolve().parents[1]
    folder = tmp_path / "qwen3"
    features = dict(head_dim=16, max_position_embeddings=4096, architectures=["Qwen3ForCausalLM"])
    transformers.Qwen3Config(**(SMALL | features)).save_pretrained(folder)
    recipe = yaml_without_model(root / "recipes" / "continue-qwen3-0.6b.yaml", tmp_path, init_from=str(folder))
    loaded, source = load_recipe_and_source(recipe)
    assert source is not None
    assert (loaded.model.d_model, loaded.model.d_head, loaded.model.qk_norm) == (32, 16, "head")
    capsys.readouterr()
    assert (
        cli(["estimate", "--recipe", str(recipe), "--deepspeed_config", str(root / "ds_configs/zero1_bf16.json")]) == 0
    )
    assert "fits" in capsys.readouterr().out
    with pytest.raises(DstrainError, match="no weights"):
        check_init_from(loaded, str(recipe), [], source)  # refused before the data is looked at


def yaml_without_model(source: Path, folder: Path, **changes) -> Path:
    import yaml

    recipe = yaml.safe_load(source.read_text())
    del recipe["model"]
    path = folder / source.name
    path.write_text(yaml.safe_dump({**recipe, **changes}))
    return path


def test_init_from_under_expert_parallelism_loads_each_ranks_experts():
    """Under EP2 build_model gives rank r the experts 2r, 2r+1 of each MoE layer, named 0, 1: load_init_from cuts the
    published state dict to them (dstrain.model.hf.experts.local_experts)."""
    from dstrain.model.hf.experts import expert_name, local_experts

    config, state = from_hf(build_hf("qwen3_moe"))
    for rank in (0, 1):
        model = GPT(config, 2, rank)
        model.load_state_dict(local_experts(state, config, 2, rank), strict=True)
        for block in (0, 2):  # block 1 is dense (mlp_only_layers)
            for local in (0, 1):
                got = model.state_dict()[expert_name(block, local, "down_proj")]
                assert torch.equal(got, state[expert_name(block, 2 * rank + local, "down_proj")])


@pytest.mark.distributed
def test_every_family_continues_training_from_init_from_and_exports_to_its_class(tmp_path, corpus):
    """Each family published (weights only: the run keeps the data's tokenizer), trained 3 steps from init_from by a
    recipe without model: on 2 ranks (ZeRO-1; EP2 for the MoE families, DeepSeek-V3's and GLM-4.5's included), then
    exported: its own class, weights moved."""
    from dstrain.commands.cli import main as cli

    from ranks import run_ranks
    from train_helpers import ROOT, small_recipe, train_each, train_losses

    families = ["llama3", "mistral", "qwen2", "qwen3", "olmo2", "qwen3_moe", "mixtral"]
    families += ["smollm3", "phi3", "gemma2", "gemma3", "gpt_oss", "olmo3", "phi3-longrope", "llama4"]
    families += ["deepseek_v3", "glm4_moe", "llama4_moe"]  # MLA + DeepSeekMoE; with GQA; Llama 4's experts
    argvs, runs = [], {}
    for family in families:
        config_class, features = FAMILIES[family]
        hf_config = config_class(**(SMALL | features | dict(vocab_size=512, initializer_range=0.02)))
        torch.manual_seed(0)
        published = tmp_path / f"{family}-published"
        getattr(transformers, hf_class_name(config_class))(hf_config).save_pretrained(published)
        recipe = yaml_without_model(small_recipe(tmp_path, corpus, name=family), tmp_path, init_from=str(published))
        moe = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "llama4_moe")
        ds = "ep2_zero1" if family in moe else "zero1"
        runs[family] = tmp_path / f"{family}-run"
        argvs.append(
            [
                "--recipe",
                str(recipe),
                "--deepspeed_config",
                str(ROOT / f"ds_configs/{ds}.json"),
                f"run_dir={runs[family]}",
            ]
            + ["train.steps=3", "schedule.warmup_steps=1"]
        )
    assert run_ranks(2, train_each, argvs) == [[0] * len(families)] * 2
    for family in families:
        losses = train_losses(runs[family])
        assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), family
        out = tmp_path / f"{family}-export"
        assert cli(["export", str(runs[family]), "--out", str(out)]) == 0
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        published = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-published")
        assert type(loaded) is type(published) and not info["missing_keys"] and not info["unexpected_keys"], family
        assert not torch.equal(loaded.lm_head.weight, published.lm_head.weight), family


def test_what_dstrain_does_not_implement_is_refused_in_one_line(tmp_path, corpus):
    """OLMo 2's q/k norm over the whole projection under tensor parallelism (a rank holds only its heads); a Mistral
    window shorter than the sequence is no longer refused: it is computed (tests/test_windows.py)."""
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    from train_helpers import ROOT, small_recipe

    path = small_recipe(tmp_path, corpus, model={"family": "mistral", "sliding_window": 16})
    assert load_recipe(path).model.sliding_window == 16
    olmo2 = load_recipe(path, ["model.family=olmo2", "model.sliding_window=null", "model.qk_norm=projection"])
    tp2 = ROOT / "ds_configs" / "tp2_zero1.json"
    with pytest.raises(DstrainError, match="tensor_parallel with model.qk_norm projection"):
        resolve(olmo2, str(path), load_ds_config(tp2), tp2, 2)
