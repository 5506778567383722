"""Conversion between our GPT and Hugging Face transformers: GPT2LMHeadModel, and the llama-flavour families
(Llama, Mistral, Qwen2, Qwen3, OLMo 2, Mixtral, Qwen3-MoE, SmolLM3, Phi-3/4, Gemma 2/3, GPT-OSS:
dstrain.model.hf.families
has their tables, dstrain.model.hf.family_configs converts their configs).

    hf_config, hf_state = to_hf(config, model.state_dict())   # then HFClass(hf_config).load_state_dict(hf_state)
    config, state = from_hf("path/to/hf_folder")               # then GPT(config).load_state_dict(state)

The llama flavour maps onto the llama-like classes almost name for name (all use the rotate_half RoPE
convention). The gpt2 flavour maps onto GPT2LMHeadModel, whose Conv1D layers store weights as
(in, out), i.e. transposed, and whose attention fuses q/k/v into one `c_attn` of width 3*d.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import transformers

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import StateDict
from dstrain.model.hf import families, family_configs
from dstrain.model.hf.experts import experts_from_hf, experts_to_hf
from dstrain.model.hf.mla_rows import permute_rope_rows

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", **families.ARCHITECTURE_FAMILY}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation
# Non-parameter entries some transformers versions keep in state_dict (attention-mask and RoPE buffers).
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def to_hf(
    config: GPTConfig, state_dict: StateDict, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> tuple[transformers.PretrainedConfig, StateDict]:
    """Our config and GPT.state_dict() -> (the family's transformers config, state dict for its model class).

    state_dict has the keys of GPT.state_dict(). The HF model built from the returned config computes
    the same function as GPT(config), also in train mode (dropout is 0). For doc_masking, HF does the
    same when given position_ids without attention_mask or cache (its packed-sequence detection).
    With tied embeddings lm_head.weight is the embedding tensor itself.
    """
    if config.flavour == "gpt2":
        hf_config: transformers.PretrainedConfig = transformers.GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.max_seq_len,
            n_embd=config.d_model,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_inner=config.ff_dim,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=config.norm_eps,
            initializer_range=config.init_std,
            tie_word_embeddings=config.tied,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            architectures=["GPT2LMHeadModel"],
        )
        return hf_config, _gpt2_to_hf(config, state_dict)
    return family_configs.hf_config(config, bos_token_id, eos_token_id), _llama_to_hf(config, state_dict)


def from_hf(hf_model_or_dir: transformers.PreTrainedModel | str | os.PathLike) -> tuple[GPTConfig, StateDict]:
    """A transformers model of a supported class (object or local save_pretrained folder) -> (GPTConfig, state dict).

    The state dict has exactly the keys of GPT(config).state_dict(); tensors keep the checkpoint's dtype
    and may share storage with the HF model. doc_masking is a training
    choice HF does not record: it comes back False, for the recipe to set.
    """
    if isinstance(hf_model_or_dir, transformers.PreTrainedModel):
        model, source = hf_model_or_dir, f"{type(hf_model_or_dir).__name__} object"
        architectures = [type(model).__name__]
    else:
        folder = Path(hf_model_or_dir)
        source = str(folder / "config.json")
        architectures = [_read_config(folder)[1]]
        model = None
    supported = [a for a in architectures if a in ARCHITECTURES]
    if not supported:
        raise DstrainError(
            f"{source}: architectures={architectures} cannot be converted; dstrain supports {', '.join(ARCHITECTURES)}"
        )
    if model is None:
        model_class = getattr(transformers, supported[0])
        model = model_class.from_pretrained(folder, local_files_only=True, dtype="auto")
    hf_state = model.state_dict()
    if ARCHITECTURES[supported[0]] == "gpt2":
        config = _gpt2_config_from_hf(model.config, source)  # type: ignore[arg-type]  # a GPT2Config here
        return config, _gpt2_from_hf(config, hf_state, source)
    config = family_configs.config_from_hf(model.config, ARCHITECTURES[supported[0]], source)
    return config, _llama_from_hf(config, hf_state, source)


def config_from_hf(folder: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of a save_pretrained folder, from its config.json alone: a cheap check that a folder
    is a model dstrain can load (it holds weights, of a supported architecture), before any work."""
    folder = Path(folder)
    config = architecture_from_hf(folder)
    weights = [p for pattern in ("*.safetensors", "pytorch_model*.bin") for p in folder.glob(pattern)]
    if not weights:
        raise DstrainError(
            f"{folder}: no weights (*.safetensors or pytorch_model.bin); pass a folder written by "
            f"save_pretrained or dstrain export"
        )
    return config


def architecture_from_hf(folder: str | os.PathLike) -> GPTConfig:
    """The GPTConfig that config.json describes (no weights needed nor read): a recipe's model fields with init_from."""
    folder = Path(folder)
    hf_config, architecture = _read_config(folder)
    if ARCHITECTURES[architecture] == "gpt2":
        return _gpt2_config_from_hf(hf_config, str(folder / "config.json"))
    return family_configs.config_from_hf(hf_config, ARCHITECTURES[architecture], str(folder / "config.json"))


def _read_config(folder: Path):
    """(transformers config, its first architecture dstrain supports) of a save_pretrained folder."""
    source = folder / "config.json"
    if not source.is_file():
        raise DstrainError(f"{source}: no such file; pass a folder written by save_pretrained")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise DstrainError(f"{source}: not a Hugging Face model config ({str(e).splitlines()[0]})") from None
    architectures = hf_config.architectures or [f"<none, model_type={hf_config.model_type}>"]
    supported = [a for a in architectures if a in ARCHITECTURES]
    if not supported:
        raise DstrainError(
            f"{source}: architectures={architectures} cannot be converted; dstrain supports {', '.join(ARCHITECTURES)}"
        )
    return hf_config, supported[0]


# Training choices, not architecture: a model may start from weights trained with other values.
NOT_ARCHITECTURE = ("doc_masking", "init_std")


def architecture_diff(ours: GPTConfig, theirs: GPTConfig) -> list[tuple[str, object, object]]:
    """(field, ours, theirs) for every architecture field that differs, with None defaults resolved."""
    resolved = {
        "n_kv_head": "kv_heads",
        "d_ff": "ff_dim",
        "tie_embeddings": "tied",
        "d_head": "head_dim",
        "family": "resolved_family",
    }
    fields = [f.name for f in dataclasses.fields(ours) if f.name not in NOT_ARCHITECTURE]
    if ours.flavour != "llama" or theirs.flavour != "llama":
        fields.remove("rope_theta")  # gpt2 has no RoPE
    if ours.flavour == theirs.flavour == "llama" and ours.max_seq_len >= theirs.max_seq_len:
        fields.remove("max_seq_len")  # no position table: continued pretraining may extend the context (long context)
    if ours.n_moe_layers == ours.n_layer and theirs.n_moe_layers == theirs.n_layer:
        fields.remove("d_ff")  # no dense block uses it
    values = [(k, getattr(ours, resolved.get(k, k)), getattr(theirs, resolved.get(k, k))) for k in fields]
    values = [(k, _moe_shape(a), _moe_shape(b)) if k == "moe" else (k, a, b) for k, a, b in values]
    return [(k, a, b) for k, a, b in values if a != b]


def _moe_shape(moe) -> object:
    """The architecture of model.moe (its loss coefficients are training choices)."""
    if moe is None:
        return None
    deepseek = (moe.scoring, moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.n_shared_experts)
    return (
        moe.num_experts,
        moe.top_k,
        moe.every,
        moe.d_expert,
        moe.norm_topk_prob,
        sorted(moe.dense_layers),
        *deepseek,
    )


# --- gpt2 ---


def _gpt2_to_hf(config: GPTConfig, sd: StateDict) -> StateDict:
    out = {"transformer.wte.weight": sd["embed.tok.weight"], "transformer.wpe.weight": sd["embed.pos.weight"]}
    for i in range(config.n_layer):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [f"{ours}self_attn.{p}_proj" for p in "qkv"]
        for param in ("weight", "bias"):
            out[f"{hf}ln_1.{param}"] = sd[f"{ours}attn_norm.{param}"]
            out[f"{hf}ln_2.{param}"] = sd[f"{ours}mlp_norm.{param}"]
        # Conv1D weights are (in, out): transpose each nn.Linear (out, in) weight.
        out[f"{hf}attn.c_attn.weight"] = torch.cat([sd[f"{p}.weight"] for p in qkv], dim=0).t().contiguous()
        out[f"{hf}attn.c_attn.bias"] = torch.cat([sd[f"{p}.bias"] for p in qkv], dim=0)
        for hf_name, our_name in (
            ("attn.c_proj", "self_attn.o_proj"),
            ("mlp.c_fc", "mlp.up_proj"),
            ("mlp.c_proj", "mlp.down_proj"),
        ):
            out[f"{hf}{hf_name}.weight"] = sd[f"{ours}{our_name}.weight"].t().contiguous()
            out[f"{hf}{hf_name}.bias"] = sd[f"{ours}{our_name}.bias"]
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["norm.weight"], sd["norm.bias"]
    out["lm_head.weight"] = out["transformer.wte.weight"] if config.tied else sd["lm_head.weight"]
    return out


def _gpt2_config_from_hf(hf: transformers.GPT2Config, source: str) -> GPTConfig:
    _require(
        hf.activation_function in GPT2_ACTIVATIONS,
        source,
        "activation_function",
        hf.activation_function,
        f"dstrain's gpt2 flavour uses {GPT2_ACTIVATIONS[0]}",
    )
    _require(hf.scale_attn_weights, source, "scale_attn_weights", hf.scale_attn_weights, "only true converts")
    _require(
        not hf.scale_attn_by_inverse_layer_idx,
        source,
        "scale_attn_by_inverse_layer_idx",
        hf.scale_attn_by_inverse_layer_idx,
        "only false converts",
    )
    _require(
        not hf.add_cross_attention,
        source,
        "add_cross_attention",
        hf.add_cross_attention,
        "only decoder-only models convert",
    )
    return GPTConfig(
        flavour="gpt2",
        vocab_size=hf.vocab_size,
        max_seq_len=hf.n_positions,
        n_layer=hf.n_layer,
        n_head=hf.n_head,
        n_kv_head=hf.n_head,
        d_model=hf.n_embd,
        d_ff=hf.n_inner or 4 * hf.n_embd,
        tie_embeddings=hf.tie_word_embeddings,
        norm_eps=hf.layer_norm_epsilon,
        init_std=hf.initializer_range,
    )


def _gpt2_from_hf(config: GPTConfig, hf_state: StateDict, source: str) -> StateDict:
    take = _WeightTaker(hf_state, source)
    d = config.d_model
    out = {"embed.tok.weight": take("transformer.wte.weight"), "embed.pos.weight": take("transformer.wpe.weight")}
    for i in range(config.n_layer):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        for param in ("weight", "bias"):
            out[f"{ours}attn_norm.{param}"] = take(f"{hf}ln_1.{param}")
        qkv_weight = take(f"{hf}attn.c_attn.weight").t()
        qkv_bias = take(f"{hf}attn.c_attn.bias")
        for j, p in enumerate("qkv"):
            out[f"{ours}self_attn.{p}_proj.weight"] = qkv_weight[j * d : (j + 1) * d].contiguous()
            out[f"{ours}self_attn.{p}_proj.bias"] = qkv_bias[j * d : (j + 1) * d].contiguous()
        out[f"{ours}self_attn.o_proj.weight"] = take(f"{hf}attn.c_proj.weight").t().contiguous()
        out[f"{ours}self_attn.o_proj.bias"] = take(f"{hf}attn.c_proj.bias")
        for param in ("weight", "bias"):
            out[f"{ours}mlp_norm.{param}"] = take(f"{hf}ln_2.{param}")
        for our_name, hf_name in (("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")):
            out[f"{ours}{our_name}.weight"] = take(f"{hf}{hf_name}.weight").t().contiguous()
            out[f"{ours}{our_name}.bias"] = take(f"{hf}{hf_name}.bias")
    out["norm.weight"], out["norm.bias"] = take("transformer.ln_f.weight"), take("transformer.ln_f.bias")
    out["lm_head.weight"] = out["embed.tok.weight"] if config.tied else take("lm_head.weight")
    take.discard("lm_head.weight")  # a tied head may or may not be listed
    take.check_all_used()
    return out


# --- the llama flavour (every family) ---


def _rows(config: GPTConfig, name: str) -> int:
    """Output rows of one of our projections that a family fuses (families.FUSED)."""
    if "q_proj" in name:
        return config.n_head * config.head_dim
    return config.kv_heads * config.head_dim if "k_proj" in name or "v_proj" in name else config.ff_dim


def _llama_to_hf(config: GPTConfig, sd: StateDict) -> StateDict:
    sd = permute_rope_rows(config, sd, to_hf=True)  # DeepSeek's latent attention: pairs again (model/hf/mla_rows.py)
    out = {"model.embed_tokens.weight": sd["embed.tok.weight"]}
    fused = families.FUSED.get(config.resolved_family, {})
    for i in range(config.n_layer):
        joined = {ours for parts in fused.values() for ours in parts}
        for ours, hf in families.block_names(config, i):
            if ours not in joined:
                out[f"model.layers.{i}.{hf}"] = sd[f"blocks.{i}.{ours}"]
        for hf, parts in fused.items():  # Phi-3: [q; k; v] and [gate; up] along the output rows
            out[f"model.layers.{i}.{hf}"] = torch.cat([sd[f"blocks.{i}.{ours}"] for ours in parts])
        if config.resolved_family in families.INTERLEAVED_ROPE:
            for p in "qk":
                name = f"model.layers.{i}.self_attn.{p}_proj.weight"
                out[name] = _interleaved_pairs(out[name], config.head_dim, back=True)
        if config.is_moe_block(i):
            experts_to_hf(config, sd, i, out)
    out["model.norm.weight"] = sd["norm.weight"]
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if config.tied else sd["lm_head.weight"]
    return out


def _llama_from_hf(config: GPTConfig, hf_state: StateDict, source: str) -> StateDict:
    take = _WeightTaker(hf_state, source)
    out = {"embed.tok.weight": take("model.embed_tokens.weight")}
    fused = families.FUSED.get(config.resolved_family, {})
    for i in range(config.n_layer):
        split: StateDict = {}
        for hf, parts in fused.items():
            pieces = take(f"model.layers.{i}.{hf}").split([_rows(config, ours) for ours in parts])
            split |= {ours: piece.contiguous() for ours, piece in zip(parts, pieces, strict=True)}
        for ours, hf in families.block_names(config, i):
            out[f"blocks.{i}.{ours}"] = split.pop(ours) if ours in split else take(f"model.layers.{i}.{hf}")
        if config.resolved_family in families.INTERLEAVED_ROPE:
            for p in "qk":
                name = f"blocks.{i}.self_attn.{p}_proj.weight"
                out[name] = _interleaved_pairs(out[name], config.head_dim)
        if config.is_moe_block(i):
            experts_from_hf(config, take, i, out)
    out["norm.weight"] = take("model.norm.weight")
    out["lm_head.weight"] = out["embed.tok.weight"] if config.tied else take("lm_head.weight")
    take.discard("lm_head.weight")  # a tied head may or may not be listed
    take.check_all_used()
    return permute_rope_rows(config, out, to_hf=False)  # DeepSeek's latent attention: rotate_half layout


def _interleaved_pairs(weight: torch.Tensor, head_dim: int, back: bool = False) -> torch.Tensor:
    """A q/k projection whose RoPE turns pairs (2i, 2i+1) of each head (Llama 4's complex form) with its rows
    reordered so that our RoPE, which turns (i, i + head_dim/2), turns the same pairs by the same angles (the
    permute of transformers' convert_llama_weights_to_hf); back: the reverse, for export. Scores are unchanged:
    q and k are reordered alike, and Llama 4's q/k norm has no weight."""
    heads, half = weight.shape[0] // head_dim, head_dim // 2
    shape = (heads, 2, half, -1) if back else (heads, half, 2, -1)
    return weight.reshape(shape).transpose(1, 2).reshape(weight.shape).contiguous()


# --- helpers ---


def _require(ok: bool, source: str, key: str, value: object, fix: str) -> None:
    if not ok:
        raise DstrainError(f"{source}: {key}={value!r} is not supported; {fix}")


class _WeightTaker:
    """Hands out HF tensors by name, then checks that none was left unconverted."""

    def __init__(self, hf_state: StateDict, source: str) -> None:
        self.left = {k: v for k, v in hf_state.items() if not k.endswith(IGNORED_HF_SUFFIXES)}
        self.source = source

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.left:
            raise DstrainError(f"{self.source}: weight {key!r} is missing; the checkpoint is incomplete")
        return self.left.pop(key)

    def discard(self, key: str) -> None:
        self.left.pop(key, None)

    def check_all_used(self) -> None:
        if self.left:
            names = ", ".join(sorted(self.left)[:5])
            raise DstrainError(f"{self.source}: unexpected weights {names}; dstrain cannot convert this checkpoint")


def to_hf_model(config: GPTConfig, state: dict[str, torch.Tensor], tokenizer=None):
    """A transformers model (eval mode, fp32) holding our weights; the tokenizer gives its BOS/EOS ids."""
    bos, eos = (tokenizer.bos_token_id, tokenizer.eos_token_id) if tokenizer is not None else (None, None)
    hf_config, hf_state = to_hf(config, state, bos_token_id=bos, eos_token_id=eos)
    model = getattr(transformers, (hf_config.architectures or ["?"])[0])(hf_config)
    model.load_state_dict(hf_state, strict=True)
    return model.eval()
