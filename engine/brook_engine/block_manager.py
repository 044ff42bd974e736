"""KV-cache block bookkeeping: which blocks are free, who holds which, reference counts.

Torch-free: the block manager deals in block ids; the runner owns the tensors. A block is
free, or held by one or more sequences (reference count > 0; prefix sharing lets several
sequences hold one block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockManagerError(RuntimeError):
    """A bookkeeping invariant was violated (a bug, never a user error)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add so ``block_table`` holds ``num_tokens`` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(block_table, num_tokens) + reserve <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append free blocks to ``block_table`` until it holds ``num_tokens`` tokens."""
        needed = self.num_new_blocks(block_table, num_tokens)
        if needed > len(self._free):
            raise BlockManagerError(f"asked for {needed} blocks with {len(self._free)} free")
        for _ in range(needed):
            block = self._free.popleft()
            if self._ref_counts[block] != 0:
                raise BlockManagerError(f"free block {block} has references")
            self._ref_counts[block] = 1
            block_table.append(block)

    def release(self, block_table: list[int]) -> None:
        """Drop one reference to every block of ``block_table`` and empty it."""
        self._release(block_table)
        block_table.clear()

    def _release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            count = self._ref_counts[block]
            if count <= 0:
                raise BlockManagerError(f"block {block} released more often than held")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_invariants(self) -> None:
        """Every block is free with no references, or held with some (tests call this)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockManagerError("a block is on the free list twice")
        for block, count in enumerate(self._ref_counts):
            if (block in free) != (count == 0):
                raise BlockManagerError(f"block {block}: free={block in free}, refs={count}")
