"""Long context without a GPU: RoPE past the published context follows the recipe's scaling, the planner's levers
(SP beyond the key/value heads, checkpoints held on the host, the host budget), the shipped long-context recipes'
planned layouts, and their one-line refusals."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import transformers

from dstrain.errors import DstrainError
from dstrain.model.rope import rope_cos_sin
from dstrain.plan.layouts import Layout, fits
from dstrain.plan.memory import estimate, estimate_file
from dstrain.plan.memory_parts import GIB
from dstrain.plan.time_model import DEVICES, Cluster
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import load_ds_config, resolve

ROOT = Path(__file__).resolve().parents[1]
LONG_RECIPES = [ROOT / f"recipes/continue-{n}.yaml" for n in ("llama3.1-8b-128k", "llama3.1-8b-512k", "llama3.1-8b-1m")]
LONG_RECIPES.append(ROOT / "recipes/continue-qwen3-8b-128k.yaml")
# Past the published context (131072 for Llama-3.1, 32768 for Qwen3-8B-Base) up to the longest recipe's last token.
POSITIONS = torch.tensor([[0, 8191, 32767, 131071, 131072, 524287, 1048575]])


def hf_rotary(recipe_file: Path):
    """transformers' rotary embedding for the recipe's model (its RoPE fields; a small width around them)."""
    m = load_recipe(recipe_file).model
    scaling = dataclasses.asdict(m.rope_scaling)
    rope = {"rope_type": scaling.pop("type"), "rope_theta": m.rope_theta}
    rope.update({k: v for k, v in scaling.items() if v is not None})
    config = transformers.LlamaConfig(
        hidden_size=m.n_head * m.head_dim, num_attention_heads=m.n_head, head_dim=m.head_dim,
        max_position_embeddings=m.max_seq_len, rope_parameters=rope,
    )  # fmt: skip
    return m, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("recipe_file", LONG_RECIPES, ids=lambda p: p.stem)
def test_positions_past_the_original_context_follow_the_recipes_rope_scaling(recipe_file):
    """The recipe's model turns every position of its samples as transformers does (llama3 and YaRN are static
    scalings: one set of frequencies at every length), so the exported model reads them as it was trained."""
    model, rotary = hf_rotary(recipe_file)
    ours = rope_cos_sin(POSITIONS, model, torch.float32)
    theirs = rotary(torch.zeros(1, dtype=torch.float32), POSITIONS)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()


@pytest.mark.parametrize("recipe_file", LONG_RECIPES, ids=lambda p: p.stem)
def test_long_context_recipe_ships_its_planned_layout(recipe_file):
    """Each names its planned ds_config (the fewest 8 x 80 GiB H100 nodes: the name's NxG) in a `# ds_config:` line;
    the estimate fits that many nodes, device and host, and says SP and host-held checkpoints where it uses them."""
    path = re.search(r"^# ds_config: (\S+)", recipe_file.read_text(), re.M).group(1)
    nodes, gpus = map(int, re.search(r"-(\d+)x(\d+)-h100\.json$", path).groups())
    recipe = load_recipe(recipe_file)
    est = estimate_file(recipe, ROOT / path, nodes, gpus)
    cluster = Cluster(DEVICES["h100-sxm"], nodes, gpus)
    assert fits(est, cluster) and est.peak() < 79 * GIB, est.peak() / GIB
    assert est.sp_size > 1 and recipe.data.seq_len >= 131072


def _strategy(recipe_file: Path, layout: Layout, world: int):
    recipe = load_recipe(recipe_file)
    return recipe, resolve(recipe, recipe_file, layout.ds_config("bf16", False), "plan", world, check_device=False)


def test_host_held_checkpoints_move_the_block_inputs_to_the_host():
    """Llama-3.1-8B at 1M tokens, SP32 over 4 nodes: the checkpointed block inputs (all but the last block's) leave
    the device for each node's host, (layers - 1)·a·T·d a rank; the host budget (plan --host-gib) then decides."""
    recipe_file = ROOT / "recipes/continue-llama3.1-8b-1m.yaml"
    base = Layout(zero=3, micro=1, sp=32, checkpointing=True, chunked_loss=True, mlp_tiles=4)
    (recipe, device), (_, host) = (
        _strategy(recipe_file, dataclasses.replace(base, host_checkpoints=h), 32) for h in (False, True)
    )
    on_device, on_host = estimate(recipe, device, 4, 8), estimate(recipe, host, 4, 8)
    held = 31 * (2**20 // 32) * 2 * 4096
    assert on_device.peak() - on_host.peak() == held
    assert on_host.peak("cpu") - on_device.peak("cpu") == held
    cluster = Cluster(DEVICES["h100-sxm"], 4, 8)
    assert fits(on_host, cluster)
    small_host = Cluster(dataclasses.replace(DEVICES["h100-sxm"], host_memory_gib=held * 8 / GIB - 1), 4, 8)
    assert not fits(on_host, small_host)


def test_host_checkpointing_without_activation_checkpointing_is_refused():
    recipe_file = ROOT / "recipes/continue-llama3.1-8b-128k.yaml"
    config = Layout(zero=1, micro=1, pp=2).ds_config("bf16", False)
    config["activation_checkpointing"] = {"cpu_checkpointing": True}
    with pytest.raises(DstrainError, match="activation_checkpoint_interval=0 turns activation checkpointing off"):
        resolve(load_recipe(recipe_file), recipe_file, config, "d.json", 8, check_device=False)
    config["activation_checkpointing"] = {"cpu_checkpointing": "yes"}
    with pytest.raises(DstrainError, match="cpu_checkpointing='yes'; use true or false"):
        resolve(load_recipe(recipe_file), recipe_file, config, "d.json", 8, check_device=False)


def test_sequence_parallel_must_divide_the_query_heads_only():
    """SP 16 and 32 go beyond Llama-3.1-8B's 8 key/value heads (accepted: they are repeated); SP 64 exceeds its 32
    query heads (refused, naming the sizes that divide them)."""
    recipe_file = ROOT / "recipes/continue-llama3.1-8b-1m.yaml"
    for sp in (16, 32):
        assert _strategy(recipe_file, Layout(zero=3, micro=1, sp=sp, chunked_loss=True), 64)[1].sp_size == sp
    with pytest.raises(DstrainError, match=r"sequence_parallel_size=64 does not divide the 32 query heads.*\[2, 4, 8"):
        _strategy(recipe_file, Layout(zero=3, micro=1, sp=64, chunked_loss=True), 64)


def test_a_sequence_not_dividing_sp_times_the_loss_chunks_is_refused():
    recipe_file = ROOT / "recipes/continue-llama3.1-8b-128k.yaml"
    config = load_ds_config(ROOT / "ds_configs/sp8_zero3_bf16.json") | {"tiling": {"loss": 3}}
    with pytest.raises(DstrainError, match=r"tiling.loss=3 does not divide the 16384 tokens of a rank's sequence"):
        resolve(load_recipe(recipe_file), recipe_file, config, "d.json", 8, check_device=False)


def test_long_samples_pack_documents_each_attending_within_its_own(tiny_corpus, tmp_path):
    """At 4096 tokens a sample of the tiny corpus holds several whole documents, or a slice of one longer than it:
    the position ids restart after every EOS (and at the sample's start), and the document mask built from them (the
    one Ulysses builds on the gathered sequence) lets a token attend to the earlier tokens of its own document only."""
    from dstrain.data.dataset import build_dataset, collate
    from dstrain.data.manifest import read_manifest
    from dstrain.model.doc_attention import doc_causal_mask

    seq, eos = 4096, read_manifest(tiny_corpus).eos_id
    ds = build_dataset([(str(tiny_corpus), 1.0)], "train", seq, 0, None, 0.1, cache_dir=tmp_path)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    documents_per_sample = []
    for start in range(0, len(ds) - 1, 2):
        batch = collate([ds[start], ds[start + 1]])
        masks = doc_causal_mask(batch["position_ids"], seq)[:, 0]
        for inputs, positions, mask in zip(batch["input_ids"], batch["position_ids"], masks):
            starts = torch.cat([torch.tensor([0]), (inputs[:-1] == eos).nonzero().flatten() + 1])
            expected = torch.zeros(seq, dtype=torch.long)
            expected[starts] = 1
            document = torch.cumsum(expected, 0)
            assert torch.equal(positions, torch.arange(seq) - starts[document - 1])
            assert torch.equal(mask, (document[:, None] == document[None, :]) & causal)
            documents_per_sample.append(len(starts))
    assert min(documents_per_sample) == 1 and max(documents_per_sample) > 2  # slices of long ones, and packed ones


def test_a_long_sample_that_fits_nowhere_is_told_more_nodes_or_a_shorter_sequence(capsys):
    """Llama-3.1-8B at 1M tokens on one H100: one line naming the fewest such nodes and the longest sample that fit."""
    from dstrain.commands.cli import main as cli

    recipe_file = ROOT / "recipes/continue-llama3.1-8b-1m.yaml"
    assert cli(["plan", "--recipe", str(recipe_file), "--gpus-per-node", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fits 1 x 1 devices of 80 GiB with 2048 GiB of host memory per node" in err[0], err
    assert "what fits: 4 nodes (--nodes 4) or data.seq_len=262144" in err[0]


def test_init_from_accepts_a_longer_context_for_a_rope_model_only():
    """Continued pretraining past the published context raises model.max_seq_len: no position table changes size
    under RoPE, so init_from's architecture check takes a longer one (a shorter one, or gpt2's table, it refuses)."""
    from dstrain.model.config import GPTConfig
    from dstrain.model.hf.convert import architecture_diff

    published = GPTConfig(flavour="llama", max_seq_len=131072, n_layer=2, n_head=4, d_model=64)
    assert architecture_diff(dataclasses.replace(published, max_seq_len=1048576), published) == []
    assert architecture_diff(dataclasses.replace(published, max_seq_len=4096), published) == [
        ("max_seq_len", 4096, 131072)
    ]
    gpt2 = GPTConfig(flavour="gpt2", max_seq_len=1024, n_layer=2, n_head=4, d_model=64)
    assert architecture_diff(dataclasses.replace(gpt2, max_seq_len=2048), gpt2) == [("max_seq_len", 2048, 1024)]
