"""Paged KV cache bookkeeping: which fixed-size blocks of the pool each sequence owns, and which
full blocks are cached for reuse by later sequences with the same prefix.

Prefix caching: a full block is named by a hash chained over its tokens and its predecessor's hash
(seeded with a per-engine salt: model, dtype, KV dtype), so equal hashes mean equal token prefixes.
Blocks are reference-counted; a block whose KV has been written is registered under its hash, and
when its last reference goes it stays cached, evictable, until a fresh block is needed and the free
list is empty: then the least recently released cached block is evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from worker.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """A free list plus, with caching, an LRU of released cached blocks; block tables grow one block at a time."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, salt: str = "") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
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

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_tokens` tokens in total."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table with fresh blocks to hold `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"KV cache exhausted: need {needed} blocks, {self.num_free} free")
        for _ in range(needed):
            seq.block_table.append(self._take_fresh())
        self.peak_used = max(self.peak_used, self.num_used)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink `seq`'s block table to what `num_tokens` tokens need (the reverse of allocate): after
        speculation, blocks that held only rejected draft slots go back."""
        keep = blocks_for(num_tokens, self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its progress (num_computed_tokens) is the scheduler's to reset."""
        # the tail first, so that a sequence's last blocks are evicted before its (more shared) first ones
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

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
        """Blocks holding the longest cached prefix of `seq` (empty without caching). Looks, changes nothing."""
        if not self.enable_caching or seq.params.prompt_logprobs:  # those need every prompt row's logits
            return []
        found = []
        for h in self.shareable_hashes(seq):
            block = self._block_of_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of_hash

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` are unreferenced: sharing them takes them out of `num_free`."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start `seq`'s (empty) block table with cached `blocks` from `cached_prefix`."""
        if seq.block_table:
            raise RuntimeError("cached blocks can only start a block table")
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(blocks)
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
        for i, h in enumerate(self.hashes(seq, last)[first:], start=first):
            block = seq.block_table[i]
            if h in self._block_of_hash or block in self._hash_of_block:
                continue
            self._block_of_hash[h] = block
            self._hash_of_block[block] = h

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of `seq`'s first `num_blocks` blocks (kept on the sequence: tokens never change)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root_hash
            tokens = array("q", seq.tokens(i * bs, (i + 1) * bs)).tobytes()
            hashes.append(hashlib.sha256(parent + tokens).digest())
        return hashes[:num_blocks]

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat slot index (block_id * block_size + offset) of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
