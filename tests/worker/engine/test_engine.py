"""The engine end to end on a tiny random-weight Llama (with a tokenizer built in the test): batching, preemption,
sampling, errors."""

from __future__ import annotations

import pytest
import torch

from worker.engine import LLM, SamplingParams
from worker.engine.plan.invariance import (
    CANDIDATE_ROWS,
    invariant_block_rows,
    rounds_like_its_blocks,
    wide_block_rows,
)
from worker.engine.quantization import FloatLinear


@pytest.fixture(scope="module")
def tiny(tiny_llama_bytes_dir) -> LLM:
    return LLM(str(tiny_llama_bytes_dir), dtype="float32", quantization=None, kv_cache_dtype="auto", kv_cache_memory_gb=0.05)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


@pytest.mark.unit
def test_outputs_in_input_order_with_exact_token_accounting(tiny: LLM) -> None:
    batch = prompts(20)
    before = tiny.stats.as_dict()
    outs = tiny.generate(batch, SamplingParams(max_tokens=7, ignore_eos=True))
    after = tiny.stats.as_dict()
    assert [o.index for o in outs] == list(range(20))
    assert all(o.prompt_token_ids == p and len(o.output_token_ids) == 7 for o, p in zip(outs, batch, strict=True))
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    prompt_tokens = sum(map(len, batch))
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt_tokens
    assert after["output_tokens"] - before["output_tokens"] == 20 * 7
    # every prompt token and every output token but the last is fed once: nothing padded, nothing repeated
    assert after["computed_tokens"] - before["computed_tokens"] == prompt_tokens + 20 * 6
    assert after["padding_tokens"] == 0
    timings = outs[0].timings
    assert timings.queued <= timings.first_token <= timings.finished


@pytest.mark.unit
def test_stream_yields_each_request_when_it_finishes(tiny: LLM) -> None:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 1, 5)]
    order = [o.index for o in tiny.stream([[11, 12, 13]] * 3, params)]
    assert order == [1, 2, 0]


@pytest.mark.unit
def test_stream_cancellation_drops_unfinished(tiny: LLM) -> None:
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return True

    batch = prompts(4)
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    got = list(tiny.stream(batch, params, should_cancel=cancel, cancel_poll_seconds=0.0))
    assert got == [] and calls
    assert not tiny.engine.has_unfinished()
    assert tiny.engine.blocks.num_used == 0


def test_preemption_gives_same_greedy_tokens(tiny_llama_bytes_dir) -> None:
    batch = prompts(12, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", quantization=None, kv_cache_dtype="auto", block_size=4)
    large = LLM(str(tiny_llama_bytes_dir), num_kv_blocks=2000, **options)
    small = LLM(str(tiny_llama_bytes_dir), num_kv_blocks=40, **options)
    expected = [o.output_token_ids for o in large.generate(batch, params)]
    got = [o.output_token_ids for o in small.generate(batch, params)]
    assert large.stats.preemptions == 0
    assert small.stats.preemptions > 0, "pool was meant to be too small for the batch"
    assert got == expected
    assert small.stats.computed_tokens > large.stats.computed_tokens  # recompute is counted


@pytest.mark.unit
def test_request_that_cannot_fit_errors_alone(tiny_llama_bytes_dir) -> None:
    llm = LLM(str(tiny_llama_bytes_dir), dtype="float32", quantization=None, kv_cache_dtype="auto",
              max_model_len=64, block_size=4, num_kv_blocks=10)
    ok = [5, 6, 7]
    outs = llm.generate([ok, list(range(100, 180)), [], ok * 12], SamplingParams(max_tokens=4, ignore_eos=True))
    assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 4
    assert outs[1].finish_reason == "error" and "max_model_len" in outs[1].error
    assert outs[2].finish_reason == "error" and "empty" in outs[2].error
    # 36 + 4 tokens need 10 blocks of 4: it fits exactly
    assert outs[3].finish_reason == "length" and len(outs[3].output_token_ids) == 4
    # the context is cut from 64 to the 40 tokens the pool holds: a row asking for more output runs to it
    assert llm.max_model_len == 40 and llm.engine.context_cut
    longer = llm.generate([ok * 13], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert longer.finish_reason == "length" and len(longer.output_token_ids) == 1
    too_big = llm.generate([ok * 13 + [5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert too_big.finish_reason == "error" and "kv_cache_memory_gb" in too_big.error


def test_seeded_sampling_is_batch_invariant(tiny: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    target = [21, 22, 23, 24]
    alone = tiny.generate([target], params)[0].output_token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 9
    in_batch = tiny.generate(prompts(9, seed=5) + [target], [*others, params])[-1].output_token_ids
    assert alone == in_batch
    other_seed = tiny.generate([target], SamplingParams(max_tokens=12, temperature=0.8, seed=99, ignore_eos=True))
    assert other_seed[0].output_token_ids != alone


def test_float32_greedy_is_batch_invariant_to_the_bit(tiny_llama_bytes_dir) -> None:
    # unquantized float32 runs its products in fixed blocks of rows (quantization.FloatLinear; the size the
    # load-time check found, invariance.py): a prompt's logprobs, not only its tokens, are the same alone and
    # among nine others (a GEMM library's row-count dependent rounding shows up here first). Prefix caching
    # is off here: the tiny model's head_dim 16 has no compiled prefill kernel, and torch's SDPA rounds a
    # chunk after a cached prefix (a masked product) differently from the whole prompt (causal) on some CPUs
    # (an Intel Xeon capped at AVX2), which is not what this test is about.
    llm = LLM(str(tiny_llama_bytes_dir), dtype="float32", quantization=None, kv_cache_dtype="auto",
              kv_cache_memory_gb=0.05, enable_prefix_caching=False)  # fmt: skip
    rows = llm.engine.model.layers[0].qkv.invariant_rows
    assert rows in (*CANDIDATE_ROWS, 1)
    assert rows == invariant_block_rows(llm.engine.model_config, torch.float32)
    wide = llm.engine.model.layers[0].qkv.wide_rows
    assert wide == wide_block_rows(llm.engine.model_config, torch.float32, rows)
    assert all(w % rows == 0 for w in wide) and llm.engine.model.lm_head.wide_rows == ()
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    target = prompts(1, seed=11)[0]
    alone = llm.generate([target], params)[0]
    in_batch = llm.generate(prompts(9, seed=12) + [target], params)[-1]
    assert (in_batch.output_token_ids, in_batch.logprobs) == (alone.output_token_ids, alone.logprobs)


@pytest.mark.unit
def test_fixed_block_products_round_a_row_alike_at_any_batch_size() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(960, 576, generator=generator)
    x = torch.randn(40, 576, generator=generator)
    blocked = FloatLinear(weight, None, torch.float32, None, invariant_rows=16)
    rows = [blocked(x[i : i + 1]) for i in range(40)]
    for count in (2, 3, 16, 17, 40):
        together = blocked(x[:count])
        assert all(torch.equal(together[i], rows[i][0]) for i in range(count)), count


def test_wide_blocks_round_a_row_like_its_block_where_the_check_holds() -> None:
    # prefill's long inputs run in wide blocks where this machine's GEMM rounds them like 16-row blocks
    # (invariance.wide_block_rows): a row's result must not change with the block it ran in
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(960, 576, generator=generator)
    x = torch.randn(600, 576, generator=generator)
    wide = tuple(w for w in (512, 256, 64) if rounds_like_its_blocks(576, 960, w, 16, torch.float32))
    blocked = FloatLinear(weight, None, torch.float32, None, invariant_rows=16)
    widened = FloatLinear(weight, None, torch.float32, None, invariant_rows=16, wide_rows=wide)
    for count in (64, 256, 300, 600):  # all wide, and wide blocks followed by padded 16-row ones
        assert torch.equal(widened(x[:count]), blocked(x[:count])), count


@pytest.mark.unit
def test_top_k_one_equals_greedy(tiny: LLM) -> None:
    batch = prompts(6, seed=7)
    greedy = tiny.generate(batch, SamplingParams(max_tokens=10, ignore_eos=True))
    top1 = tiny.generate(batch, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))
    assert [o.output_token_ids for o in greedy] == [o.output_token_ids for o in top1]


@pytest.mark.unit
def test_stop_strings_cut_text_before_the_stop(tiny: LLM) -> None:
    prompt = [31, 32, 33]
    full = tiny.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[4:6]
    cut = tiny.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert cut.text == full.text[: full.text.find(stop)]


@pytest.mark.unit
def test_max_and_min_tokens(tiny: LLM) -> None:
    prompt = [41, 42, 43]
    first = tiny.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0].output_token_ids[0]
    stopped = tiny.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[first]))[0]
    assert stopped.output_token_ids == [first] and stopped.finish_reason == "stop"
    held = tiny.generate([prompt], SamplingParams(max_tokens=10, min_tokens=5, stop_token_ids=[first]))[0]
    assert len(held.output_token_ids) >= 5 and first not in held.output_token_ids[:5]
    assert len(tiny.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_token_ids) == 10


@pytest.mark.unit
def test_logprobs_are_reported_per_token(tiny: LLM) -> None:
    out = tiny.generate([[51, 52, 53, 54]], SamplingParams(max_tokens=5, logprobs=True, prompt_logprobs=True,
                                                           ignore_eos=True))[0]
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    assert len(out.prompt_logprobs) == 3 and all(lp <= 0 for lp in out.prompt_logprobs)


def test_chunked_prefill_matches_whole_prefill(tiny_llama_bytes_dir) -> None:
    batch = prompts(6, seed=11)
    params = SamplingParams(max_tokens=6, prompt_logprobs=True, ignore_eos=True)
    options = dict(dtype="float32", quantization=None, kv_cache_dtype="auto", num_kv_blocks=400)
    whole = LLM(str(tiny_llama_bytes_dir), max_num_batched_tokens=4096, **options).generate(batch, params)
    chunked_llm = LLM(str(tiny_llama_bytes_dir), max_num_batched_tokens=7, **options)
    chunked = chunked_llm.generate(batch, params)
    assert chunked_llm.stats.steps > 20  # really chunked
    for a, b in zip(whole, chunked, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) - 1
        assert b.prompt_logprobs == pytest.approx(a.prompt_logprobs, abs=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", [pytest.param("int8", marks=pytest.mark.unit), "auto"])
def test_int8_weights_run_with_either_cache(tiny_llama_bytes_dir, kv_cache_dtype: str) -> None:
    llm = LLM(str(tiny_llama_bytes_dir), dtype="bfloat16", quantization="int8", kv_cache_dtype=kv_cache_dtype,
              num_kv_blocks=200)
    outs = llm.generate(prompts(10, seed=2), SamplingParams(max_tokens=5, ignore_eos=True))
    assert all(len(o.output_token_ids) == 5 and o.error is None for o in outs)
    assert llm.stats.padding_tokens == 0


def test_engine_thread_runs_every_step_on_one_thread(tiny_llama_bytes_dir) -> None:
    """With engine_thread=True the engine is built and stepped on its own thread, whoever calls."""
    import threading

    llm = LLM(str(tiny_llama_bytes_dir), dtype="float32", quantization=None, kv_cache_dtype="auto",
              kv_cache_memory_gb=0.05, engine_thread=True)  # fmt: skip
    seen: set[str] = set()
    step = llm.engine.step

    def recording_step():
        seen.add(threading.current_thread().name)
        return step()

    llm.engine.step = recording_step
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    from_main = llm.generate([[5, 6, 7]], params)
    from_other: list = []
    caller = threading.Thread(target=lambda: from_other.extend(llm.generate([[5, 6, 7]], params)))
    caller.start()
    caller.join()
    llm.close()
    assert from_main[0].output_token_ids == from_other[0].output_token_ids
    assert len(seen) == 1 and next(iter(seen)).startswith("freight-engine")
