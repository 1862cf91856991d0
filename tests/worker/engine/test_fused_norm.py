"""The AMX path's RMSNorm fused with its activation quantization (AmxInt8Linear.normed): the real model's
greedy tokens are the same as with the norm and the quantization apart, and the fused path is what ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import cpu_int8_gemm_amx
from tests.worker.engine.test_real_model import chat_prompts
from worker.engine import LLM, SamplingParams, quantization

pytestmark = pytest.mark.skipif(not cpu_int8_gemm_amx.available(), reason="no AMX-INT8 on this CPU")


def test_fused_norm_gives_the_tokens_of_the_norm_and_quantization_apart(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(smollm2_path), dtype="bfloat16", quantization="int8", int8_backend="amx", small_batch_rows=0,
              kv_cache_dtype="int8", kv_cache_memory_gb=0.5, enable_prefix_caching=False)  # fmt: skip
    prompts = chat_prompts(llm.tokenizer, start=0, n=8, max_len=200)
    params = SamplingParams(max_tokens=32)
    made = []
    fused = quantization.AmxInt8Linear.normed

    def counted(self, hidden, weight, eps):
        rows = fused(self, hidden, weight, eps)
        made.append(type(rows))
        return rows

    monkeypatch.setattr(quantization.AmxInt8Linear, "normed", counted)
    got = [o.output_token_ids for o in llm.generate(prompts, params)]
    assert made and set(made) == {cpu_int8_gemm_amx.QuantizedRows}  # every norm before a tile GEMM fused
    monkeypatch.setattr(quantization.AmxInt8Linear, "normed", quantization._NormedInput.normed)
    assert [o.output_token_ids for o in llm.generate(prompts, params)] == got
