"""Shape buckets: the token counts a step is padded to so that a finite set of compiled graphs
covers every step. Torch-free, so ``brook validate`` and the compile command share it.

A step is a flat run of tokens (one per decoding sequence, then the prefill chunks), so one
dimension — its token count — decides every shape in a decoder layer outside attention
(attention runs outside the graph, over the real tokens only). The buckets are the powers of
two up to the scheduler's token budget, and the budget itself: padding costs at most half a
step's rows, and a 2,048-token budget needs twelve graphs.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The buckets for steps of up to ``max_tokens`` tokens: 1, 2, 4, ... and the budget."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    buckets, size = [], 1
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_tokens)
    return tuple(buckets)


def bucket_for(tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``tokens``; None beyond the largest."""
    i = bisect_left(buckets, tokens)
    return buckets[i] if i < len(buckets) else None


def prefill_chunks(input_len: int, max_tokens: int) -> list[int]:
    """The chunk sizes a prompt of ``input_len`` tokens is prefilled in, alone in its steps."""
    full, rest = divmod(input_len, max_tokens)
    return [max_tokens] * full + ([rest] if rest else [])


def pattern_buckets(
    patterns: Iterable[tuple[int, int]], max_tokens: int, max_seqs: int
) -> list[int]:
    """The buckets registered ``(input_len, output_len)`` patterns imply: each pattern's
    prefill chunks, and the decode steps of 1 up to ``max_seqs`` sequences (a pattern says
    what a request looks like, not how many run at once). Empty without patterns."""
    buckets = token_buckets(max_tokens)
    wanted: set[int] = set()
    for input_len, _ in patterns:
        for chunk in prefill_chunks(input_len, max_tokens):
            wanted.add(bucket_for(chunk, buckets) or max_tokens)
        top = bucket_for(min(max_seqs, max_tokens), buckets) or max_tokens
        wanted.update(b for b in buckets if b <= top)
    return sorted(wanted)
