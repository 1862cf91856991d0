"""rope.py against transformers: partial rotary (Phi-4-mini) and LongRoPE (Phi-3), both factor sets."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from tests.worker.engine.families import longrope
from worker.engine.config import ModelConfig
from worker.engine.rope import RotaryEmbedding, attention_factor, uses_long_factors

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

ORIGINAL = 64  # original_max_position_embeddings of the test configs


def phi3_config(partial: float = 0.75, max_positions: int = 4 * ORIGINAL, **rope) -> Phi3Config:
    head_dim = 32
    rotary = int(head_dim * partial)
    return Phi3Config(
        vocab_size=128, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        rope_parameters=longrope(rotary, ORIGINAL) | {"partial_rotary_factor": partial} | rope,
    )  # fmt: skip


def hf_tables(hf_config: Phi3Config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin at `positions` of one sequence (its dynamic update picks the factor set from
    the largest position)."""
    rotary = Phi3RotaryEmbedding(hf_config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


def ours(config: ModelConfig, max_positions: int) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor]:
    """Our table over every position: cos and transformers-layout sin (the sign folded back out)."""
    rope = RotaryEmbedding(config, max_positions, torch.float32, torch.device("cpu"))
    half = rope.cos.shape[-1] // 2
    sin = torch.cat((-rope.signed_sin[:, :half], rope.signed_sin[:, half:]), dim=-1)
    return rope, rope.cos, sin


def test_from_hf_partial_rotary_and_longrope() -> None:
    config = ModelConfig.from_hf(phi3_config())
    assert (config.head_dim, config.rotary_dim) == (32, 24)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert ModelConfig.from_hf(phi3_config(partial=1.0)).rotary_dim is None
    # Phi-4-mini's shape: head_dim 128, 0.75 of it rotates
    phi4 = Phi3Config(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    assert ModelConfig.from_hf(phi4).rotary_dim == 96


def test_short_factor_tables_match_transformers() -> None:
    """Sequences up to original_max_position_embeddings: transformers' short factors, times the attention
    factor (max_position_embeddings / original = 4 here, so it is not 1)."""
    for partial in (0.75, 1.0):
        hf_config = phi3_config(partial)
        config = ModelConfig.from_hf(hf_config)
        assert attention_factor(config) != 1.0
        assert not uses_long_factors(config, ORIGINAL)
        rope, cos, sin = ours(config, ORIGINAL)
        assert not rope.long
        want_cos, want_sin = hf_tables(hf_config, torch.arange(ORIGINAL))
        assert cos.shape == want_cos.shape == (ORIGINAL, config.rotary_dim or config.head_dim)
        torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
        torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)


def test_long_factor_tables_match_transformers() -> None:
    """An engine whose sequences may pass original_max_position_embeddings takes the long factors for every
    position: transformers' long_inv_freq (the init function at seq_len original + 1), cos and sin times the
    attention factor; and transformers' own table once a sequence is past the original length."""
    for partial, extra in ((0.75, {}), (1.0, {"attention_factor": 1.25})):
        hf_config = phi3_config(partial, **extra)
        config = ModelConfig.from_hf(hf_config)
        positions = 2 * ORIGINAL
        rope, cos, sin = ours(config, positions)
        assert rope.long and uses_long_factors(config, positions)
        long_inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=ORIGINAL + 1)
        assert scale == attention_factor(config)
        if extra:
            assert scale == 1.25
        freqs = torch.arange(positions).float()[:, None] * long_inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        torch.testing.assert_close(cos, emb.cos() * scale, rtol=0, atol=0)
        torch.testing.assert_close(sin, emb.sin() * scale, rtol=0, atol=0)
        want_cos, want_sin = hf_tables(hf_config, torch.arange(positions))
        torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
        torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)


def test_partial_rotary_apply_matches_transformers() -> None:
    """Only the first rotary_dim dims rotate, the rest pass through bit for bit; queries and keys rotated
    together (the decoder's fused q+k rotation) equal transformers' separate ones."""
    hf_config = phi3_config(0.75)
    config = ModelConfig.from_hf(hf_config)
    rope = RotaryEmbedding(config, ORIGINAL, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads = 20, 4, 2
    positions = torch.randint(0, ORIGINAL, (tokens,), generator=gen)
    q = torch.randn(tokens, heads, config.head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, config.head_dim, generator=gen)
    qk = rope.apply(torch.cat((q, k), dim=1), rope.tables(positions))
    cos, sin = hf_tables(hf_config, positions)
    # transformers' layout: [batch, heads, tokens, head_dim], tables [batch, tokens, rotary_dim]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(qk[:, :heads], want_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(qk[:, heads:], want_k[0].transpose(0, 1), rtol=0, atol=0)
    assert torch.equal(qk[..., 24:], torch.cat((q, k), dim=1)[..., 24:])
