"""Rotary position embeddings (HF "rotate_half" layout), with llama3 and linear scaling."""

from __future__ import annotations

import math

import torch

from worker.engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
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
        inv_freq = inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype).to(device)  # [max_positions, head_dim]
        # rotate_half(x) * sin == swap_halves(x) * signed_sin: the sign folded into the table saves a negation
        self.signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(dtype).to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions` [num_tokens]: [num_tokens, 1, head_dim] each, gathered once
        per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] -> rotated, a new tensor (HF's x * cos + rotate_half(x) * sin)."""
        cos, signed_sin = tables
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
        return x * cos + swapped * signed_sin
