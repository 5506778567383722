"""QLoRA's NF4 base (dstrain.adapters.qlora, torchao's NF4): the quantized model's logits against the full-precision
model's, the packed bytes' arithmetic against torchao's own, and where it is refused."""

import copy

import pytest
import torch
import transformers
import yaml

from dstrain.adapters.qlora import NF4Linear, packed_bytes, quantize_base
from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import GPT
from dstrain.recipe_file import load_recipe
from dstrain.strategy.resolve import resolve

# Measured on these models (random init, std 0.02, fp32, 2 x 32 tokens): relative RMS of the logits' error 0.101
# (llama) and 0.125 (gpt2); of one weight's error 0.108 (NF4 has 16 levels per block of 64 Gaussian weights). The
# bounds leave 20% above the measured values; a wrong scale, level table or block order errs by 1 or more.
LOGITS_REL_RMS = 0.15
WEIGHT_REL_RMS = 0.13


def tiny(flavour: str) -> GPTConfig:
    kv = {"n_kv_head": 2} if flavour == "llama" else {}
    return GPTConfig.from_dict(dict(flavour=flavour, n_layer=2, n_head=4, d_model=128, vocab_size=512, **kv))


def rel_rms(error: torch.Tensor, reference: torch.Tensor) -> float:
    return (error.norm() / reference.norm()).item()


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_nf4_base_logits_within_the_measured_bound_of_full_precision(flavour):
    torch.manual_seed(0)
    full = GPT(tiny(flavour)).requires_grad_(False)
    quantized = copy.deepcopy(full)
    names = quantize_base(quantized)
    per_block = 7 if flavour == "llama" else 6  # every projection of every block; never the embeddings or the head
    assert len(names) == 2 * per_block and all(n.startswith("blocks.") for n in names)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    logits, logits_nf4 = full(tokens), quantized(tokens)
    error = rel_rms(logits_nf4 - logits, logits)
    print(f"\n{flavour}: logits' relative RMS error {error:.4f}, max abs {(logits_nf4 - logits).abs().max():.4f}")
    assert 0 < error <= LOGITS_REL_RMS
    for name in names:
        weight = full.get_submodule(name).weight
        assert 0 < rel_rms(quantized.get_submodule(name).dequantized() - weight, weight) <= WEIGHT_REL_RMS
    # the quantized forward is exactly the model with the dequantized weights put in
    dequantized = copy.deepcopy(full)
    for name in names:
        dequantized.get_submodule(name).weight.data.copy_(quantized.get_submodule(name).dequantized())
    torch.testing.assert_close(quantized(tokens), dequantized(tokens), rtol=0, atol=0)


def test_packed_bytes_are_torchaos_nf4_and_compute_in_the_inputs_dtype():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512)
    layer = NF4Linear(linear)
    assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
    assert layer.weight.numel() == packed_bytes(256 * 512) == 256 * 512 // 2 + 2048 + 4 * 8 + 68
    reference = to_nf4(linear.weight.detach(), 64, 256).get_original_weight()
    torch.testing.assert_close(layer.dequantized(), reference, rtol=0, atol=0)
    x = torch.randn(3, 256, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ reference.T + linear.bias, rtol=1e-6, atol=1e-6)
    y.sum().backward()  # the input's gradient flows; the frozen bytes take none
    torch.testing.assert_close(x.grad, reference.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None
    layer.bias.data = layer.bias.data.bfloat16()
    assert layer(x.detach().bfloat16()).dtype == torch.bfloat16  # dequantized to the training precision
    before = layer.weight.detach().clone()
    layer.bfloat16()  # DeepSpeed's cast to the training dtype leaves the bytes alone
    assert torch.equal(layer.weight, before)


RECIPE = {
    "name": "q",
    "model": {"flavour": "llama", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 128},
    "data": {"sources": [{"path": "data/none"}], "seq_len": 16},
    "train": {"global_batch": 8, "steps": 4},
    "lora": {"rank": 4, "quantize_base": "nf4"},
    "seed": 3,
}


def write(tmp_path, **changes):
    path = tmp_path / "q.yaml"
    recipe = {**RECIPE, **changes}
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_quantized_model_refused_in_one_line(tmp_path):
    moe = {**RECIPE["model"], "moe": {"num_experts": 4, "top_k": 2}}
    with pytest.raises(DstrainError) as e:
        load_recipe(write(tmp_path, model=moe, lora={"rank": 4, "target_modules": ["q_proj"], "quantize_base": "nf4"}))
    assert "q.yaml" in str(e.value) and "lora.quantize_base" in str(e.value) and "\n" not in str(e.value)
    odd = {**RECIPE["model"], "d_model": 40, "n_head": 4, "n_kv_head": 1, "d_ff": 104}
    with pytest.raises(DstrainError, match="not a whole number of NF4 blocks"):
        load_recipe(write(tmp_path, model=odd))
    with pytest.raises(DstrainError, match="quantize_base"):
        load_recipe(write(tmp_path, lora={"rank": 4, "quantize_base": "int4"}))


@pytest.mark.parametrize(
    "section, refused",
    [
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param"),
    ],
)
def test_quantized_base_refused_where_it_does_not_run(tmp_path, section, refused):
    path = write(tmp_path)
    recipe = load_recipe(path)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, **section}
    with pytest.raises(DstrainError) as e:
        resolve(recipe, path, config, "ds.json", 2, check_device=False)
    message = str(e.value)
    assert message.startswith("ds.json: ") and refused in message and "\n" not in message
    for stage in (0, 1, 2, 3):  # data parallelism at every stage is accepted
        resolve(recipe, path, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}, "d", 2)


# --- the NF4 base under DeepSpeed, on 2 gloo ranks -------------------------------------------------------------------


def packed_digest(layers, zero3: bool) -> str:
    import hashlib

    import deepspeed

    digest = hashlib.sha256()
    for layer in layers:
        with deepspeed.zero.GatheredParameters([layer.weight], enabled=zero3):
            digest.update(layer.weight.detach().numpy().tobytes())
    return digest.hexdigest()


def train_quantized(recipe_file: str, stage: int, precision: str) -> dict:
    """Rank target: the recipe's LoRA on its NF4 base under ZeRO ``stage`` (build_engine applies both converters); 2
    steps of 2 micro-batches; the NF4 bytes each rank holds, before and after."""
    from dstrain.adapters.qlora import NF4Linear
    from dstrain.model.gpt import lm_loss
    from dstrain.train.engine.build import build_engine, build_model
    from dstrain.train.process import distributed

    distributed.init()
    recipe = load_recipe(recipe_file)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32")
    strategy = resolve(recipe, recipe_file, config, f"zero{stage}.json", 2)
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora." in n for n in trained), trained
    layers = [m for m in engine.module.modules() if isinstance(m, NF4Linear)]
    before = packed_digest(layers, stage == 3)
    held = sum(getattr(m.weight, "ds_tensor", m.weight).numel() for m in layers)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses, norms = [], []
    for _ in range(2):
        for _ in range(2):
            tokens = torch.randint(0, 512, (2, 17), generator=generator)
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    unchanged = packed_digest(layers, stage == 3) == before
    engine.destroy()
    return {"losses": losses, "norms": norms, "held": held, "digest": before, "unchanged": unchanged}


@pytest.mark.distributed
def test_nf4_base_trains_alike_under_zero_0_to_3_and_zero3_partitions_its_bytes(tmp_path):
    from ranks import run_ranks

    path = str(write(tmp_path))
    runs = {}
    for stage in (0, 1, 2, 3):
        runs[stage] = run_ranks(2, train_quantized, path, stage, "fp32", env={"OMP_NUM_THREADS": "1"})
    reference = runs[0][0]  # each rank's losses are its own micro-batches': rank by rank
    whole = packed_bytes(128 * 128) * 2 * 2 + packed_bytes(128 * 64) * 2 * 2 + packed_bytes(128 * 384) * 2 * 3
    for stage, ranks in runs.items():
        for rank, expected in zip(ranks, runs[0]):
            assert rank["unchanged"] and rank["digest"] == reference["digest"]  # same bytes, untouched by training
            torch.testing.assert_close(rank["losses"], expected["losses"], rtol=0, atol=1e-6)
            torch.testing.assert_close(rank["norms"], expected["norms"], rtol=1e-6, atol=0)
            # ZeRO-3 partitions the packed bytes over the 2 ranks (its partitions padded to 2 bytes at most)
            assert rank["held"] == whole if stage < 3 else 0 <= rank["held"] - whole / 2 <= 2 * 14
    bf16 = run_ranks(2, train_quantized, path, 3, "bf16", env={"OMP_NUM_THREADS": "1"})
    # zero.Init builds the bf16 model in bf16, so its NF4 codes are those of the bf16-rounded weights: unchanged by
    # training, and the losses within bf16's rounding of the fp32 run's
    assert bf16[0]["unchanged"] and bf16[1]["unchanged"]
    torch.testing.assert_close(bf16[0]["losses"], reference["losses"], rtol=0, atol=2e-2)


# --- a QLoRA run from a published model: trained, resumed, exported ---------------------------------------------------


@pytest.mark.distributed
def test_qlora_run_on_a_published_model_exports_its_adapter(tmp_path, corpus):
    """3 steps under ZeRO-3 on 2 ranks from a published Llama with an NF4 base; the exported PEFT adapter holds every
    adapter whole, equal to the checkpoint's."""
    from safetensors.torch import load_file
    from test_lora_export import LORA, published_llama

    from dstrain.checkpoint.consolidate import consolidated_state_dict, load_run
    from dstrain.commands.cli import main as cli

    from ranks import run_ranks
    from train_helpers import small_recipe, train_argv, train_each

    published_llama(tmp_path / "base", corpus)
    lora = {**LORA, "modules_to_save": [], "quantize_base": "nf4"}
    recipe = small_recipe(tmp_path, corpus, init_from=str(tmp_path / "base"), lora=lora, train={"steps": 3})
    assert run_ranks(2, train_each, [train_argv(recipe, "zero3", tmp_path / "run")]) == [[0], [0]]
    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 2  # A and B of 7 projections in 2 blocks
    loaded, tag = load_run(tmp_path / "run", None)
    state = consolidated_state_dict(tag, loaded.model)
    b = state["blocks.1.mlp.lora.down_proj.lora_B.weight"]
    torch.testing.assert_close(saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"], b)
    assert b.abs().max() > 0  # it trained
    # the NF4 base is the published base's NF4, bit for bit, after training
    from dstrain.adapters.qlora import pack
    from dstrain.model.hf.convert import from_hf

    _, published = from_hf(tmp_path / "base")
    packed = {k: v.to(torch.uint8) for k, v in state.items() if k.endswith("_proj.weight") and v.dim() == 1}
    assert len(packed) == 2 * 7
    assert [k for k, v in packed.items() if not torch.equal(v, pack(published[k]))] == []
    # --merge: the adapters folded into the dequantized NF4 weights: the model the run computed, in transformers
    assert cli(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged")]) == 0

    ours = our_model_nf4(loaded, state)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, loaded.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ours(ids), rtol=0, atol=1e-5)


def our_model_nf4(recipe, state):
    """The run's model: our GPT with its adapters and its NF4 layers, holding the checkpoint's tensors."""
    from dstrain.adapters.lora import inject
    from dstrain.model.gpt import GPT

    model = GPT(recipe.model)
    inject(model, recipe.model, recipe.lora, seed=0)
    quantize_base(model)
    model.load_state_dict(state, strict=True)
    return model.eval()
