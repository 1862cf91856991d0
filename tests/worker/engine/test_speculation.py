"""Prompt-lookup speculative decoding: the n-gram drafter and adaptive k on their own, the acceptance rule
on a fixed distribution, and the engine end to end on a tiny random-weight Llama (float32), where
speculation must leave every token exactly as it is without it."""

from __future__ import annotations

import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.engine import LLM, SamplingParams
from worker.engine.block_manager import blocks_for
from worker.engine.draft_state import DraftState
from worker.engine.outputs import RequestTimings
from worker.engine.plan.small_batch import SmallBatchChoice
from worker.engine.sampler import greedy_picks
from worker.engine.scheduler import PrefillChunk, SchedulerOutput
from worker.engine.sequence import Sequence
from worker.engine.speculation import (
    ACCEPTANCE_FLOOR,
    DEFAULT_MAX_ROWS,
    Speculator,
    lookup_steps,
    propose,
)
from worker.engine.step_cost import StepCost
from worker.engine.verify import sample_chunks, verify_draft

T = TypeVar("T")
BS = 4  # block size: short sequences cross many blocks, so drafts straddle block boundaries


# drafter


def test_proposes_the_tokens_after_the_longest_matching_ngram() -> None:
    # [1, 2, 3] occurred at the start (followed by 10, 11, 7); [2, 3] more recently (followed by 20, 21)
    tokens = [1, 2, 3, 10, 11, 7, 2, 3, 20, 21, 1, 2, 3]
    assert propose(tokens, k=3) == [10, 11, 7]
    assert propose(tokens, k=3, max_ngram=2, min_ngram=1) == [20, 21, 1]
    assert propose([5, 6, 9, 5, 6], k=2) == []  # a 2-token match is below the default MIN_NGRAM


def test_proposes_after_the_most_recent_occurrence_and_no_further_than_the_end() -> None:
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], k=2, min_ngram=1) == [6, 1]
    assert propose([4, 5, 4], k=4, min_ngram=1) == [5, 4]  # the continuation runs into the suffix itself
    assert propose([1, 2, 3, 4], k=4, min_ngram=1) == []  # the suffix occurs nowhere earlier
    assert propose([7], k=4, min_ngram=1) == [] and propose([], k=4, min_ngram=1) == []


def test_a_byte_match_across_two_tokens_is_not_a_token_match() -> None:
    def token(raw: bytes) -> int:
        return int.from_bytes(raw, sys.byteorder)

    a, b, t = token(b"\0\0\0\1"), token(b"\0\1\0\0"), token(b"\0\0\1\0")
    assert (a.to_bytes(4, sys.byteorder) + b.to_bytes(4, sys.byteorder)).find(
        t.to_bytes(4, sys.byteorder)
    ) == 1
    assert propose([a, b, 7, t], k=2, min_ngram=1) == []
    assert propose([t, 9, a, b, 7, t], k=2, min_ngram=1) == [9, a]


def test_lookup_steps_count_every_draft_fed_and_its_agreeing_run_plus_one() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    copied = [1, 2, 3, 4, 5, 6, 7, 8]  # the output repeats the prompt
    # 1, 2 and 3 come one a step (no 3-token suffix occurs earlier); then the suffix 1, 2, 3 matches the
    # prompt's start and its draft 4, 5, 6, 7 (k = 4) agrees: 4 to 7 plus the step's own token, 8
    assert lookup_steps(prompt, copied, k=4) == 4
    assert lookup_steps(prompt, copied, k=64) == 4
    assert lookup_steps(prompt, copied, k=1) == 6  # then two tokens a step: 4 5 | 6 7 | 8
    # a draft that disagrees still gives its step's token: 4 agrees, 99 is the step's own; then no match
    assert lookup_steps(prompt, [1, 2, 3, 4, 99, 6], k=4) == 5
    assert lookup_steps(prompt, [], k=4) == 0
    # no prompt: a loop drafts itself once three tokens of it repeat
    assert lookup_steps([], [5, 5, 5, 5, 5, 5], k=2) == 5


def test_k_adapts_to_acceptance() -> None:
    state = DraftState(k=4, max_k=6)
    state.observe(proposed=4, accepted=4)
    assert state.k == 6  # full acceptance: longer drafts
    state.observe(proposed=6, accepted=6)
    assert state.k == 6  # capped
    state.observe(proposed=6, accepted=2)
    assert state.k == 5
    for _ in range(20):  # nothing accepted any more: the average falls under the floor, k to 1
        state.observe(proposed=state.k, accepted=0)
    assert state.k == 1 and state.acceptance < ACCEPTANCE_FLOOR


def sequence(prompt: list[int]) -> Sequence:
    return Sequence(
        request_id=0, index=0, prompt_token_ids=prompt, params=SamplingParams(), timings=RequestTimings(0.0)
    )


def test_a_shadow_draft_is_scored_against_the_tokens_that_come() -> None:
    # a sequence under the floor (it stopped drafting) falls into a loop: its shadows agree, and its
    # acceptance climbs back over the floor without a draft being fed
    seq = sequence([5, 6, 7, 8, 5, 6, 7])
    state = DraftState(k=2, max_k=4, acceptance=0.1)
    state.sync(seq)
    state.keep_shadow([8, 5], at=seq.num_tokens)  # the lookup's prediction for positions 7 and 8
    seq.output_token_ids.append(8)
    state.sync(seq)
    assert state.shadow == [8, 5] and state.acceptance == 0.1  # half known, agreeing so far: not scored yet
    seq.output_token_ids.append(5)
    state.sync(seq)
    assert state.shadow == [] and state.k == 4  # scored whole: 2 of 2, k grows
    assert state.acceptance == pytest.approx(0.75 * 0.1 + 0.25)
    for _ in range(3):
        state.keep_shadow([6, 7, 8, 5], at=seq.num_tokens)
        seq.output_token_ids.extend([6, 7, 8, 5])
        state.sync(seq)
    assert state.acceptance > ACCEPTANCE_FLOOR and state.k == 4
    # a disagreement scores the shadow as soon as it is known: its agreeing run, as verification would
    state.keep_shadow([6, 7, 9, 9], at=seq.num_tokens)
    before = state.acceptance
    seq.output_token_ids.extend([6, 7, 8])
    state.sync(seq)
    assert state.shadow == [] and state.k == 3
    assert state.acceptance == pytest.approx(0.75 * before + 0.25 * 2 / 4)


# acceptance rule


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_rejection_rule_keeps_the_distribution() -> None:
    p = [0.1, 0.3, 0.05, 0.25, 0.2, 0.1]  # row 0: the token after the last committed one
    q = [0.4, 0.1, 0.1, 0.1, 0.2, 0.1]  # row 1: the token after the draft token
    logits = torch.tensor([p, q]).log()  # [2, vocab]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    gen = torch.Generator().manual_seed(0)
    draft, n = 1, 20000
    first, residual, bonus = [0] * 6, [0] * 6, [0] * 6
    accepted = 0
    for _ in range(n):
        tokens = verify_draft(logits, [draft], params, gen)
        first[tokens[0]] += 1
        if tokens[0] == draft:
            accepted += 1
            assert len(tokens) == 2
            bonus[tokens[1]] += 1
        else:
            assert len(tokens) == 1
            residual[tokens[0]] += 1
    # the draft token is accepted with probability p(draft)
    assert abs(accepted / n - p[draft]) < 4.5 * (p[draft] * (1 - p[draft]) / n) ** 0.5
    rest = [0.0 if i == draft else pi / (1 - p[draft]) for i, pi in enumerate(p)]
    critical = 25.0  # chi-square, 5 degrees of freedom: exceeded with probability < 1e-4
    assert chi_square(residual, rest) < critical  # a rejection draws from p without the draft, renormalised
    assert chi_square(first, p) < critical  # so the emitted token is distributed as p
    assert chi_square(bonus, q) < critical  # and after an acceptance the next one as row 1's
    # the test can fail: the residual draws are far from p itself, which still holds the draft token
    assert chi_square(residual, p) > 10 * critical


def test_greedy_verification_keeps_the_agreeing_run_plus_one() -> None:
    logits = torch.nn.functional.one_hot(torch.tensor([5, 6, 7, 8]), 10).float()  # rows choose 5, 6, 7, 8
    greedy = SamplingParams()
    gen = torch.Generator()
    assert verify_draft(logits, [5, 6, 7], greedy, gen) == [5, 6, 7, 8]  # all accepted, plus the bonus
    assert verify_draft(logits, [5, 9, 7], greedy, gen) == [5, 6]  # the model's own token at the mismatch
    assert verify_draft(logits[:1], [], greedy, gen) == [5]


def test_greedy_picks_are_argmax_first_maximum_and_nan_included() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 300] = 50.0  # a tie: the first index
    logits[2, 42] = float("nan")  # NaN counts as the maximum, as in argmax
    assert greedy_picks(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_picks(logits)[1] == 7


def test_sample_chunks_keep_each_sequence_whole_and_in_order() -> None:
    drafts = [[], [1, 2, 3], [], [4] * 9, [], []]  # rows 1, 4, 1, 10, 1, 1
    def spans(max_rows: int) -> list[tuple[int, int, int, int]]:
        return [(s.start, s.stop, r.start, r.stop) for s, r in sample_chunks(drafts, max_rows)]

    # 1 + 4 rows would pass 4, and the 10-row sequence is a range of its own
    assert spans(4) == [(0, 1, 0, 1), (1, 2, 1, 5), (2, 3, 5, 6), (3, 4, 6, 16), (4, 6, 16, 18)]
    assert spans(128) == [(0, 6, 0, 18)]
    assert list(sample_chunks([], max_rows=4)) == []


# engine end to end

OPTIONS = dict(dtype="float32", quantization=None, kv_cache_dtype="auto", block_size=BS)
# The random tiny model's greedy choices hang on its whole context and never copy, so its drafts are
# rejected (and a wrong K/V rollback changes its tokens). Its "echo" twin has o_proj scaled by 0.002:
# the next token then depends mostly on the current one, a prompt that holds its own continuation is
# copied, drafts are mostly accepted, and attention still moves some choices.
ECHO_ATTENTION_SCALE = 0.002


@pytest.fixture(scope="module")
def tiny_echo_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_echo")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name in tensors:
            if name.endswith("o_proj.weight"):
                tensors[name] = tensors[name] * ECHO_ATTENTION_SCALE
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 49000) for _ in range(n)]


def repetitive(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat themselves, and random ones."""
    rng = random.Random(seed)
    batch = [tokens(rng, rng.randrange(4, 12)) * rng.randrange(2, 5) for _ in range(count)]
    return batch + [tokens(rng, rng.randrange(3, 30)) for _ in range(count // 2)]


def self_quoting(llm: LLM, seed: int, count: int) -> list[list[int]]:
    """P + G + P, G being the model's own greedy continuation of P: an echo model continues with G again,
    which the drafter finds after the first P (as a summary finds phrases in its document)."""
    rng = random.Random(seed)
    starts = [tokens(rng, rng.randrange(4, 16)) for _ in range(count)]
    outs = llm.generate(starts, SamplingParams(max_tokens=rng.randrange(20, 40), ignore_eos=True))
    return [p + o.output_token_ids + p for p, o in zip(starts, outs, strict=True)]


def checking_trims(llm: LLM) -> LLM:
    """After each verification a sequence holds no block past its tokens: rejected slots' blocks went back.
    Drafts from 1-token matches too: a random model's output repeats its prompt's phrases only briefly,
    and more (often rejected) drafts exercise verification and rollback more."""
    llm.engine.speculator.min_ngram = 1
    settle = llm.engine.speculator.settle

    def trimmed(seq, start: int, proposed: int, accepted: int) -> int:
        computed = settle(seq, start, proposed, accepted)
        assert len(seq.block_table) <= blocks_for(seq.num_tokens, BS)
        return computed

    llm.engine.speculator.settle = trimmed
    return llm


@pytest.fixture(scope="module")
def off(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=2000, enable_speculation=False, **OPTIONS)


@pytest.fixture(scope="module")
def on(tiny_llama_dir) -> LLM:
    return checking_trims(LLM(str(tiny_llama_dir), num_kv_blocks=2000, speculation_max_rows=64, **OPTIONS))


@pytest.fixture(scope="module")
def echo_off(tiny_echo_dir) -> LLM:
    return LLM(str(tiny_echo_dir), num_kv_blocks=2000, enable_speculation=False, **OPTIONS)


@pytest.fixture(scope="module")
def echo_on(tiny_echo_dir) -> LLM:
    return checking_trims(LLM(str(tiny_echo_dir), num_kv_blocks=2000, speculation_max_rows=64, **OPTIONS))


def assert_released(llm: LLM) -> None:
    blocks = llm.engine.blocks
    assert not llm.engine.has_unfinished()
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert blocks.num_used == 0 and blocks.num_free == blocks.num_blocks


def drafted(llm: LLM, run: Callable[[], T]) -> tuple[T, int, int]:
    """run()'s result, and the draft tokens proposed and accepted while it ran."""
    before = (llm.stats.draft_tokens, llm.stats.accepted_draft_tokens)
    result = run()
    return result, llm.stats.draft_tokens - before[0], llm.stats.accepted_draft_tokens - before[1]


@pytest.mark.parametrize("single", [True, False], ids=["one sequence", "batch"])
def test_same_greedy_tokens_with_speculation_on_and_off(off, on, echo_off, echo_on, single: bool) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for plain, spec, batch, echo in [
        (off, on, repetitive(seed=1, count=6), False),
        (echo_off, echo_on, self_quoting(echo_off, seed=1, count=6) + repetitive(seed=2, count=2), True),
    ]:
        groups = [[p] for p in batch[:2] + batch[-1:]] if single else [batch]
        proposed = accepted = 0
        for group in groups:
            expected = [o.output_token_ids for o in plain.generate(group, params)]
            got, p, a = drafted(spec, lambda group=group, spec=spec: spec.generate(group, params))
            assert [o.output_token_ids for o in got] == expected
            proposed, accepted = proposed + p, accepted + a
        assert proposed > 0, "speculation was meant to run"
        if echo:
            assert accepted > 0, "the echo model copies itself: drafts were meant to be accepted"
        else:
            assert accepted < proposed  # drafts were rejected: rollbacks ran
        assert_released(spec)


def test_token_accounting_with_speculation(echo_off: LLM, echo_on: LLM) -> None:
    batch = self_quoting(echo_off, seed=3, count=4)
    n = 30
    before = echo_on.stats.as_dict()
    echo_on.generate(batch, SamplingParams(max_tokens=n, ignore_eos=True))
    after = echo_on.stats.as_dict()
    spent = {name: after[name] - before[name] for name in after if isinstance(after[name], int | float)}
    assert spent["accepted_draft_tokens"] > 0 and spent["output_tokens"] == len(batch) * n
    # rejected draft rows leave no KV: every prompt token but the cached ones, and every output token
    # but the last, is computed exactly once
    prompt = sum(map(len, batch))
    assert spent["computed_tokens"] == prompt - spent["cached_prompt_tokens"] + len(batch) * (n - 1)
    # accepted drafts are tokens emitted without a step of their own: every sequence took fewer than n
    assert spent["steps"] < n


def test_seeded_sampling_alone_in_a_batch_and_without_speculation(echo_off: LLM, echo_on: LLM) -> None:
    batch = self_quoting(echo_off, seed=4, count=8)
    target = batch[0]
    params = SamplingParams(max_tokens=30, temperature=0.05, top_p=0.95, top_k=50, seed=77, ignore_eos=True)
    alone, proposed, accepted = drafted(
        echo_on, lambda: echo_on.generate([target], params)[0].output_token_ids
    )
    assert proposed > 0 and accepted > 0, (proposed, accepted)
    others = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in range(5, 12)]
    in_batch = echo_on.generate(batch[1:] + [target], [*others, params])[-1].output_token_ids
    assert in_batch == alone
    # one race per emitted token from the request's generator: the same tokens as plain decoding
    assert echo_off.generate([target], params)[0].output_token_ids == alone
    assert_released(echo_on)


def test_max_tokens_stop_strings_and_min_tokens_inside_a_draft(echo_off: LLM, echo_on: LLM) -> None:
    off, on = echo_off, echo_on
    batch = self_quoting(off, seed=5, count=8)
    lengths = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True) for n in range(3, 3 + len(batch))]
    expected = off.generate(batch, lengths)
    got, proposed, accepted = drafted(on, lambda: on.generate(batch, lengths))
    assert proposed > 0 and accepted > 0
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
    for g, e in zip(got, expected, strict=True):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    # stop strings cut from the middle of each output, stop tokens banned until min_tokens
    full = off.generate(batch, SamplingParams(max_tokens=40, ignore_eos=True))
    params = []
    for out in full:
        text, ids = out.text, out.output_token_ids
        params.append(SamplingParams(max_tokens=40, ignore_eos=True, stop=[text[len(text) // 2 :][:3]]))
        params.append(SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[ids[12]], min_tokens=8))
    doubled = [p for p in batch for _ in range(2)]
    expected = off.generate(doubled, params)
    got, proposed, accepted = drafted(on, lambda: on.generate(doubled, params))
    assert proposed > 0 and accepted > 0
    assert [(o.output_token_ids, o.text, o.finish_reason) for o in got] == [
        (o.output_token_ids, o.text, o.finish_reason) for o in expected
    ]
    assert sum(o.finish_reason == "stop" for o in got) >= len(batch)
    assert_released(on)


def test_blocks_with_prefix_caching_and_preemption(echo_off: LLM, tiny_echo_dir) -> None:
    rng = random.Random(6)
    shared = tokens(rng, 20)
    batch = [shared + p for p in self_quoting(echo_off, seed=7, count=8)] + repetitive(seed=8, count=8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.output_token_ids for o in echo_off.generate(batch, params)]
    small = checking_trims(LLM(str(tiny_echo_dir), num_kv_blocks=60, speculation_max_rows=256, **OPTIONS))
    blocks = small.engine.blocks
    slot = blocks.slot

    def own_slot(seq, position: int) -> int:  # every K/V write lands in a block no one else reads
        block = seq.block_table[position // BS]
        assert blocks.ref_count(block) == 1 and block not in blocks._hash_of_block
        return slot(seq, position)

    blocks.slot = own_slot
    checking_trims(small)
    got = [o.output_token_ids for o in small.generate(batch, params)]
    assert small.stats.preemptions > 0, "pool was meant to be too small for the batch"
    assert small.stats.cached_prompt_tokens > 0
    assert small.stats.draft_tokens > 0 and small.stats.accepted_draft_tokens > 0
    assert got == expected
    assert_released(small)


def test_no_drafts_in_a_step_over_the_row_bound(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=2000, speculation_max_rows=8, **OPTIONS)
    llm.engine.speculator.min_ngram = 1
    speculator = llm.engine.speculator
    steps = []
    propose_drafts = speculator.propose

    def recording(out, max_num_batched_tokens: int, *, num_waiting: int) -> None:
        propose_drafts(out, max_num_batched_tokens, num_waiting=num_waiting)
        steps.append((out.num_tokens, sum(map(len, out.drafts.values()))))

    speculator.propose = recording
    batch = repetitive(seed=9, count=12)  # 18 sequences decoding together: 18 rows > 8
    llm.generate(batch, SamplingParams(max_tokens=20, ignore_eos=True))
    assert llm.stats.draft_tokens == 0
    assert all(drafts == 0 for _, drafts in steps)
    # as the batch drains to a few sequences, the tail speculates, within the bound
    lengths = [SamplingParams(max_tokens=8 if i else 60, ignore_eos=True) for i in range(len(batch))]
    steps.clear()
    llm.generate(batch, lengths)
    assert llm.stats.draft_tokens > 0
    assert all(rows <= 8 for rows, drafts in steps if drafts)


def test_auto_row_bound_and_off_switch(tiny_llama_dir) -> None:
    auto = LLM(str(tiny_llama_dir), num_kv_blocks=100, **OPTIONS)
    assert auto.engine.speculator.max_rows == DEFAULT_MAX_ROWS  # float32: no small-batch measurement
    assert auto.engine.speculator.step_cost is None
    assert (
        LLM(str(tiny_llama_dir), num_kv_blocks=100, enable_speculation=False, **OPTIONS).engine.speculator
        is None
    )
    with pytest.raises(ValueError, match="speculation_max_rows"):
        LLM(str(tiny_llama_dir), speculation_max_rows=-1, **OPTIONS)


def test_auto_prices_rows_from_the_small_batch_measurement() -> None:
    # seconds of one pass over the projections (2-core AVX-512 VM, bfloat16 activations, INT8 weights)
    seconds = {"1/small": 7.8, "1/library": 8.29, "4/small": 8.11, "4/library": 11.77, "16/small": 19.06,
               "16/library": 18.36, "32/small": 27.81, "32/library": 22.18, "64/small": 57.79,
               "64/library": 29.32, "128/small": 87.62, "128/library": 44.92}  # fmt: skip
    cost = StepCost.from_measurement(SmallBatchChoice(rows=4, seconds=seconds).fastest())
    assert cost(1) == 7.8 and cost(16) == 18.36 and cost(80) == pytest.approx(33.22)
    assert cost(256) == pytest.approx(44.92 + 128 * (44.92 - 29.32) / 64)  # the last slope, extrapolated
    assert StepCost.from_measurement({1: 1.0}) is None
    assert StepCost.from_measurement({1: 2.0, 4: 1.0}).seconds == (2.0, 2.0)  # non-decreasing
    spec = Speculator(None, 4, 2048, step_cost=cost)
    assert spec._pays(rows=16, useful=16, k=4, acceptance=0.84)  # a small decode step: drafts are cheap
    assert spec._pays(rows=1 + 4096, useful=4097, k=4, acceptance=0.84) is False  # compute-bound prefill
    assert spec._pays(rows=256, useful=256, k=4, acceptance=0.84) is False  # a full batch drafts nothing
    assert spec._pays(rows=256, useful=256, k=4, acceptance=1.0) is False


def test_the_tail_values_a_token_by_the_last_steps_it_can_save() -> None:
    # one pass over the projections with the VNNI small-batch product (2-core AVX-512 VM), milliseconds
    cost = StepCost((1, 4, 16, 32, 64), (3.63, 4.88, 6.66, 10.76, 17.85))
    spec = Speculator(None, 4, 2048, step_cost=cost)
    seqs = [Sequence(i, i, [1, 2, 3], SamplingParams(max_tokens=200), RequestTimings(0.0)) for i in range(24)]
    step = SchedulerOutput(decodes=seqs)
    # requests still waiting: an accepted token saves an average row of the step, and 4 rows at 70% do not
    # repay their cost with the margin
    assert spec._tail_values(step, num_waiting=5) == {}
    assert spec._pays(rows=24, useful=24, k=4, acceptance=0.7) is False
    # the tail: whichever sequence ends last ends the batch, and each of its tokens is a one-row step less
    shares = spec._tail_values(step, num_waiting=0)
    assert shares == dict.fromkeys(seqs, pytest.approx(3.63 / 24))
    assert spec._pays(rows=24, useful=24, k=4, acceptance=0.7, tail_share=shares[seqs[0]])
    # sequences that started decoding well before the last ones cannot end the batch: the share goes to those
    spec._steps += 20
    late = [Sequence(i, i, [1, 2, 3], SamplingParams(max_tokens=200), RequestTimings(0.0)) for i in range(24, 28)]
    step.decodes.extend(late)
    shares = spec._tail_values(step, num_waiting=0)
    assert shares == dict.fromkeys(late, pytest.approx(3.63 / 4))
    # a step that still prefills is not the tail, nor is one priced without a measurement
    step.prefills.append(PrefillChunk(late[0], 0, 3))
    assert spec._tail_values(step, num_waiting=0) == {}
    assert Speculator(None, 4, 2048, max_rows=8)._tail_values(SchedulerOutput(), num_waiting=0) == {}


def test_sampling_a_step_in_chunks_of_rows_emits_what_one_chunk_does(echo_on: LLM, monkeypatch) -> None:
    """A step's logits are made and sampled a few sequences at a time (engine.sample_chunk_rows): greedy
    with logprobs, seeded sampling, min_tokens bans and drafts come out the same in chunks of 3 rows as in one."""
    import worker.engine.engine as engine_module

    batch = self_quoting(echo_on, seed=6, count=6) + repetitive(seed=6, count=4)
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=24, min_tokens=10, stop_token_ids=[batch[2][0]]),
    ] * 4
    params = params[: len(batch)]
    whole, proposed, _ = drafted(echo_on, lambda: echo_on.generate(batch, params))
    assert proposed > 0, "drafts were meant to be verified in the chunks"
    monkeypatch.setattr(engine_module, "SAMPLE_CHUNK_BYTES", 3 * 4 * echo_on.engine.model_config.vocab_size)
    chunked = echo_on.generate(batch, params)
    assert [(o.output_token_ids, o.finish_reason) for o in chunked] == [
        (o.output_token_ids, o.finish_reason) for o in whole
    ]
    for c, w in zip(chunked, whole, strict=True):
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert_released(echo_on)
