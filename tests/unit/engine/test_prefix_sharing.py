"""Prefix sharing: chained keys, token checks on every hit (a forced collision returns
nothing), reference counts and the free/cached/held states under random workloads with
cancellations, LRU and LFU eviction order, and — on a real model — the same greedy tokens
with sharing on as off."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brook_engine import LLM, SamplingParams
from brook_engine.core.sequence import Sequence
from brook_engine.kv.blocks import BlockManager
from brook_engine.kv.prefix import PrefixCache

SIZE = 4


def _seq(name: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(name, list(tokens), len(tokens), SamplingParams(cache_salt=salt))


def _compute_all(manager: BlockManager, seq: Sequence) -> None:
    """As the engine does: blocks for every token, all computed, full blocks cached."""
    manager.grow(seq.block_table, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)


def _manager(num_blocks: int = 32, eviction: str = "lru", **kw: Any) -> BlockManager:
    return BlockManager(num_blocks, SIZE, PrefixCache(eviction), **kw)  # type: ignore[arg-type]


def test_keys_chain_the_whole_prefix_and_the_salt() -> None:
    cache = PrefixCache()
    a = cache.key(None, [1, 2, 3, 4], ())
    assert cache.key(None, [1, 2, 3, 4], ()) == a
    assert cache.key(a, [5, 6, 7, 8], ()) != cache.key(None, [5, 6, 7, 8], ())
    assert cache.key(None, [1, 2, 3, 4], ("tenant-a",)) != a
    assert PrefixCache(hash_name="xxh3").key(None, [1, 2, 3, 4], ()) != a


def test_a_shared_prompt_reuses_full_blocks_but_never_its_last_token() -> None:
    manager = _manager()
    first = _seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    _compute_all(manager, first)
    second = _seq("b", [*range(10), 99])
    assert manager.share_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.ref_count(b) for b in second.block_table] == [2, 2]
    # A prompt that is exactly cached still computes its last block (it must sample).
    exact = _seq("c", list(range(8)))
    assert manager.share_prefix(exact) == 4
    manager.check_invariants()


def test_a_salt_separates_tenants() -> None:
    manager = _manager()
    _compute_all(manager, _seq("a", list(range(12)), salt="tenant-a"))
    assert manager.share_prefix(_seq("b", list(range(12)), salt="tenant-b")) == 0
    assert manager.share_prefix(_seq("c", list(range(12)))) == 0
    assert manager.share_prefix(_seq("d", list(range(12)), salt="tenant-a")) == 8


def test_a_forced_hash_collision_is_caught_by_the_token_check() -> None:
    manager = _manager()
    assert manager.cache is not None
    manager.cache.hash_fn = lambda data: 42  # every block key collides
    owner = _seq("a", [1, 2, 3, 4, 5])
    _compute_all(manager, owner)
    stranger = _seq("b", [9, 9, 9, 9, 9])
    assert manager.share_prefix(stranger) == 0
    assert stranger.block_table == []
    # Its own block cannot take the key either: it stays private, freed normally.
    _compute_all(manager, stranger)
    assert not manager.cache.is_cached(stranger.block_table[0])
    manager.release(stranger.block_table, stranger)
    manager.check_invariants()
    # The owner's prefix is still found by its own tokens.
    assert manager.share_prefix(_seq("c", [1, 2, 3, 4, 7])) == 4


def test_min_prefix_len_holds_back_short_matches() -> None:
    manager = _manager(min_prefix_len=8)
    _compute_all(manager, _seq("a", list(range(12))))
    assert manager.share_prefix(_seq("b", [0, 1, 2, 3, 50, 51])) == 0
    assert manager.share_prefix(_seq("c", list(range(9)))) == 8


def _cache_prefixes(manager: BlockManager, prefixes: list[list[int]]) -> list[int]:
    """Cache each prefix (one block each), release it; the first block of each."""
    firsts = []
    for i, tokens in enumerate(prefixes):
        seq = _seq(f"p{i}", [*tokens, 0])
        _compute_all(manager, seq)
        firsts.append(seq.block_table[0])
        manager.release(seq.block_table, seq)
    return firsts


def test_lru_evicts_the_least_recently_used_block() -> None:
    manager = _manager(num_blocks=6, eviction="lru")
    blocks = _cache_prefixes(manager, [[1] * 4, [2] * 4, [3] * 4])
    # Use prefix 1 again (now most recent), then ask for blocks until evictions start.
    again = _seq("again", [1] * 4 + [0])
    assert manager.share_prefix(again) == 4
    manager.release(again.block_table, again)
    assert manager.cache is not None
    grabbed: list[int] = []
    manager.grow(grabbed, manager.num_free_blocks * SIZE)
    order = [b for b in grabbed if b in blocks]
    assert order == [blocks[1], blocks[2], blocks[0]]
    assert manager.cache.num_evictions == 3


def test_lfu_evicts_the_least_frequently_used_block() -> None:
    manager = _manager(num_blocks=6, eviction="lfu")
    blocks = _cache_prefixes(manager, [[1] * 4, [2] * 4, [3] * 4])
    for _ in range(3):  # prefix 1 used often, prefix 3 once more, prefix 2 never again
        seq = _seq("x", [1] * 4 + [0])
        manager.share_prefix(seq)
        manager.release(seq.block_table, seq)
    seq = _seq("y", [3] * 4 + [0])
    manager.share_prefix(seq)
    manager.release(seq.block_table, seq)
    grabbed: list[int] = []
    manager.grow(grabbed, manager.num_free_blocks * SIZE)
    assert [b for b in grabbed if b in blocks] == [blocks[1], blocks[2], blocks[0]]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), eviction=st.sampled_from(["lru", "lfu"]))
def test_random_shared_workloads_keep_every_block_accounted(seed: int, eviction: str) -> None:
    rng = random.Random(seed)
    manager = _manager(num_blocks=rng.randint(8, 40), eviction=eviction)
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    live: list[Sequence] = []
    for i in range(200):
        action = rng.random()
        if action < 0.5 or not live:
            tokens = rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
            seq = _seq(f"r{i}", tokens, salt=rng.choice([None, None, "t"]))
            shared = manager.share_prefix(seq)
            assert shared % SIZE == 0 and shared < seq.num_tokens
            assert seq.token_ids[:shared] == tokens[:shared]
            if not manager.can_grow(seq.block_table, seq.num_tokens):
                manager.release(seq.block_table, seq)  # does not fit now: give back
                continue
            seq.num_computed_tokens = shared
            _compute_all(manager, seq)
            live.append(seq)
        else:  # a request ends or is cancelled
            seq = live.pop(rng.randrange(len(live)))
            manager.release(seq.block_table, seq)
        manager.check_invariants()
        held = sum(len(s.block_table) for s in live)
        assert manager.num_used_blocks <= held  # shared blocks count once
    for seq in live:
        manager.release(seq.block_table, seq)
    manager.check_invariants()
    assert manager.num_used_blocks == 0 and manager.usage == 0.0
    assert manager.num_free_blocks == manager.num_blocks


# -- on a real model --------------------------------------------------------------------


def _llm(path: Path, sharing: bool, kv_dtype: str) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,  # several chunks per prompt, mixed with decodes
        kv_cache={
            "num_blocks": 96,
            "block_size": 8,
            "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": kv_dtype}],
            "dynamic_precision": {"enabled": False},
            "prefix_sharing": {"enabled": sharing},
        },
        progress=False,
    )


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3", "int8"])
def test_sharing_gives_the_same_greedy_tokens_as_no_sharing(
    make_tiny_model: Callable[..., Path], kv_dtype: str
) -> None:
    path = make_tiny_model("llama")
    rng = random.Random(0)
    system = [rng.randint(5, 250) for _ in range(60)]
    prompts = [system + [rng.randint(5, 250) for _ in range(rng.randint(3, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    stats = {}
    for sharing in (False, True):
        llm = _llm(path, sharing, kv_dtype)
        # The first request warms the cache; the batch then shares its system prompt.
        first = llm.generate([prompts[0]], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        outputs[sharing] = [o.outputs[0].token_ids for o in first + rest]
        stats[sharing] = llm.engine.stats()
        llm.engine.block_manager.check_invariants()
        assert llm.engine.block_manager.num_used_blocks == 0
    assert outputs[True] == outputs[False]
    assert stats[False].prefix_cache_hits_total == 0
    # 7 requests × the 56 system tokens in full 8-token blocks, at least.
    assert stats[True].prefix_cache_hits_total >= 7 * 56
