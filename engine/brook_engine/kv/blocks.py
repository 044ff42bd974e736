"""KV-cache block bookkeeping: which blocks are free, who holds which, reference counts.

Torch-free: the block manager deals in block ids; the runner owns the tensors. A block is
free, held by one or more sequences (reference count > 0; prefix sharing lets several
sequences hold one block), or — with prefix sharing — cached: unreferenced but still
holding a known prefix, reusable by a later request until it is evicted for a new block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from brook_engine.kv.prefix import PrefixCache
from brook_engine.sampling_params import SamplingParams


class Sequence(Protocol):
    """What the block manager reads and keeps of a sequence (``core.sequence.Sequence``)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def prefix_keys(self) -> list[int]: ...  # chained keys of the leading full blocks

    @property
    def params(self) -> SamplingParams: ...


class BlockManagerError(RuntimeError):
    """A bookkeeping invariant was violated (a bug, never a user error)."""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        min_prefix_len: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = prefix_cache
        self.min_prefix_len = max(min_prefix_len, block_size)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: free ones and unreferenced cached ones."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their prefix."""
        return self.cache.num_evictable if self.cache else 0

    @property
    def num_used_blocks(self) -> int:
        """Blocks live sequences hold."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached, unreferenced ones excluded)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add so ``block_table`` holds ``num_tokens`` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(block_table, num_tokens) + reserve <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to ``block_table`` until it holds ``num_tokens`` tokens: free ones
        first, then cached ones evicted for the purpose."""
        needed = self.num_new_blocks(block_table, num_tokens)
        if needed > self.num_free_blocks:
            raise BlockManagerError(f"asked for {needed} blocks with {self.num_free_blocks} free")
        for _ in range(needed):
            if self._free:
                block = self._free.popleft()
            else:
                assert self.cache is not None
                block = self.cache.evict()
            if self._ref_counts[block] != 0:
                raise BlockManagerError(f"free block {block} has references")
            self._ref_counts[block] = 1
            block_table.append(block)

    # -- prefix sharing ------------------------------------------------------------------

    def share_prefix(self, seq: Sequence) -> int:
        """Give a sequence that has computed nothing yet the cached blocks of its longest
        cached prefix (full blocks, at least ``min_prefix_len`` tokens, never its last
        token, which must be computed to sample). Returns the tokens it can skip."""
        if self.cache is None or seq.num_computed_tokens or seq.block_table:
            return 0
        size = self.block_size
        limit = (seq.num_tokens - 1) // size
        seq.prefix_keys.clear()
        matched: list[int] = []
        parent: int | None = None
        for i in range(limit):
            tokens = seq.token_ids[i * size : (i + 1) * size]
            key = self.cache.key(parent, tokens, seq.params.cache_extra)
            block = self.cache.lookup(parent, key, tokens)
            if block is None:
                break
            matched.append(block)
            seq.prefix_keys.append(key)
            parent = key
        if len(matched) * size < self.min_prefix_len:
            seq.prefix_keys.clear()
            return 0
        for block in matched:
            self.cache.touch(block)  # counts the use; an unreferenced one leaves the evictable set
            self._ref_counts[block] += 1
        seq.block_table.extend(matched)
        return len(matched) * size

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (a refused admission is looked up again)."""
        if self.cache is not None:
            self.cache.num_queries += num_tokens
            self.cache.num_hits += num_hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make the blocks ``seq`` has filled since the last call findable by their prefix."""
        if self.cache is None:
            return
        size = self.block_size
        full = min(seq.num_computed_tokens // size, len(seq.block_table))
        parent = seq.prefix_keys[-1] if seq.prefix_keys else None
        for i in range(len(seq.prefix_keys), full):
            tokens = seq.token_ids[i * size : (i + 1) * size]
            key = self.cache.key(parent, tokens, seq.params.cache_extra)
            self.cache.register(seq.block_table[i], key, tokens, parent)
            seq.prefix_keys.append(key)
            parent = key

    def release(self, block_table: list[int], seq: Sequence | None = None) -> None:
        """Drop one reference to every block of ``block_table`` and empty it (and forget
        ``seq``'s prefix keys: its blocks may now be evicted)."""
        self._release(block_table)
        block_table.clear()
        if seq is not None:
            seq.prefix_keys.clear()

    def _release(self, blocks: Iterable[int]) -> None:
        # Later blocks first: under LRU, a prefix's tail is evicted before its head, which
        # other requests are likelier to share.
        for block in reversed(list(blocks)):
            count = self._ref_counts[block]
            if count <= 0:
                raise BlockManagerError(f"block {block} released more often than held")
            self._ref_counts[block] = count - 1
            if count == 1:
                if self.cache is not None and self.cache.is_cached(block):
                    self.cache.make_evictable(block)
                else:
                    self._free.append(block)

    # -- resizing (weight offload's adaptive policy) ---------------------------------------

    def add_blocks(self, count: int) -> None:
        """Grow by ``count`` free blocks, numbered after the last."""
        self._free.extend(range(self.num_blocks, self.num_blocks + count))
        self._ref_counts.extend([0] * count)
        self.num_blocks += count

    def top_blocks_idle(self, count: int) -> bool:
        """Whether the last ``count`` blocks are free or only cached (so they can go)."""
        if count >= self.num_blocks:
            return False
        return all(
            self._ref_counts[b] == 0 for b in range(self.num_blocks - count, self.num_blocks)
        )

    def remove_top_blocks(self, count: int) -> None:
        """Shrink by the last ``count`` blocks, which ``top_blocks_idle`` said are idle."""
        if not self.top_blocks_idle(count):
            raise BlockManagerError(f"the last {count} blocks are not all idle")
        top = set(range(self.num_blocks - count, self.num_blocks))
        for block in top:
            if self.cache is not None and self.cache.is_cached(block):
                self.cache.forget(block)
        self._free = deque(b for b in self._free if b not in top)
        del self._ref_counts[self.num_blocks - count :]
        self.num_blocks -= count

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_invariants(self) -> None:
        """Every block is exactly one of: free (no references, not cached), cached and
        unreferenced (evictable), or held (references). Tests call this."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockManagerError("a block is on the free list twice")
        evictable = set(self.cache.evictable_blocks()) if self.cache else set()
        cached = set(self.cache.cached_blocks()) if self.cache else set()
        if free & cached:
            raise BlockManagerError(f"blocks both free and cached: {sorted(free & cached)}")
        for block, count in enumerate(self._ref_counts):
            if count < 0:
                raise BlockManagerError(f"block {block} has {count} references")
            idle = block in free or block in evictable
            if idle != (count == 0):
                raise BlockManagerError(
                    f"block {block}: free={block in free}, evictable={block in evictable}, "
                    f"refs={count}"
                )
