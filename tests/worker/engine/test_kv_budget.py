"""The CPU KV pool's budget is cut to what is free, and the engine says what it allocated."""

from __future__ import annotations

import logging

import psutil
import pytest

from worker.engine import LLM, SamplingParams
from worker.engine.kv_budget import FREE_SHARE, cpu_kv_budget


@pytest.mark.unit
def test_a_budget_within_free_memory_is_kept() -> None:
    budget = cpu_kv_budget(0.01)
    assert not budget.cut
    assert budget.bytes == budget.asked_bytes == int(0.01 * 2**30)


@pytest.mark.unit
def test_a_budget_beyond_free_memory_is_cut_to_a_share_of_it() -> None:
    total_gb = psutil.virtual_memory().total / 2**30
    budget = cpu_kv_budget(total_gb * 4)
    assert budget.cut
    assert 0 < budget.bytes <= budget.free_bytes * FREE_SHARE


def test_the_engine_cuts_an_impossible_budget_and_says_so(tiny_llama_bytes_dir, caplog) -> None:
    total_gb = psutil.virtual_memory().total / 2**30
    with caplog.at_level(logging.INFO, logger="worker.engine.engine"):
        llm = LLM(str(tiny_llama_bytes_dir), dtype="float32", quantization=None, kv_cache_dtype="auto",
                  kv_cache_memory_gb=total_gb * 4, max_num_seqs=4, max_model_len=256)  # fmt: skip
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("KV cache cut from") for m in messages), messages
    assert any(m.startswith("KV cache: ") for m in messages), messages
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].output_token_ids) == 4
