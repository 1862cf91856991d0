"""Next-token choice for each sequence of a step: greedy in one op, sampling row by row.

Sampling rows use the request's own generator, so a seeded request draws the same tokens
alone or in any batch.
"""

from __future__ import annotations

import torch

from worker.engine.sampling_params import SamplingParams


def apply_min_tokens(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Mask end-of-sequence tokens of rows that have not yet produced min_tokens (in place)."""
    for row, token_ids in enumerate(banned):
        if token_ids:
            logits[row, token_ids] = float("-inf")


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [vocab] -> [vocab]
    scaled = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    fallback: torch.Generator,
) -> list[int]:
    tokens = greedy_picks(logits)
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = race(filtered_probs(logits[row], p), generators[row] or fallback)
    return tokens


def greedy_picks(logits: torch.Tensor) -> list[int]:  # [rows, vocab] -> the first maximal index of each row
    """max(dim) returns argmax's indices (the first maximum, NaN counting as one) at 2-3x argmax's speed
    on CPU (torch 2.13: 7 against 16 ms for 256 x 49,152 float32)."""
    return logits.max(dim=-1).indices.tolist()


def race(probs: torch.Tensor, generator: torch.Generator) -> int:  # [vocab] -> a token drawn from probs
    """Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p. One vocab-sized draw
    per token, so a generator's stream advances alike however the tokens are batched (verify.py)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int((probs / noise).argmax())


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> list[float]:
    """Log-probability of token_ids[i] under row i of the model's (unscaled) distribution."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, token_ids.view(-1, 1)).view(-1).tolist()
