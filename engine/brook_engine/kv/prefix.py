"""Which full KV blocks hold which token prefixes, so that requests sharing a prefix share
its blocks instead of computing and storing it again. Torch-free.

A full block's key chains the key of the block before it with the block's own token ids and
any extra keys (an adapter, a tenant's salt): ``key_i = hash(key_{i-1}, tokens_i, extra)``.
So equal keys mean equal whole prefixes, up to a hash collision — and the tokens are
compared on every hit, so a collision can never hand one request another's KV.

A cached block whose last holder is gone stays cached (evictable) until a new block is
needed and none is free; then the least recently (LRU) or least frequently (LFU, ties by
recency) used one is evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

HashFn = Callable[[bytes], int]

_HASHES: dict[str, HashFn] = {
    "xxh64": xxhash.xxh64_intdigest,
    "xxh3": xxhash.xxh3_64_intdigest,
}


def block_key(
    parent: int | None, tokens: Sequence[int], extra: tuple[str, ...], hash_fn: HashFn
) -> int:
    """The chained key of one full block."""
    parts = [b"-" if parent is None else parent.to_bytes(8, "little")]
    parts.append(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    parts.extend(e.encode() for e in extra)
    return hash_fn(b"\x00".join(parts))


@dataclass
class _Entry:
    key: int
    tokens: tuple[int, ...]
    parent: int | None
    hits: int = 0
    last_used: int = 0


class PrefixCache:
    def __init__(self, eviction: Literal["lru", "lfu"] = "lru", hash_name: str = "xxh64") -> None:
        self.eviction = eviction
        self.hash_fn: HashFn = _HASHES[hash_name]
        self._by_key: dict[int, int] = {}  # key → block
        self._entries: dict[int, _Entry] = {}  # block → entry
        # Unreferenced cached blocks: insertion order = recency for LRU; a lazy heap for LFU.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._lfu: list[tuple[int, int, int]] = []  # (hits, last_used, block)
        self._clock = itertools.count(1)
        self.num_queries = 0  # tokens looked up
        self.num_hits = 0  # tokens found
        self.num_evictions = 0

    # -- keys --------------------------------------------------------------------------

    def key(self, parent: int | None, tokens: Sequence[int], extra: tuple[str, ...]) -> int:
        return block_key(parent, tokens, extra, self.hash_fn)

    # -- lookup ------------------------------------------------------------------------

    def lookup(self, parent: int | None, key: int, tokens: Sequence[int]) -> int | None:
        """The block cached under ``key`` if it really holds ``tokens`` after ``parent``."""
        block = self._by_key.get(key)
        if block is None:
            return None
        entry = self._entries[block]
        if entry.tokens != tuple(tokens) or entry.parent != parent:
            return None  # a hash collision: not this prefix
        return block

    def touch(self, block: int) -> None:
        """A request took ``block``: count the use and take it off the evictable set."""
        entry = self._entries[block]
        entry.hits += 1
        entry.last_used = next(self._clock)
        self._lru.pop(block, None)  # the LFU heap is cleaned lazily

    # -- registration ------------------------------------------------------------------

    def register(self, block: int, key: int, tokens: Sequence[int], parent: int | None) -> bool:
        """Cache ``block`` under ``key``; False if another block already holds that prefix
        (two requests computed it at once) or ``block`` is already cached."""
        if key in self._by_key or block in self._entries:
            return False
        self._by_key[key] = block
        self._entries[block] = _Entry(key, tuple(tokens), parent, 1, next(self._clock))
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._entries

    # -- eviction ----------------------------------------------------------------------

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def make_evictable(self, block: int) -> None:
        """The last holder of cached ``block`` let go of it."""
        entry = self._entries[block]
        entry.last_used = next(self._clock)
        self._lru[block] = None
        if self.eviction == "lfu":
            heapq.heappush(self._lfu, (entry.hits, entry.last_used, block))
            if len(self._lfu) > 2 * len(self._lru) + 64:  # stale entries: rebuild
                self._lfu = [
                    (self._entries[b].hits, self._entries[b].last_used, b) for b in self._lru
                ]
                heapq.heapify(self._lfu)

    def evict(self) -> int:
        """Forget one unreferenced cached block and return it for reuse."""
        if not self._lru:
            raise LookupError("no evictable block")
        if self.eviction == "lru":
            block, _ = self._lru.popitem(last=False)
        else:
            while True:
                hits, last_used, block = heapq.heappop(self._lfu)
                entry = self._entries.get(block)
                # Stale heap items: the block was taken again since, or re-queued later.
                if (
                    block in self._lru
                    and entry is not None
                    and (entry.hits, entry.last_used) == (hits, last_used)
                ):
                    break
            del self._lru[block]
        entry = self._entries.pop(block)
        del self._by_key[entry.key]
        self.num_evictions += 1
        return block

    def forget(self, block: int) -> None:
        """Drop unreferenced cached ``block`` (the cache is shrinking past it)."""
        self._lru.pop(block)  # the LFU heap skips it lazily
        entry = self._entries.pop(block)
        del self._by_key[entry.key]
        self.num_evictions += 1

    def evictable_blocks(self) -> list[int]:
        return list(self._lru)

    def cached_blocks(self) -> list[int]:
        return list(self._entries)
