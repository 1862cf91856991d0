"""Rotary position embeddings (HF "rotate_half" layout): llama3, linear and LongRoPE scaling, partial rotary.

Partial rotary (Phi-4-mini): only the first rotary_dim dims of each head rotate, the rest pass through; the
tables are rotary_dim wide and `apply` rotates that slice.

LongRoPE (Phi-3/3.5/4 long-context checkpoints) has two sets of per-frequency factors: short ones trained
for sequences up to original_max_position_embeddings, long ones beyond, and scales cos and sin by an
attention factor either way. transformers picks the set from the current sequence length and recomputes
the whole cache when a sequence crosses over; a paged cache cannot, and a batch engine must not let a
sequence's neighbours choose its numbers. Our rule depends on the engine alone: the long factors iff the
engine's longest sequence (max_model_len, capped by the model's max_position_embeddings: the
`max_positions` the tables are built for) exceeds original_max_position_embeddings. Every sequence of an
engine then uses one table, the prefix cache can share blocks between any two sequences, and with
max_model_len <= original_max_position_embeddings (the default 2048 against Phi-3's 4096) the numbers are
transformers' own; an engine configured for longer sequences uses the long factors for short ones too (as
vLLM does).
"""

from __future__ import annotations

import math

import torch

from kernels import rope as kernels_rope
from worker.engine.config import ModelConfig


def rotary_dim(config: ModelConfig) -> int:
    return config.rotary_dim or config.head_dim


def uses_long_factors(config: ModelConfig, max_positions: int) -> bool:
    """LongRoPE: whether an engine whose sequences reach `max_positions` tokens takes the long factors."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return False
    return max_positions > scaling["original_max_position_embeddings"]


def attention_factor(config: ModelConfig) -> float:
    """The factor on cos and sin (LongRoPE; 1 otherwise), as transformers' _compute_longrope_parameters."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inverse_frequencies(config: ModelConfig, long: bool = False) -> torch.Tensor:  # [rotary_dim // 2] float32
    """`long`: LongRoPE's long factors rather than its short ones (other rope types ignore it)."""
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        if len(factors) != dim // 2:
            raise ValueError(f"LongRoPE factors have {len(factors)} entries, rotary dim {dim} needs {dim // 2}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling {rope_type!r}")
    return inv_freq


class RotaryEmbedding:
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.long = uses_long_factors(config, max_positions)  # LongRoPE: one factor set per engine (docstring)
        inv_freq = inverse_frequencies(config, self.long)
        scale = attention_factor(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # LongRoPE's attention factor, applied in float32 like transformers
            cos, sin = cos * scale, sin * scale
        half = inv_freq.numel()
        self.cos = cos.to(dtype).to(device)  # [max_positions, rotary_dim]
        # rotate_half(x) * sin == swap_halves(x) * signed_sin: the sign folded into the table saves a negation
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype).to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions` [num_tokens]: [num_tokens, 1, rotary_dim] each, gathered once
        per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] -> rotated: HF's x * cos + rotate_half(x) * sin on the first
        rotary_dim dims, the rest passed through. In place on CPU bfloat16 (x is returned), else a new tensor."""
        cos, signed_sin = tables
        if kernels_rope.supports(x, cos):  # CPU bfloat16: the same bits in one pass, in place
            return kernels_rope.rotate_(x, cos, signed_sin)
        rot_dim = cos.shape[-1]
        if rot_dim == x.shape[-1]:
            swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
            return x * cos + swapped * signed_sin
        rot = x[..., :rot_dim]
        swapped = rot.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return torch.cat((rot * cos + swapped * signed_sin, x[..., rot_dim:]), dim=-1)
