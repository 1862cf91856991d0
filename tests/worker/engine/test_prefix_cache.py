"""Prefix caching: the block manager's hash chain, reference counts and LRU eviction on their own, the
scheduler's admission rules, and the engine end to end on a tiny random-weight Llama (float32)."""

from __future__ import annotations

import random

import pytest

from worker.engine import LLM, SamplingParams
from worker.engine.block_manager import PLACEHOLDER, BlockCoordinator, BlockManager
from worker.engine.config import EngineConfig
from worker.engine.outputs import RequestTimings
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence

BS = 4  # block size of every test here: short prompts span many blocks


def make_seq(request_id: int, tokens: list[int], prompt_logprobs: bool = False) -> Sequence:
    return Sequence(
        request_id=request_id,
        index=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs),
        timings=RequestTimings(queued=0.0),
    )


def computed(blocks: BlockManager, seq: Sequence) -> None:
    """As the engine does after a step that fed the whole prompt: KV written, full blocks registered."""
    blocks.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    blocks.register_full(seq, 0, seq.num_tokens)


# block manager


def test_hits_are_full_blocks_before_the_last_token_and_share_by_reference() -> None:
    blocks = BlockManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_seq(0, list(range(1, 13)))  # 12 tokens: 3 full blocks
    assert blocks.cached_prefix(first) == []
    computed(blocks, first)
    assert blocks.num_cached == 3
    same = make_seq(1, list(range(1, 13)))
    # the third block holds the last token, which must be computed for logits: 2 hits, not 3
    hits = blocks.cached_prefix(same)
    assert hits == first.block_table[:2]
    longer = make_seq(2, list(range(1, 20)))
    assert blocks.cached_prefix(longer) == first.block_table[:3]
    blocks.share(same, hits)
    assert [blocks.ref_count(b) for b in first.block_table] == [2, 2, 1]
    blocks.free(first)
    assert first.num_computed_tokens == 12  # free drops references only; progress is the scheduler's
    assert [blocks.ref_count(b) for b in same.block_table] == [1, 1]
    assert blocks.num_used == 2 and blocks.num_free == 14
    blocks.free(same)
    assert blocks.num_used == 0 and blocks.num_free == 16 and blocks.num_cached == 3


def test_hash_is_chained_and_salted() -> None:
    blocks = BlockManager(num_blocks=16, block_size=BS, enable_caching=True)
    computed(blocks, make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block after a different first block: no hit at all
    assert blocks.cached_prefix(make_seq(1, [9, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    other_model = BlockManager(num_blocks=16, block_size=BS, enable_caching=True, salt="other")
    assert other_model.hashes(make_seq(2, [1, 2, 3, 4]), 1) != blocks.hashes(make_seq(3, [1, 2, 3, 4]), 1)
    # prompt logprobs need every prompt row's logits: never served from the cache
    assert blocks.cached_prefix(make_seq(4, [1, 2, 3, 4, 5, 6, 7, 8, 9], prompt_logprobs=True)) == []
    off = BlockManager(num_blocks=16, block_size=BS)
    computed(off, make_seq(5, [1, 2, 3, 4, 5]))
    assert off.num_cached == 0 and off.cached_prefix(make_seq(6, [1, 2, 3, 4, 5])) == []


def test_free_list_first_then_least_recently_released_cached_block() -> None:
    blocks = BlockManager(num_blocks=4, block_size=BS, enable_caching=True)
    a, b = make_seq(0, [1, 2, 3, 4, 5]), make_seq(1, [6, 7, 8, 9, 10])
    computed(blocks, a)  # blocks 0 (cached) and 1 (partial, unregistered)
    computed(blocks, b)  # blocks 2 (cached) and 3
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free == 4 and blocks.num_cached == 2
    c = make_seq(2, list(range(100, 112)))
    blocks.allocate(c, 8)  # the two unregistered blocks first: nothing evicted
    assert sorted(c.block_table) == [1, 3] and blocks.num_cached == 2
    blocks.allocate(c, 12)  # then a's block, released before b's
    assert c.block_table[-1] == 0 and blocks.num_cached == 1 and blocks.num_evictions == 1
    assert blocks.cached_prefix(make_seq(3, [1, 2, 3, 4, 5])) == []
    assert blocks.cached_prefix(make_seq(4, [6, 7, 8, 9, 10])) == [2]
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.allocate(c, 20)


def test_a_block_computed_twice_is_registered_once() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_caching=True)
    a, b = make_seq(0, [1, 2, 3, 4, 5]), make_seq(1, [1, 2, 3, 4, 6])
    computed(blocks, a)
    computed(blocks, b)  # same first block computed in the same step
    assert blocks.num_cached == 1
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free == 8 and blocks.num_cached == 1


# sliding windows: BS = 4, window 10, so a query reads its own block and up to 3 before it


def with_cached(blocks: BlockManager, hashes: list[bytes], cached: str) -> BlockManager:
    """`blocks` with block i registered under hashes[i] where cached[i] == "x"."""
    for i, flag in enumerate(cached):
        if flag == "x":
            blocks._block_of_hash[hashes[i]] = i
            blocks._hash_of_block[i] = hashes[i]
    return blocks


@pytest.mark.parametrize(
    ("cached", "window_hit", "full_hit"),
    [
        ("xxxxxxxxxx", 10, 10),
        ("....xxxxxx", 10, 0),  # the first 7 blocks are out of the window of position 40
        ("xxxxxx.xx.", 6, 6),  # block 9 missing: 9 needs 6; 6 needs 3, 4, 5
        ("xx.x......", 2, 2),  # position 8's window reaches back to block 0
        (".xxx......", 4, 0),  # position 16's window starts in block 1
        (".xx.......", 0, 0),  # position 12's reaches block 0
    ],
)
def test_a_window_group_hit_needs_only_the_blocks_its_window_reaches(
    cached: str, window_hit: int, full_hit: int
) -> None:
    seq = make_seq(0, list(range(1, 42)))  # 10 shareable blocks
    hashes = BlockManager(num_blocks=1, block_size=BS).shareable_hashes(seq)
    window = with_cached(BlockManager(num_blocks=16, block_size=BS, enable_caching=True, window=10), hashes, cached)
    full = with_cached(BlockManager(num_blocks=16, block_size=BS, enable_caching=True), hashes, cached)
    assert window.hit_length(hashes, 10) == window_hit and full.hit_length(hashes, 10) == full_hit
    first = window.first_in_window(window_hit * BS)
    assert window.cached_blocks(hashes, window_hit) == [PLACEHOLDER] * first + list(range(first, window_hit))


def test_a_hit_is_the_longest_every_group_serves() -> None:
    seq = make_seq(0, list(range(1, 42)))
    hashes = BlockManager(num_blocks=1, block_size=BS).shareable_hashes(seq)
    full = with_cached(BlockManager(num_blocks=16, block_size=BS, enable_caching=True), hashes, "xxxxxxxx..")
    window = with_cached(
        BlockManager(num_blocks=16, block_size=BS, enable_caching=True, window=10, group=1), hashes, "xxxxxx.xxx"
    )
    # full: 8; the window cannot end at 8 (block 6 missing), at 6 it can; so can full
    hit = BlockCoordinator([full, window]).cached_prefix(seq)
    assert hit.num_blocks == 6
    assert hit.tables == [[0, 1, 2, 3, 4, 5], [PLACEHOLDER] * 3 + [3, 4, 5]]


def test_window_blocks_long_evicted_still_give_a_hit() -> None:
    full = BlockManager(num_blocks=32, block_size=BS, enable_caching=True)
    window = BlockManager(num_blocks=16, block_size=BS, enable_caching=True, window=10, group=1)
    blocks = BlockCoordinator([full, window])
    first = make_seq(0, list(range(1, 42)))
    for end in (8, 16, 24, 32, 40, 41):  # chunked prefill: blocks out of the window go (cached) as it runs
        blocks.allocate(first, end)
        blocks.register_full(first, first.num_computed_tokens, end)
        first.num_computed_tokens = end
    assert first.block_tables[1][:7] == [PLACEHOLDER] * 7 and window.num_used == 4 and full.num_used == 11
    blocks.free(first)
    again = make_seq(1, list(range(1, 42)) + [99])
    expected = blocks.cached_prefix(again)
    assert expected.num_blocks == 10 and expected.tables[1][:7] == [PLACEHOLDER] * 7
    # another sequence takes every free window block and evicts the 7 released first: the early ones
    window.allocate(make_seq(2, list(range(500, 552))), 13 * BS)
    assert window.num_evictions == 7 and window.num_cached == 3
    hit = blocks.cached_prefix(again)
    assert hit == expected
    blocks.share(again, hit)
    assert [window.ref_count(b) for b in held_blocks(again.block_tables[1])] == [1, 1, 1]
    assert [full.ref_count(b) for b in again.block_tables[0]] == [1] * 10


def held_blocks(table: list[int]) -> list[int]:
    return [b for b in table if b != PLACEHOLDER]


# scheduler


def test_shared_prefix_is_computed_once_and_rows_sort_by_uncached_tokens() -> None:
    config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=16, block_size=BS)
    blocks = BlockManager(num_blocks=100, block_size=BS, enable_caching=True)
    sched = Scheduler(config, blocks)
    shared = list(range(1000, 1040))  # 10 blocks
    rows = [make_seq(i, shared + [i] * (2 + i)) for i in range(3)]
    loner = make_seq(3, list(range(2000, 2020)))  # shorter in total than any row, longer than their unique part
    for seq in [loner, *rows]:
        sched.add(seq)
    out = sched.schedule()
    # the first row computes the shared blocks; the next row waits a step rather than compute them again
    assert [c.seq for c in out.prefills] == [rows[0]] and out.cached_tokens == 0
    for chunk in out.prefills:
        chunk.seq.num_computed_tokens = chunk.end
        blocks.register_full(chunk.seq, chunk.start, chunk.end)
        chunk.seq.output_token_ids.append(7)
    out = sched.schedule()
    assert [(c.seq, c.start) for c in out.prefills] == [(rows[1], 40), (rows[2], 40), (loner, 0)]
    assert out.cached_tokens == 80 and out.decodes == [rows[0]]


# engine end to end


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 49000) for _ in range(n)]


def family(seed: int) -> list[list[int]]:
    """Prompts sharing 0, 1, many and all-but-one blocks with others, and exact duplicates."""
    rng = random.Random(seed)
    prefix = tokens(rng, 40)
    batch = [tokens(rng, rng.randrange(3, 30)) for _ in range(3)]  # share nothing
    batch += [prefix[:BS] + tokens(rng, rng.randrange(1, 12)) for _ in range(3)]  # one block
    batch += [prefix[:36] + tokens(rng, rng.randrange(1, 12)) for _ in range(3)]  # many blocks
    batch += [prefix + [t] for t in tokens(rng, 3)]  # all but the last block
    batch += [prefix + [77]] * 2  # identical
    rng.shuffle(batch)
    return batch


OPTIONS = dict(dtype="float32", quantization=None, kv_cache_dtype="auto", block_size=BS)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=2000, enable_prefix_caching=False, **OPTIONS)


@pytest.fixture(scope="module")
def cached(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=2000, **OPTIONS)


def assert_released(llm: LLM) -> None:
    blocks = llm.engine.blocks
    assert not llm.engine.has_unfinished()
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert blocks.num_used == 0 and blocks.num_free == blocks.num_blocks


def test_same_greedy_tokens_with_and_without_caching(plain: LLM, cached: LLM) -> None:
    batch = family(seed=1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.output_token_ids for o in plain.generate(batch, params)]
    before = cached.stats.as_dict()
    got = [o.output_token_ids for o in cached.generate(batch, params)]
    after = cached.stats.as_dict()
    assert got == expected
    hits = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert hits > 0
    # every prompt token is either computed or served from the cache, exactly once
    assert after["computed_tokens"] - before["computed_tokens"] == sum(map(len, batch)) - hits + len(batch) * 11
    assert_released(cached)
    # the same batch again: everything up to each prompt's last block comes from the cache
    again = cached.stats.cached_prompt_tokens
    assert [o.output_token_ids for o in cached.generate(batch, params)] == expected
    assert cached.stats.cached_prompt_tokens - again == sum((len(p) - 1) // BS * BS for p in batch)
    assert_released(cached)


def test_cached_prompt_tokens_counted_exactly(cached: LLM) -> None:
    rng = random.Random(2)
    prompt = tokens(rng, 30)  # (30 - 1) // 4 = 7 shareable blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    before = cached.stats.cached_prompt_tokens
    cached.generate([prompt] * 5, params)  # the first computes the shared blocks, the other four wait a step
    assert cached.stats.cached_prompt_tokens - before == 4 * 28
    before = cached.stats.cached_prompt_tokens
    cached.generate([prompt[:10] + tokens(rng, 5)], params)  # shares the first 2 blocks
    assert cached.stats.cached_prompt_tokens - before == 8
    assert_released(cached)


def test_prompt_logprobs_requests_compute_their_whole_prompt(plain: LLM, cached: LLM) -> None:
    prompt = tokens(random.Random(3), 21)
    cached.generate([prompt], SamplingParams(max_tokens=2))
    params = SamplingParams(max_tokens=2, prompt_logprobs=True, ignore_eos=True)
    before = cached.stats.cached_prompt_tokens
    out = cached.generate([prompt], params)[0]
    assert cached.stats.cached_prompt_tokens == before
    assert out.prompt_logprobs == pytest.approx(plain.generate([prompt], params)[0].prompt_logprobs, abs=1e-4)


def test_cancellation_releases_shared_blocks(cached: LLM) -> None:
    batch = family(seed=4)
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    steps = iter(range(100))
    got = list(cached.stream(batch, params, should_cancel=lambda: next(steps) >= 3, cancel_poll_seconds=0.0))
    assert got == []
    assert_released(cached)


def test_preemption_and_eviction_with_shared_blocks_in_a_small_pool(plain: LLM, tiny_llama_dir) -> None:
    batch = family(seed=5) + family(seed=6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.output_token_ids for o in plain.generate(batch, params)]
    small = LLM(str(tiny_llama_dir), num_kv_blocks=48, **OPTIONS)
    got = [o.output_token_ids for o in small.generate(batch, params)]
    assert small.stats.preemptions > 0, "pool was meant to be too small for the batch"
    assert got == expected
    assert small.stats.cached_prompt_tokens > 0
    assert_released(small)
    # the pool was recycled over and over: cached blocks were evicted to make room, and still serve
    assert small.engine.blocks.num_evictions > 0
    first = [family(seed=5)[0]]
    assert [o.output_token_ids for o in small.generate(first, params)] == [expected[0]]
    assert_released(small)


def test_int8_kv_cache_shares_blocks_and_scales(tiny_llama_dir) -> None:
    options = {**OPTIONS, "kv_cache_dtype": "int8"}
    on = LLM(str(tiny_llama_dir), num_kv_blocks=2000, **options)
    off = LLM(str(tiny_llama_dir), num_kv_blocks=2000, enable_prefix_caching=False, **options)
    batch = family(seed=7)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.output_token_ids for o in off.generate(batch, params)]
    got = [o.output_token_ids for o in on.generate(batch, params)]
    assert on.stats.cached_prompt_tokens > 0
    # A cached prefix is read back dequantized, where a sequence prefilled in one chunk attends to its
    # unrounded keys: the two may differ in rounding, so compare token by token and allow a rare drift.
    same = sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True))
    assert same >= 0.9 * sum(map(len, expected))
    assert_released(on)
