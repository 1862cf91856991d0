"""Tiny random-weight models of every supported family, built from the family's own transformers config
class (several layers, GQA, head_dim != hidden / heads where the family allows it, windows smaller than
the prompts), saved as HF folders with the real SmolLM2 tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.conftest import TINY_SHAPE

WINDOW = 24  # shorter than most test prompts, and not a multiple of the 16-token block

# conftest's tiny shape (SmolLM2's vocabulary and special ids, wide initialisation), deeper and with each
# family's own rope settings
BASE = {k: v for k, v in TINY_SHAPE.items() if k != "rope_parameters"} | dict(
    intermediate_size=96, num_hidden_layers=4, max_position_embeddings=1024
)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def longrope(rotary_dim: int, original: int = 2048) -> dict:
    """Phi-3 LongRoPE parameters with distinct short and long factors (rotary_dim // 2 each). The engine takes
    the short ones while its max_model_len (2048 in the tests) <= `original`, as transformers does below it;
    max_position_embeddings 4 * original makes the attention factor on cos and sin != 1."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.25 * i / half for i in range(half)],
            "long_factor": [1.0 + 8.0 * i / half for i in range(half)]}


@dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    model_class: type
    options: dict[str, Any]
    windowed: bool = False
    sparse: bool = False  # mixture of experts


FAMILIES = {
    f.name: f
    for f in [
        Family("llama3", LlamaConfig, LlamaForCausalLM, dict(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )),
        Family("qwen2", Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False, use_sliding_window=False)),
        Family("qwen3", Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
        Family("mistral", MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW, head_dim=32), windowed=True),
        Family("gemma2", Gemma2Config, Gemma2ForCausalLM, dict(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL,
            attn_logit_softcapping=20.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        ), windowed=True),
        Family("gemma3", Gemma3TextConfig, Gemma3ForCausalLM, dict(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            hidden_activation="gelu_pytorch_tanh",
        ), windowed=True),
        # Phi-4-mini style: partial rotary (0.75 of head_dim 32), LongRoPE; shipped fused qkv_proj / gate_up_proj
        Family("phi3", Phi3Config, Phi3ForCausalLM, dict(
            hidden_size=128, partial_rotary_factor=0.75, max_position_embeddings=8192, original_max_position_embeddings=2048,
            rope_parameters=longrope(24) | {"partial_rotary_factor": 0.75}, sliding_window=None, tie_word_embeddings=True,
        )),
        # Phi-3-mini-128k style: LongRoPE over the whole head (head_dim 16)
        Family("phi3_mini", Phi3Config, Phi3ForCausalLM, dict(
            max_position_embeddings=8192, original_max_position_embeddings=2048, rope_parameters=longrope(16),
            sliding_window=None, tie_word_embeddings=False,
        )),
        # mixture of experts (moe.py): 8 experts, top-2; Qwen3-MoE with one dense layer (mlp_only_layers)
        Family("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
            head_dim=32, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
        ), sparse=True),
        Family("mixtral", MixtralConfig, MixtralForCausalLM, dict(
            head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        ), windowed=True, sparse=True),
    ]
}  # fmt: skip


def build_family(family: Family, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a seeded random model of `family` with the tokenizer of `tokenizer_dir`; returns out_dir."""
    config = family.config_class(**(BASE | family.options))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = family.model_class(config).to(torch.float32).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                # HF starts biases at 0 and norms at 1 (Gemma's at 0): random ones make a dropped bias, a
                # misplaced norm or a missing (1 + w) visible in comparisons
                if name.endswith(".bias") or parameter.dim() == 1:
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir
