"""The engine on the real Gemma 3 270M (pulled from its PyPI chunk wheels): float32 greedy tokens equal to
transformers' own, and the INT8 default path's perplexity close to float32 (the full comparison, on
longer texts, is scripts/perplexity.py; figures in docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from worker.bench.perplexity import freight_perplexity
from worker.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

COMPLETIONS = ["Question: What is the capital of France?\nAnswer:", "The history of the Roman Empire begins",
               "def fibonacci(n):"]  # fmt: skip


FLOAT32 = dict(dtype="float32", quantization=None, kv_cache_dtype="auto")


@pytest.fixture(scope="module")
def float32_llm(gemma3_path) -> LLM:
    return LLM(str(gemma3_path), max_num_seqs=8, num_kv_blocks=128, **FLOAT32)


def test_float32_greedy_matches_transformers_and_answers(gemma3_path, float32_llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    llm = float32_llm
    prompts = [llm.tokenizer.encode(t) for t in COMPLETIONS]
    got = [o.output_token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    hf = AutoModelForCausalLM.from_pretrained(gemma3_path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert tokens == ids[0, len(prompt) :].tolist()
    assert "Paris" in llm.tokenizer.decode(got[0])


def test_int8_perplexity_close_to_float32_past_the_window(gemma3_path, float32_llm: LLM) -> None:
    text = "\n".join(
        f"Section {i}. The river town kept its records in a ledger: harvests, floods, the names of ferrymen "
        f"and the price of salt in year {1800 + i}." for i in range(18)
    )  # fmt: skip
    int8 = LLM(str(gemma3_path), max_num_seqs=4, num_kv_blocks=128, dtype="float32", quantization="int8",
               kv_cache_dtype="int8")  # fmt: skip
    ids = int8.tokenizer.encode(text)
    assert len(ids) > 512 + 2 * 16  # past the local layers' window by more than a block: some blocks freed
    scores = {name: freight_perplexity(llm, [ids]) for name, llm in (("float32", float32_llm), ("int8", int8))}
    print(f"gemma3-270m perplexity: float32 {scores['float32']:.3f}, W8A8 + INT8 KV {scores['int8']:.3f}")
    assert scores["int8"] <= scores["float32"] * 1.05
