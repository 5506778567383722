"""Rotary position angles as transformers computes them, with its scalings: default, linear, llama3, yarn, longrope.

Each function is transformers.modeling_rope_utils' of the same name, on our config (tests/test_families.py holds them
to transformers' inverse frequencies): written here so that the model needs no transformers import, and because
transformers' functions read a PretrainedConfig, which the model does not have.
"""

from __future__ import annotations

import math

import torch

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig, RopeScaling


def inverse_frequencies(
    config: GPTConfig, device: torch.device, local: bool = False, long: bool = False
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rotary_dim/2,) in fp32, the factor cos and sin are multiplied by); local: those of a
    sliding_attention block where model.rope_local_theta gives it its own unscaled base (Gemma 3); long: longrope's
    long factors (else its short ones)."""
    dim, base, scaling = config.rotary_dim, config.rope_theta, _scaling(config, local)
    if local and config.rope_local_theta is not None:
        base = config.rope_local_theta
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (base**exponent)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.type == "longrope":
        return _longrope(exponent, base, scaling, long)
    if scaling.type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(dim, base, scaling, device)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    assert s.original_max_position_embeddings is not None
    old_context = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / s.low_freq_factor, old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling, device: torch.device) -> tuple[torch.Tensor, float]:
    assert s.original_max_position_embeddings is not None
    original = s.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
        else:
            attention_factor = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


# --- longrope (issue 50) ---


def _scaling(config: GPTConfig, local: bool) -> RopeScaling | None:
    """The scaling a block's RoPE takes: none on a local block with its own base (rope_local_theta)."""
    return None if local and config.rope_local_theta is not None else config.rope_scaling


def _longrope(exponent: torch.Tensor, base: float, s: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    """transformers' _compute_longrope_parameters: 1 / (factor_i * base^(2i/dim)), attention factor
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) unless given."""
    assert s.original_max_position_embeddings is not None
    factors = s.long_factor if long else s.short_factor
    if factors is None or len(factors) != len(exponent):
        raise DstrainError(
            f"model.rope_scaling.{'long' if long else 'short'}_factor: longrope needs {len(exponent)} factors (one "
            f"per rotated pair), got {None if factors is None else len(factors)}; continue from init_from's config.json"
        )
    attention_factor = s.attention_factor
    if attention_factor is None:
        ratio = math.log(s.factor) / math.log(s.original_max_position_embeddings)
        attention_factor = 1.0 if s.factor <= 1.0 else math.sqrt(1 + ratio)
    ext = torch.tensor(factors, dtype=torch.float32, device=exponent.device)
    return 1.0 / (ext * base**exponent), attention_factor


def _frequencies(position_ids: torch.Tensor, config: GPTConfig, local: bool) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of these positions: longrope takes its long factors when the batch's largest position
    reaches past original_max_position_embeddings (transformers' longrope_frequency_update, one choice per batch)."""
    inv_freq, scale = inverse_frequencies(config, position_ids.device, local)
    scaling = _scaling(config, local)
    if scaling is not None and scaling.type == "longrope":
        long_inv_freq, _ = inverse_frequencies(config, position_ids.device, local, long=True)
        assert scaling.original_max_position_embeddings is not None
        beyond = position_ids.max() + 1 > scaling.original_max_position_embeddings
        inv_freq = torch.where(beyond, long_inv_freq, inv_freq)
    return inv_freq, scale


def rope_cos_sin(
    position_ids: torch.Tensor, config: GPTConfig, dtype: torch.dtype, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B|1, L, rotary_dim), exactly as HF LlamaRotaryEmbedding computes them.

    Angles are computed in fp32 on every call (cheap) rather than kept in a buffer, which a
    `model.to(bfloat16)` would silently round.
    """
    inv_freq, scale = _frequencies(position_ids, config, local)
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
