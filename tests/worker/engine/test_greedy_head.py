"""The fused greedy LM head (model.greedy_picks): on the real SmolLM2 in INT8, a greedy job's tokens are the
same with it and without it, on each INT8 backend this CPU runs, and the steps it cannot take (logprobs,
min_tokens bans, sampling) fall back to the logits within the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.engine.families import FAMILIES, build_family
from tests.worker.engine.test_real_model import chat_prompts
from worker.engine import LLM, SamplingParams
from worker.engine.plan.schemes import candidate_schemes

# the INT8 backends with a packed copy of their own, beside which keep_codes keeps the plain codes (oneDNN,
# AMX tiles where present); int_mm's layer holds the codes anyway (and is the slowest to run in CI)
BACKENDS = sorted({s.int8_backend for s in candidate_schemes(torch.device("cpu"))} - {None, "int_mm"})

ENGINE = dict(dtype="float32", quantization="int8", kv_cache_dtype="int8", kv_cache_memory_gb=0.5)


def engine(path: Path, fused: bool, **options) -> LLM:
    return LLM(str(path), fused_greedy_head=fused, **ENGINE, **options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_are_the_same_with_the_fused_head(smollm2_path: Path, backend: str) -> None:
    # small_batch_rows=0: the codes are kept for the head alone (keep_codes), beside the backend's own copy
    fused, plain = (engine(smollm2_path, f, int8_backend=backend, small_batch_rows=0) for f in (True, False))
    assert fused.engine.model.fused_greedy and not plain.engine.model.fused_greedy
    prompts = chat_prompts(fused.tokenizer, start=0, n=8, max_len=200)
    params = SamplingParams(max_tokens=40)  # greedy; speculation on: drafts' rows are picked in the head too
    got, want = fused.generate(prompts, params), plain.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert fused.engine.stats.draft_tokens > 0, "the prompts were meant to draft"


def test_steps_the_head_cannot_pick_fall_back_to_the_logits(smollm2_path: Path) -> None:
    fused, plain = (engine(smollm2_path, f) for f in (True, False))
    prompts = chat_prompts(fused.tokenizer, start=20, n=6, max_len=160)
    params = [
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=24, logprobs=True),
        SamplingParams(max_tokens=24, min_tokens=20),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3),
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=24),
    ]
    got, want = fused.generate(prompts, params), plain.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert got[1].logprobs == want[1].logprobs and len(got[1].logprobs) == len(got[1].output_token_ids)


def test_a_soft_capped_head_keeps_its_logits(tmp_path: Path, smollm2_path: Path) -> None:
    """Gemma 2's final soft-cap can round distinct logits to one value, so its picks stay the logits' own."""
    llm = LLM(str(build_family(FAMILIES["gemma2"], tmp_path / "gemma2", smollm2_path)), **ENGINE)
    assert llm.engine.model_config.final_logit_softcap and not llm.engine.model.fused_greedy
