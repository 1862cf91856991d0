"""How many parameters a decoder has, and how many a token uses: a mixture-of-experts layer runs only its
top-k experts per token, so the per-token cost (matrix-product FLOPs ~ 2 x active) follows "active", while
memory follows "total". A dense model's two are equal."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.config import ModelConfig


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # per token: the top-k experts of each sparse layer instead of all of them


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """Attention, norms, dense MLPs, embeddings and LM head count in both; a sparse layer's experts count all
    in total and top-k in active (its router, which every token runs, in both)."""
    h, d = config.hidden_size, config.head_dim
    attention = h * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * h
    if config.attention_bias:
        attention += (config.num_heads + 2 * config.num_kv_heads) * d
    norms = 2 * h + (2 * d if config.qk_norm else 0) + (2 * h if config.sandwich_norms else 0)
    expert = 3 * h * config.moe_intermediate_size
    total = active = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + h  # embed, head, norm
    for layer in range(config.num_layers):
        total += attention + norms
        active += attention + norms
        if config.is_sparse(layer):
            total += config.num_experts * (expert + h)  # experts and router rows
            active += config.num_experts_per_tok * expert + config.num_experts * h
        else:
            total += 3 * h * config.intermediate_size
            active += 3 * h * config.intermediate_size
    return ParameterCounts(total=total, active=active)
