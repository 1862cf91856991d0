"""Block manager and scheduler on their own: no model, just bookkeeping."""

from __future__ import annotations

import pytest

from worker.engine.block_manager import BlockCoordinator, BlockManager
from worker.engine.config import EngineConfig
from worker.engine.outputs import RequestTimings
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)


def make_seq(request_id: int, prompt_len: int) -> Sequence:
    return Sequence(
        request_id=request_id,
        index=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=8),
        timings=RequestTimings(queued=0.0),
    )


def test_block_manager_allocate_append_free_roundtrip() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, 9)
    assert blocks.blocks_needed(seq, 9) == 3
    blocks.allocate(seq, 9)
    assert len(seq.block_table) == 3 and blocks.num_free == 5
    assert blocks.slot(seq, 5) == seq.block_table[1] * 4 + 1
    blocks.allocate(seq, 12)  # still fits in the third block
    assert len(seq.block_table) == 3
    blocks.allocate(seq, 13)
    assert len(seq.block_table) == 4 and blocks.peak_used == 4
    assert not blocks.can_allocate(make_seq(1, 1), 4 * 5)
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.allocate(make_seq(1, 1), 4 * 5)
    blocks.free(seq)
    assert blocks.num_free == 8 and seq.block_table == [] and blocks.peak_used == 4


def test_length_scheduling_admits_shortest_first_and_packs_within_budget() -> None:
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=3, block_size=4)
    sched = Scheduler(config, BlockManager(num_blocks=100, block_size=4))
    for i, n in enumerate([30, 5, 20, 7]):
        sched.add(make_seq(i, n))
    out = sched.schedule()
    # shortest first: 5, 7, 20 (max_num_seqs=3), no padding: exactly the prompt tokens
    assert [c.seq.num_prompt_tokens for c in out.prefills] == [5, 7, 20]
    assert out.num_tokens == 32 and all(c.samples for c in out.prefills)


def test_fifo_scheduling_keeps_arrival_order_and_chunks_long_prompts() -> None:
    config = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, scheduling="fifo")
    sched = Scheduler(config, BlockManager(num_blocks=100, block_size=4))
    first, second = make_seq(0, 30), make_seq(1, 5)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in out.prefills] == [(0, 0, 16)]
    assert not out.prefills[0].samples
    first.num_computed_tokens = 16
    out = sched.schedule()
    # the unfinished prefill continues before the next request is admitted
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in out.prefills] == [(0, 16, 14), (1, 0, 2)]


def test_decode_without_free_block_preempts_newest() -> None:
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4)
    blocks = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(config, blocks)
    old, new = make_seq(0, 4), make_seq(1, 7)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert len(out.prefills) == 2 and blocks.num_free == 1
    for chunk in out.prefills:  # as the engine would after the step: prompt cached, one token sampled
        chunk.seq.num_computed_tokens = chunk.end
        chunk.seq.output_token_ids.append(9)
    out = sched.schedule()
    # old needs a fifth slot (new block): takes the free one; new (8 tokens, 2 blocks) fits in place
    assert out.decodes == [old, new] and not out.preempted
    old.num_computed_tokens += 1
    new.num_computed_tokens += 1
    old.output_token_ids.append(9)
    new.output_token_ids.append(9)
    out = sched.schedule()
    # new needs a third block, none free: the newest (new itself) is preempted and its blocks freed
    assert out.decodes == [old] and out.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert sched.num_waiting == 1


def test_admission_growth_and_preemption_span_every_kv_group() -> None:
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4)
    full = BlockManager(num_blocks=100, block_size=4)
    window = BlockManager(num_blocks=6, block_size=4, window=6, group=1)  # a query reads 2 blocks back
    sched = Scheduler(config, BlockCoordinator([full, window]))
    seqs = [make_seq(i, 12) for i in range(3)]
    for seq in seqs:
        seq.params.max_tokens = 16
        sched.add(seq)
    out = sched.schedule()
    # the window pool (6 blocks, 1 kept in reserve) cuts the second prompt's chunk and holds back the third;
    # the full pool has room for all
    assert [(c.seq, c.start, c.num_tokens) for c in out.prefills] == [(seqs[0], 0, 12), (seqs[1], 0, 8)]
    assert full.num_used == window.num_used == 5
    preempted = []
    while sched.has_unfinished():  # as the engine would after each step
        out = sched.schedule()
        preempted += out.preempted
        for seq in out.preempted:
            assert seq.block_tables == [[], []] and seq.num_computed_tokens == 0
        for seq in out.decodes:
            seq.num_computed_tokens += 1
        for chunk in out.prefills:
            chunk.seq.num_computed_tokens = chunk.end
        for seq in [*out.decodes, *(c.seq for c in out.prefills if c.samples)]:
            seq.output_token_ids.append(9)
            if len(seq.output_token_ids) == seq.params.max_tokens:
                sched.remove_finished(seq)
        assert window.num_used <= 6 and full.peak_used < 100
        # every sequence's tables have one length, one entry per block of positions
        assert all(len(s.block_tables[0]) == len(s.block_tables[1]) for s in sched.running)
    assert preempted, "the window pool was meant to be too small for all three"
    assert all(len(s.output_token_ids) == 16 for s in seqs)
    assert full.num_free == 100 and window.num_free == 6
