"""Continuous batching: which sequences run in the next step, and how many tokens each feeds.

Decodes go first (one token each), then chunks of unfinished prefills, then new sequences, all
bounded by max_num_seqs, max_num_batched_tokens and free KV blocks. When a decode needs a block
and none is free, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its tokens (or, with prefix caching, from what of them is still cached).

Prefix caching: a sequence is admitted with the longest cached prefix of its tokens shared
(block_manager.py) and prefill starts after it. Two rules keep rows of one job, which share a
chat header and instruction, together: length ordering sorts by uncached tokens (below), and a
sequence whose next uncached block is being computed in this very step by another one waits a
step, to find it cached instead of computing it a second time.

KV groups (block_manager.BlockCoordinator): with sliding-window layers every KV group has its own pool;
a sequence is admitted or grown only when every group can hold it, a chunk is as long as the tightest
group allows, and preemption frees every group. Each step starts by freeing the blocks that fell out of the
running sequences' windows.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockCoordinator, BlockManager
from worker.engine.config import EngineConfig
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first position fed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so the step samples the next one."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # tokens admitted sequences took from the prefix cache instead of computing
    # draft tokens fed after a decode's last token (speculation.py), scored in the same step
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Rows the step feeds the model."""
        num_draft = sum(len(d) for d in self.drafts.values())
        return len(self.decodes) + num_draft + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockCoordinator | BlockManager) -> None:
        """blocks: the KV groups' managers; a lone BlockManager is one group."""
        self.config = config
        self.blocks = blocks if isinstance(blocks, BlockCoordinator) else BlockCoordinator([blocks])
        self.running: list[Sequence] = []  # admission order: the last one is the newest
        self._waiting: list[Sequence] = []
        self._waiting_sorted = True
        self._preempted: deque[Sequence] = deque()  # resumed before any new request

    def add(self, seq: Sequence) -> None:
        self._waiting.append(seq)
        self._waiting_sorted = False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._preempted)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting or self._preempted)

    def remove_finished(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)

    def drain(self) -> list[Sequence]:
        """Drop every unfinished sequence (cancellation), freeing its blocks."""
        dropped = [*self.running, *self._preempted, *self._waiting]
        for seq in self.running:
            self.blocks.free(seq)
        self.running, self._waiting = [], []
        self._preempted.clear()
        return dropped

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.blocks.has_windows:  # what left the windows goes back before anything is allocated
            for seq in self.running:
                self.blocks.free_out_of_window(seq)
        budget = self.config.max_num_batched_tokens
        budget -= self._schedule_decodes(out)
        budget = self._schedule_running_prefills(out, budget)
        if not out.preempted:  # memory is short this step: admitting now would only preempt again
            self._admit(out, budget)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            while not self.blocks.can_allocate(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.allocate(seq, seq.num_tokens)
                out.decodes.append(seq)
        return len(out.decodes)

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: int) -> int:
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens <= 1:
                continue
            num = min(seq.num_uncomputed_tokens, budget, self.blocks.capacity(seq) - seq.num_computed_tokens)
            if num > 0:
                self.blocks.allocate(seq, seq.num_computed_tokens + num)
                out.prefills.append(PrefillChunk(seq, seq.num_computed_tokens, num))
                budget -= num
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        in_flight = self._in_flight_hashes(out)
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                return
            cached = self.blocks.cached_prefix(seq)
            if self._waits_for_in_flight(seq, cached.num_blocks, in_flight):
                return
            start = cached.num_blocks * self.blocks.block_size
            num = min(seq.num_tokens - start, budget, self.blocks.admission_capacity(cached, bool(self.running)) - start)
            if num <= 0:
                return
            self._pop_waiting(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.blocks.share(seq, cached)
            seq.num_computed_tokens = start
            self.blocks.allocate(seq, start + num)
            chunk = PrefillChunk(seq, start, num)
            out.prefills.append(chunk)
            out.cached_tokens += start
            if self.blocks.enable_caching:
                in_flight.update(self._chunk_hashes(chunk))
            budget -= num

    def _in_flight_hashes(self, out: SchedulerOutput) -> set[bytes]:
        if not self.blocks.enable_caching:
            return set()
        return {h for chunk in out.prefills for h in self._chunk_hashes(chunk)}

    def _chunk_hashes(self, chunk: PrefillChunk) -> list[bytes]:
        """Hashes of the blocks this chunk fills (registered after the step)."""
        bs = self.blocks.block_size
        return self.blocks.hashes(chunk.seq, chunk.end // bs)[chunk.start // bs :]

    def _waits_for_in_flight(self, seq: Sequence, num_cached: int, in_flight: set[bytes]) -> bool:
        if not in_flight or seq.params.prompt_logprobs:
            return False
        hashes = self.blocks.shareable_hashes(seq)
        return num_cached < len(hashes) and hashes[num_cached] in in_flight

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0  # recomputed from its tokens (after any cached prefix) when resumed
        seq.status = SequenceStatus.WAITING
        self._preempted.appendleft(seq)
        out.preempted.append(seq)
        if seq in out.decodes:
            out.decodes.remove(seq)

    def _peek_waiting(self) -> Sequence | None:
        if self._preempted:
            return self._preempted[0]
        if not self._waiting:
            return None
        if not self._waiting_sorted:
            if self.config.scheduling == "length":
                # shortest (uncached) last, so that pop() from the end admits shortest-first
                uncached = self._uncached_tokens()
                self._waiting.sort(key=lambda s: (uncached(s), s.request_id), reverse=True)
            else:
                self._waiting.sort(key=lambda s: s.request_id, reverse=True)
            self._waiting_sorted = True
        return self._waiting[-1]

    def _uncached_tokens(self) -> Callable[[Sequence], int]:
        """Tokens a waiting sequence is expected to compute: its length less its leading blocks that are
        cached or that another waiting sequence shares (the first of them to run caches them).

        Ordering by this rather than total length keeps the rows of a job with a long shared
        instruction together and early: what each costs is its unique part, so they are not pushed
        behind shorter unrelated prompts, where the shared blocks might be evicted between them.
        """
        if not self.blocks.enable_caching:
            return lambda s: s.num_tokens
        counts = Counter(h for s in self._waiting for h in self.blocks.shareable_hashes(s))

        def uncached(seq: Sequence) -> int:
            if seq.params.prompt_logprobs:  # never served from the cache
                return seq.num_tokens
            shared = 0
            for h in self.blocks.shareable_hashes(seq):
                if counts[h] < 2 and not self.blocks.is_cached(h):
                    break
                shared += 1
            return seq.num_tokens - shared * self.blocks.block_size

        return uncached

    def _pop_waiting(self, seq: Sequence) -> None:
        if self._preempted and self._preempted[0] is seq:
            self._preempted.popleft()
        else:
            self._waiting.pop()
