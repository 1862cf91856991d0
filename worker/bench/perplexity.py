"""Perplexity of the engine on token texts: every token after a text's first scored by the engine's prompt
logprobs (one prefill per text, one generated token ignored). Used by scripts/perplexity.py and the quality
tests, so a figure in docs/benchmarks.md and a test bound measure the same thing."""

from __future__ import annotations

import math

from worker.bench.sharegpt import first_human_turns
from worker.engine import LLM, SamplingParams


def texts_for(tokenizer, n: int, min_len: int, max_len: int, start: int = 3000) -> list[list[int]]:
    """n ShareGPT human turns from index `start` on, tokenized, cut to max_len, those shorter than min_len
    skipped."""
    texts: list[list[int]] = []
    for _, text in first_human_turns(start, 20 * n):
        ids = tokenizer.encode(text)[:max_len]
        if len(ids) >= min_len:
            texts.append(ids)
        if len(texts) == n:
            break
    return texts


def freight_perplexity(llm: LLM, texts: list[list[int]]) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=True))
    logprobs = [lp for o in outs for lp in o.prompt_logprobs]
    if len(logprobs) != sum(len(t) - 1 for t in texts):
        raise RuntimeError("a text was not scored whole")
    return math.exp(-sum(logprobs) / len(logprobs))
