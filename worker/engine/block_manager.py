"""Paged KV cache bookkeeping: which fixed-size blocks of the pool each sequence owns, and which
full blocks are cached for reuse by later sequences with the same prefix.

Prefix caching: a full block is named by a hash chained over its tokens and its predecessor's hash
(seeded with a per-engine salt: model, dtype, KV dtype), so equal hashes mean equal token prefixes.
Blocks are reference-counted; a block whose KV has been written is registered under its hash, and
when its last reference goes it stays cached, evictable, until a fresh block is needed and the free
list is empty: then the least recently released cached block is evicted.

Sliding windows (attention.kv_groups): a model's layers form KV groups by window, each with its own pool
and BlockManager, and a sequence has one block table per group (BlockCoordinator runs them together). In a
window group (window W: a query at position p reads keys p - W < k <= p) the blocks lying wholly at or
before num_computed_tokens - W are read by no future query, since every query to come sits at a position
>= num_computed_tokens: they are released (a cached one stays cached, evictable) and their table entries
become PLACEHOLDER, so a sequence's KV there stops growing at about W tokens. A chunk longer than W is still
written whole (its own later queries read its first keys); its early blocks go at the next allocation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from worker.engine.sequence import Sequence

# The table entry of a block freed out of the window. Never read: the attention kernels skip blocks wholly
# before every query row's window; step_inputs turns it into block 0 (any in-range id will do).
PLACEHOLDER = -1


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """One KV group's pool: a free list plus, with caching, an LRU of released cached blocks; block tables
    grow one block at a time. `group` picks the sequence's table (Sequence.block_tables); `window` > 0 frees
    the blocks that fell out of the window."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        salt: str = "",
        *,
        window: int = 0,
        group: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.group = group
        self._root_hash = hashlib.sha256(salt.encode()).digest()
        # popped from the end, so the lowest ids are handed out first; holds only unregistered blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        # registered blocks nobody references, oldest release first: evicted in this order
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.peak_used = 0
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_fresh(self) -> int:
        """Blocks an allocation can take without evicting a cached one."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of_hash)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def table(self, seq: Sequence) -> list[int]:
        """`seq`'s block table in this group (made empty on first use)."""
        tables = seq.block_tables
        if self.group < len(tables):
            return tables[self.group]
        tables.extend([] for _ in range(self.group + 1 - len(tables)))
        return tables[self.group]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_tokens` tokens in total."""
        tables = seq.block_tables  # table(), inlined: every decode asks every step
        held = len(tables[self.group]) if self.group < len(tables) else 0
        return max(0, blocks_for(num_tokens, self.block_size) - held)

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once, decoding: a window group's are
        those from its oldest in-window position to its newest."""
        full = blocks_for(num_tokens, self.block_size)
        return min(full, blocks_for(self.window - 1, self.block_size) + 1) if self.window else full

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        free = self.num_free + (self.num_out_of_window(seq) if self.window else 0)
        return self.blocks_needed(seq, num_tokens) + reserve <= free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table with fresh blocks to hold `num_tokens` tokens (after releasing the
        blocks out of its window)."""
        if self.window:
            self.free_out_of_window(seq)
        table = self.table(seq)
        needed = blocks_for(num_tokens, self.block_size) - len(table)
        if needed > self.num_free:
            raise RuntimeError(f"KV cache exhausted: need {needed} blocks, {self.num_free} free")
        for _ in range(needed):
            table.append(self._take_fresh())
        self.peak_used = max(self.peak_used, self.num_used)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink `seq`'s block table to what `num_tokens` tokens need (the reverse of allocate): after
        speculation, blocks that held only rejected draft slots go back."""
        keep = blocks_for(num_tokens, self.block_size)
        table = self.table(seq)
        for block in reversed(table[keep:]):
            if block != PLACEHOLDER:
                self._release(block)
        del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its progress (num_computed_tokens) is the scheduler's to reset."""
        # the tail first, so that a sequence's last blocks are evicted before its (more shared) first ones
        for block in reversed(self.table(seq)):
            if block != PLACEHOLDER:
                self._release(block)
        seq.block_tables[self.group] = []

    # sliding window

    def first_in_window(self, position: int) -> int:
        """Index of the first block a query at `position` reads (keys position - window < k <= position)."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def num_out_of_window(self, seq: Sequence) -> int:
        """Blocks `seq` holds that no query to come reads (free_out_of_window releases them)."""
        if not self.window:
            return 0
        table = self.table(seq)
        end = min(self.first_in_window(seq.num_computed_tokens), len(table))
        i = end
        while i > 0 and table[i - 1] != PLACEHOLDER:  # freed ones form a prefix: walk back to it
            i -= 1
        return end - i

    def free_out_of_window(self, seq: Sequence) -> None:
        """Release the blocks before the window of `seq`'s next query: every query to come sits at a
        position >= num_computed_tokens (speculation's rollback never goes below it; preemption frees all)."""
        if not self.window:
            return
        table = self.table(seq)
        i = min(self.first_in_window(seq.num_computed_tokens), len(table))
        while i > 0 and table[i - 1] != PLACEHOLDER:
            i -= 1
            self._release(table[i])
            table[i] = PLACEHOLDER

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._hash_of_block:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def _take_fresh(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self.num_evictions += 1
            del self._block_of_hash[self._hash_of_block.pop(block)]
        self._refs[block] = 1
        return block

    # prefix caching

    def shareable_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of `seq`'s blocks that may be served from the cache: the full blocks lying entirely
        before its last token, which is always computed so that the step has logits to sample from
        (and so no sequence ever writes into a block it shares)."""
        return self.hashes(seq, (seq.num_tokens - 1) // self.block_size)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks serving the longest prefix of `seq` this group can serve alone (empty without caching),
        PLACEHOLDER before the window of its first uncached position. Looks, changes nothing."""
        if not self.enable_caching or seq.params.prompt_logprobs:  # those need every prompt row's logits
            return []
        hashes = self.shareable_hashes(seq)
        return self.cached_blocks(hashes, self.hit_length(hashes, len(hashes)))

    def hit_length(self, hashes: list[bytes], limit: int) -> int:
        """The longest hit of at most `limit` blocks of the chain `hashes` this group can serve: every block
        before it cached (full attention), or those that the window of its first uncached position reaches."""
        cached = self._block_of_hash
        if not self.window:
            n = 0
            while n < limit and hashes[n] in cached:
                n += 1
            return n
        reach = blocks_for(self.window - 1, self.block_size)  # blocks a query reads before its own
        if reach == 0:
            return limit
        end = limit  # candidate hit: blocks [i, end) are cached
        for i in range(limit - 1, -1, -1):
            if hashes[i] not in cached:
                end = i
            elif end - i >= reach:
                return end
        return end  # blocks [0, end) all cached

    def cached_blocks(self, hashes: list[bytes], num_blocks: int) -> list[int]:
        """The table a hit of `num_blocks` blocks (hit_length) starts a sequence with."""
        first = self.first_in_window(num_blocks * self.block_size)
        return [PLACEHOLDER] * first + [self._block_of_hash[h] for h in hashes[first:num_blocks]]

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of_hash

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` are unreferenced: sharing them takes them out of `num_free`."""
        return sum(1 for b in blocks if b != PLACEHOLDER and self._refs[b] == 0)

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start `seq`'s (empty) block table with cached `blocks` from `cached_prefix`."""
        if self.table(seq):
            raise RuntimeError("cached blocks can only start a block table")
        for block in blocks:
            if block == PLACEHOLDER:
                continue
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_tables[self.group] = list(blocks)
        self.peak_used = max(self.peak_used, self.num_used)

    def register_full(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks that the step feeding positions [start, end) of `seq` filled.

        Every token position of the sequence is registered as its block fills (prompt and output), so
        a sequence resumed after preemption finds its own blocks while they are not evicted. A block
        whose hash another block already holds (both computed in one step) stays unregistered.
        """
        if not self.enable_caching:
            return
        first, last = start // self.block_size, end // self.block_size  # blocks [first, last) are full
        table = self.table(seq)
        for i, h in enumerate(self.hashes(seq, last)[first:], start=first):
            block = table[i]
            if block == PLACEHOLDER or h in self._block_of_hash or block in self._hash_of_block:
                continue
            self._block_of_hash[h] = block
            self._hash_of_block[block] = h

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of `seq`'s first `num_blocks` blocks (kept on the sequence: tokens never change;
        every group of an engine has the same salt, so they share it)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root_hash
            tokens = array("q", seq.tokens(i * bs, (i + 1) * bs)).tobytes()
            hashes.append(hashlib.sha256(parent + tokens).digest())
        return hashes[:num_blocks]

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat slot index (block_id * block_size + offset) of token `position` of `seq`."""
        bs = self.block_size
        return seq.block_tables[self.group][position // bs] * bs + position % bs


@dataclass
class CachedPrefix:
    """A prefix-cache hit: its length, and the table each KV group starts the sequence with."""

    num_blocks: int  # the hit covers positions [0, num_blocks * block_size)
    tables: list[list[int]]  # per group; PLACEHOLDER where out of the window of the hit's end


class BlockCoordinator:
    """The block managers of a cache's KV groups (group 0 first: full attention where the model has any),
    run as one: a sequence is admitted or grown only when every group can allocate, preemption frees every
    group, and all of a sequence's tables keep the same length (entry i: positions of block i).

    layers[g]: the layers of group g, to weigh its blocks in the KV-use figures (num_blocks, num_used,
    peak_used), which count blocks of every layer: with one group, that group's own counts.
    """

    def __init__(self, groups: list[BlockManager], layers: list[int] | None = None) -> None:
        if [g.group for g in groups] != list(range(len(groups))):
            raise ValueError("group i's manager must have group=i")
        self.groups = groups
        self.block_size = groups[0].block_size
        self.enable_caching = groups[0].enable_caching
        self._layers = layers or [1] * len(groups)
        self._windows = [g for g in groups if g.window]
        # kept free at admission so running decodes do not preempt at once: 1% of each pool
        self.admission_reserve = [max(1, g.num_blocks // 100) for g in groups]
        self._peak_used = 0
        if len(groups) == 1:  # one group: its manager's own methods, no dispatch per call (as before groups)
            only = groups[0]
            self.can_allocate, self.allocate, self.trim = only.can_allocate, only.allocate, only.trim
            self.free, self.register_full = only.free, only.register_full

    @property
    def has_windows(self) -> bool:
        return bool(self._windows)

    def _weighted(self, counts: list[int]) -> int:
        if len(counts) == 1:
            return counts[0]
        return round(sum(c * n for c, n in zip(counts, self._layers, strict=True)) / sum(self._layers))

    @property
    def num_blocks(self) -> int:
        """The pools' size in blocks of every layer (with window groups, memory-equivalent)."""
        return self._weighted([g.num_blocks for g in self.groups])

    @property
    def num_used(self) -> int:
        """Blocks in use, weighted like num_blocks: num_used / num_blocks is the share of KV memory used."""
        return self._weighted([g.num_used for g in self.groups])

    @property
    def num_fresh(self) -> int:
        """Blocks every group can add without evicting (tables have one length: speculation's draft room)."""
        return min(g.num_fresh for g in self.groups)

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens fits each pool alone."""
        return all(g.max_blocks(num_tokens) <= g.num_blocks for g in self.groups)

    def longest_fit(self, limit: int) -> int:
        """The most tokens (at most `limit`) one sequence can reach with each pool to itself; 0 if none.
        Binary search on `fits`, so the rule stays max_blocks' (a window group's need stops growing)."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.fits(mid) else (low, mid - 1)
        return low

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return all(g.can_allocate(seq, num_tokens) for g in self.groups)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if not self.can_allocate(seq, num_tokens):  # no group grows alone
            raise RuntimeError(f"KV cache exhausted: cannot hold {num_tokens} tokens in every KV group")
        for g in self.groups:
            g.allocate(seq, num_tokens)
        self._track_peak()

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        for g in self.groups:
            g.trim(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        for g in self.groups:
            g.free(seq)

    def free_out_of_window(self, seq: Sequence) -> None:
        for g in self._windows:
            g.free_out_of_window(seq)

    def capacity(self, seq: Sequence) -> int:
        """Tokens `seq` can hold in all, with the blocks it holds and those every group can allocate now
        (a window group's out-of-window ones included)."""
        bs = self.block_size
        return min((len(g.table(seq)) + g.num_free + g.num_out_of_window(seq)) * bs for g in self.groups)

    def admission_capacity(self, prefix: CachedPrefix, keep_reserve: bool = True) -> int:
        """Tokens a waiting sequence admitted with `prefix` can hold, keeping the admission reserve free
        when `keep_reserve` (unreferenced cached blocks of the prefix count as free until it takes them);
        0: it waits. With nothing running there is no decode to protect: the reserve would only keep a
        sequence as long as the whole pool out for good."""
        reserves = self.admission_reserve if keep_reserve else [0] * len(self.groups)
        free = [
            g.num_free - reserve - g.num_evictable(table)
            for g, table, reserve in zip(self.groups, prefix.tables, reserves, strict=True)
        ]
        if min(free) < 0:
            return 0
        return min((len(table) + f) * self.block_size for table, f in zip(prefix.tables, free, strict=True))

    @property
    def peak_used(self) -> int:
        """The most blocks in use at once, weighted like num_used."""
        return self.groups[0].peak_used if len(self.groups) == 1 else self._peak_used

    def _track_peak(self) -> None:
        self._peak_used = max(self._peak_used, self.num_used)

    # prefix caching: one hash chain, every group serving the hit

    def shareable_hashes(self, seq: Sequence) -> list[bytes]:
        return self.groups[0].shareable_hashes(seq)

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        return self.groups[0].hashes(seq, num_blocks)

    def is_cached(self, block_hash: bytes) -> bool:
        """In group 0 (for ordering: whether a hit reaches a block depends on its neighbours too)."""
        return self.groups[0].is_cached(block_hash)

    def cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest hit every group serves: full-attention groups need every block before it cached,
        window groups only those the window of its first uncached position reaches (vLLM's rule). Looks,
        changes nothing."""
        if not self.enable_caching or seq.params.prompt_logprobs:  # those need every prompt row's logits
            return CachedPrefix(0, [[] for _ in self.groups])
        hashes = self.shareable_hashes(seq)
        n = len(hashes)
        while True:  # shorten until every group serves one length (a window group's rule is not monotone)
            m = n
            for g in self.groups:
                m = g.hit_length(hashes, m)
            if m == n:
                break
            n = m
        return CachedPrefix(n, [g.cached_blocks(hashes, n) for g in self.groups])

    def share(self, seq: Sequence, prefix: CachedPrefix) -> None:
        for g, table in zip(self.groups, prefix.tables, strict=True):
            g.share(seq, table)
        self._track_peak()

    def register_full(self, seq: Sequence, start: int, end: int) -> None:
        for g in self.groups:
            g.register_full(seq, start, end)
