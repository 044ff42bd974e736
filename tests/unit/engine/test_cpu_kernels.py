"""The CPU fast paths against the portable ones they replace: the C decode-attention kernel
against the batched-matmul path over the same paged cache (every storage type, GQA groups,
head sizes the kernel specializes and one it does not, sliding windows, contexts that end
inside a block), and oneDNN-packed linear weights against ``F.linear``. The whole engine with
both on is held to transformers in ``test_engine_vs_transformers.py``; here, also with both
off (``BROOK_CPU_KERNELS=off``), the path accelerators take."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brook_engine import LLM, SamplingParams
from brook_engine.config import KVDType
from brook_engine.host import cpu_features
from brook_engine.kv.cache import Int8Params, LayerKVCache
from brook_engine.layers import cpu_decode, cpu_fused, cpu_kernels, cpu_matmul, linear
from brook_engine.layers.attention import _decode_attention

KINDS: list[KVDType] = ["auto", "fp16", "bf16", "fp8_e5m2", "fp8_e4m3", "int8"]


# The AVX2 build (BROOK_CPU_ISA=avx2) runs only where the CPU has what it is built for.
AVX2_BUILD = pytest.mark.skipif(
    platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= cpu_features(),
    reason="the AVX2 build needs an x86-64 CPU with AVX2, FMA and F16C",
)


def _forget_kernel(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """The kernel loader as if this process had not loaded it yet, building into cache."""
    monkeypatch.setenv("BROOK_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The kernel loader as if this process had not loaded it yet, building into tmp_path."""
    _forget_kernel(monkeypatch, tmp_path)
    yield


def _cache(
    kind: KVDType, dtype: torch.dtype, kv_heads: int, heads: int, dim: int, block_size: int
) -> LayerKVCache:
    gen = torch.Generator().manual_seed(1)
    num_blocks = 64
    cache = LayerKVCache.allocate(
        num_blocks, block_size, kv_heads, dim, kind, dtype, torch.device("cpu")
    )
    slots = num_blocks * block_size
    k = torch.randn(slots, kv_heads, dim, generator=gen) + 0.5  # a mean, as real keys have
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    if kind == "int8":
        q = torch.randn(slots, heads, dim, generator=gen)
        cache.int8 = Int8Params.fit(q, k, v)
    cache.write(torch.arange(slots), k.to(dtype), v.to(dtype))
    return cache


def _portable(
    q: torch.Tensor,
    cache: LayerKVCache,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    keys = torch.arange(tables.shape[1] * cache.block_size)[None, :]
    mask = keys < lens[:, None]
    if window is not None:
        mask &= keys >= lens[:, None] - window
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))[:, None, None, :]
    k, v = cache.read_blocks(tables)
    return _decode_attention(q, k, v, bias, scale).float()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("kv_heads", "heads", "dim", "block_size"),
    # GQA, MHA (head 128), MQA with an odd head, and MQA with 16 query heads over blocks
    # larger than the kernel's pass of keys (split within a block)
    [(2, 6, 64, 16), (4, 4, 128, 8), (1, 3, 24, 4), (1, 16, 64, 80)],
)
def test_the_decode_kernel_matches_the_portable_path(
    kind: KVDType, kv_heads: int, heads: int, dim: int, block_size: int, fresh_kernel: None
) -> None:
    _assert_kernel_matches(kind, kv_heads, heads, dim, block_size, (None, 2 * block_size + 1))


def _assert_kernel_matches(
    kind: KVDType,
    kv_heads: int,
    heads: int,
    dim: int,
    block_size: int,
    windows: tuple[int | None, ...],
) -> None:
    """Five sequences (one token, a block, a block and one, within a block, ten blocks) over
    random blocks: the kernel's output is the portable path's, for each window."""
    cache = _cache(kind, torch.float32, kv_heads, heads, dim, block_size)
    gen = torch.Generator().manual_seed(2)
    lens = torch.tensor([1, block_size, block_size + 1, 7 * block_size - 3, 10 * block_size])
    tables = torch.randperm(64, generator=gen)[: 5 * 10].view(5, 10)
    q = cache.query(torch.randn(5, heads, dim, generator=gen))
    for window in windows:
        got = cpu_decode.decode_attention(q, cache, tables, lens, dim**-0.5, window)
        assert got is not None, "a C compiler is here, so the kernel must have built"
        expected = _portable(q, cache, tables, lens, dim**-0.5, window)
        # Both sum in float32, in different orders; INT8 queries carry the scales (~100x).
        tolerance = 1e-3 if kind == "int8" else 1e-5
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=tolerance)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@AVX2_BUILD
def test_the_avx2_build_of_the_decode_kernel_matches_the_portable_path(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel: None
) -> None:
    """The kernels built for AVX2 + FMA (BROOK_CPU_ISA=avx2: what an AVX2-only CPU builds
    natively), whose 64- and 128-wide heads take their own register tiles: every storage
    type, a GQA group of 3 (a tile of 2 and one of 1), MHA at 128 and a group of 16."""
    monkeypatch.setenv("BROOK_CPU_ISA", "avx2")
    for kv_heads, heads, dim, block_size in [(2, 6, 64, 16), (4, 4, 128, 8), (1, 16, 64, 80)]:
        for kind in KINDS:
            _assert_kernel_matches(kind, kv_heads, heads, dim, block_size, (None,))
    library = cpu_kernels.library()
    assert library is not None and library.brook_decode_path() == 1, "the AVX2 build ran"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@AVX2_BUILD
def test_the_int8_head_map_gives_the_same_bits_in_every_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An INT8 layer's query and output maps sum each output over the head's columns in one
    order, whatever block the build runs it in: AVX-512 builds take 64 columns at a time
    (then 16 for what is left: head sizes 80 and 48), the AVX2 build 16; the outputs are
    equal bit for bit, and torch's product agrees within float32 rounding. (On a CPU
    without AVX-512 both builds run the 16-column blocks.)"""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for heads, dim in ((9, 64), (4, 80), (2, 48), (3, 128)):
        x = torch.randn(37, heads, dim, generator=gen)  # 9 blocks of 4 tokens and one of 1
        matrix = torch.randn(heads, dim, dim, generator=gen)
        offset = torch.randn(heads, dim, generator=gen)
        cases.append((x, matrix, offset))

    def mapped() -> list[torch.Tensor]:
        library = cpu_kernels.library()
        assert library is not None
        outs = []
        for x, matrix, offset in cases:
            tokens, heads, dim = x.shape
            out = torch.empty(tokens, heads, dim)
            status = library.brook_head_map(
                x.data_ptr(), matrix.data_ptr(), offset.data_ptr(), out.data_ptr(),
                tokens, heads, dim, heads * dim, 2,
            )  # fmt: skip
            assert status == 0
            outs.append(out)
        return outs

    builds = []
    for isa in ("native", "avx2"):
        monkeypatch.setenv("BROOK_CPU_ISA", isa)
        _forget_kernel(monkeypatch, tmp_path / isa)
        builds.append(mapped())
    for (x, matrix, offset), native, avx2 in zip(cases, *builds, strict=True):
        assert torch.equal(native, avx2), f"head size {x.shape[2]}"
        expected = torch.baddbmm(offset[:, None, :], x.transpose(0, 1), matrix).transpose(0, 1)
        torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_one_long_sequence_split_between_threads_matches_the_portable_path(
    threads: int, kind: KVDType, fresh_kernel: None
) -> None:
    """One sequence decoding has as many (sequence, KV head) pairs as KV heads, fewer than
    the threads want: its context is split into parts whose softmax sums are merged."""
    kv_heads, heads, dim, block_size = 3, 9, 64, 16
    cache = _cache(kind, torch.float32, kv_heads, heads, dim, block_size)
    gen = torch.Generator().manual_seed(3)
    tables = torch.randperm(64, generator=gen)[:40].view(1, 40)
    q = cache.query(torch.randn(1, heads, dim, generator=gen))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for length, window in ((600, None), (600, 100), (70, None), (640, 639)):
            lens = torch.tensor([length])
            got = cpu_decode.decode_attention(q, cache, tables, lens, dim**-0.5, window)
            assert got is not None
            expected = _portable(q, cache, tables, lens, dim**-0.5, window)
            tolerance = 1e-3 if kind == "int8" else 1e-5
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=tolerance)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@pytest.mark.parametrize("rising", [True, False])
def test_the_running_softmax_holds_when_the_largest_score_moves(
    rising: bool, fresh_kernel: None
) -> None:
    # Scores that grow (or shrink) by ~40 per block: the running maximum moves at every
    # block (or never), so earlier sums are rescaled by factors down to exp(-87) and below.
    kv_heads, heads, dim, block_size = 1, 2, 64, 16
    cache = _cache("auto", torch.float32, kv_heads, heads, dim, block_size)
    slots = cache.k.shape[1]
    ramp = torch.arange(slots, dtype=torch.float32) / block_size * 40.0  # the scores
    ramp = ramp if rising else ramp.flip(0)
    keys = torch.ones(kv_heads, slots, dim) * ramp[None, :, None] / dim**0.5
    cache.write(torch.arange(slots), keys.transpose(0, 1), cache.v.transpose(0, 1).clone())
    tables = torch.arange(12)[None, :]
    lens = torch.tensor([12 * block_size - 5])
    q = cache.query(torch.ones(1, heads, dim))
    got = cpu_decode.decode_attention(q, cache, tables, lens, dim**-0.5, None)
    assert got is not None
    expected = _portable(q, cache, tables, lens, dim**-0.5, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
def test_a_bfloat16_model_gets_float32_sums(fresh_kernel: None) -> None:
    """With bfloat16 activations the kernel still sums in float32: closer to the exact
    result than the portable path, whose matmuls round scores and outputs to bfloat16."""
    cache = _cache("auto", torch.bfloat16, 2, 4, 64, 16)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    tables = torch.arange(30).view(3, 10)
    lens = torch.tensor([5, 77, 160])
    got = cpu_decode.decode_attention(q, cache, tables, lens, 0.125, None)
    assert got is not None and got.dtype == torch.float32
    exact_cache = LayerKVCache(
        cache.k.double(), cache.v.double(), "auto", torch.float64, cache.block_size
    )
    exact = _portable(q.double(), exact_cache, tables, lens, 0.125, None).double()
    portable = _portable(q, cache, tables, lens, 0.125, None)
    assert float((got.double() - exact).abs().max()) < 1e-5
    assert float((got.double() - exact).norm()) < float((portable.double() - exact).norm())


def test_switched_off_the_portable_path_runs(
    fresh_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BROOK_CPU_KERNELS", "off")
    cache = _cache("auto", torch.float32, 1, 1, 8, 4)
    table = torch.zeros(1, 1, dtype=torch.long)
    got = cpu_decode.decode_attention(
        torch.ones(1, 1, 8), cache, table, torch.tensor([1]), 1.0, None
    )
    assert got is None and not cpu_decode.kernel_enabled()
    assert not linear.cpu_packing_supported(torch.float32)


def test_without_a_compiler_the_portable_path_runs_and_says_why(
    fresh_kernel: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level("WARNING", logger="brook_engine.layers.cpu_kernels"):
        assert not cpu_decode.kernel_enabled()
    assert "no C compiler" in caplog.text


def test_a_kernel_that_fails_to_build_leaves_the_portable_path(
    fresh_kernel: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "_SOURCES", (*cpu_kernels._SOURCES, broken))
    with caplog.at_level("WARNING", logger="brook_engine.layers.cpu_kernels"):
        assert not cpu_decode.kernel_enabled()
    assert "did not build" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # nothing half-written is left to load later


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernels cannot build")
def test_an_optional_kernel_that_fails_to_build_leaves_the_others(
    fresh_kernel: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compiler without AVX512-BF16 intrinsics still builds decode attention and the fused
    steps; the one-row kernel is then reported missing (its option warns and is off)."""
    broken = tmp_path / "one_row.c"
    broken.write_text("#error this compiler has no AVX512-BF16 intrinsics\n")
    sources = tuple(p for p in cpu_kernels._SOURCES if p.name != broken.name)
    monkeypatch.setattr(cpu_kernels, "_SOURCES", (*sources, broken))
    assert cpu_kernels.enabled() and cpu_decode.kernel_enabled()
    assert cpu_fused.one_row_path(torch.bfloat16, torch.bfloat16) is None
    row, weight = torch.randn(1, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    assert cpu_fused.one_row(row, weight, None) is None
    assert torch.equal(linear.one_row_linear(row, weight, None, None), F.linear(row, weight))


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN is not built into torch"
)
def test_packed_weights_replace_plain_ones_and_multiply_alike() -> None:
    gen = torch.Generator().manual_seed(4)
    model = nn.Module()
    model.proj = linear.Linear(48, 80, bias=True)
    model.head = linear.Linear(48, 100, bias=False)
    model.embed = nn.Embedding(100, 48)
    model.head.weight = model.embed.weight  # tied: the table must stay plain
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    plain_proj = model.proj.weight.detach().clone()
    table = model.embed.weight
    x = torch.randn(5, 48, generator=gen)
    expected = (F.linear(x, plain_proj, model.proj.bias), F.linear(x, table))
    added = linear.pack_cpu_weights(model)
    assert model.proj.weight.is_mkldnn and model.proj.packed is None
    assert model.head.weight is table and not table.is_mkldnn and model.head.packed is not None
    assert added == table.numel() * table.element_size()  # only the tied copy costs memory
    with torch.no_grad():
        torch.testing.assert_close(model.proj(x), expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.head(x), expected[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.proj(x[:1]), expected[0][:1], rtol=1e-5, atol=1e-5)
    assert torch.equal(linear.dense(model.proj.weight), plain_proj)


def test_the_engine_with_both_off_still_matches_with_both_on(
    make_tiny_model: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    fresh_kernel: None,
) -> None:
    """Greedy tokens of a mixed batch are the same through the fast paths and through the
    portable ones (which accelerators run); both are held to transformers elsewhere."""
    folder = make_tiny_model("llama")
    kv = {"layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}], "num_blocks": 64}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (4, 19, 33)]
    fast = LLM(str(folder), dtype="float32", kv_cache=kv, progress=False)
    fast_out = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    linears = [m for m in fast.engine.runner.model.modules() if isinstance(m, nn.Linear)]
    assert any(linear.is_packed(m.weight) for m in linears)
    monkeypatch.setenv("BROOK_CPU_KERNELS", "off")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    portable = LLM(str(folder), dtype="float32", kv_cache=kv, progress=False)
    assert not cpu_decode.kernel_enabled()
    modules = portable.engine.runner.model.modules()
    assert not any(linear.is_packed(m.weight) for m in modules if isinstance(m, nn.Linear))
    slow_out = [o.outputs[0].token_ids for o in portable.generate(prompts, params, use_tqdm=False)]
    assert fast_out == slow_out


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: nothing to prebuild")
def test_a_prebuilt_kernel_serves_where_no_compiler_is(
    fresh_kernel: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine image builds a baseline copy at install time and has no compiler at run
    time; a CPU without the baseline's features must not load it (it would die on the first
    missing instruction)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    sources = []
    for original in cpu_kernels._SOURCES:
        sources.append(csrc / original.name)
        sources[-1].write_bytes(original.read_bytes())
    for header in cpu_kernels._SOURCES[0].parent.glob("*.h"):
        (csrc / header.name).write_bytes(header.read_bytes())
    monkeypatch.setattr(cpu_kernels, "_SOURCES", tuple(sources))
    built = cpu_kernels.prebuild()
    assert built.parent == csrc and built.is_file()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    baseline = cpu_kernels._BASELINES.get(platform.machine())
    if baseline is None or not baseline[1] <= cpu_kernels.cpu_features():
        pytest.skip("this CPU lacks the baseline the prebuilt copy targets")
    with caplog.at_level("INFO", logger="brook_engine.layers.cpu_kernels"):
        assert cpu_decode.kernel_enabled()
    assert "prebuilt" in caplog.text
    cache = _cache("int8", torch.float32, 2, 4, 64, 16)
    q = cache.query(torch.randn(2, 4, 64))
    tables, lens = torch.arange(8).view(2, 4), torch.tensor([9, 60])
    got = cpu_decode.decode_attention(q, cache, tables, lens, 0.125, None)
    assert got is not None
    expected = _portable(q, cache, tables, lens, 0.125, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    # The fused steps and the one-row product come from the same library.
    gate_up = torch.randn(3, 64).bfloat16()
    expected_act = F.silu(gate_up[:, :32]) * gate_up[:, 32:]
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), expected_act, rtol=8e-3, atol=8e-3)
    weight, row = torch.randn(24, 40).bfloat16(), torch.randn(1, 40).bfloat16()
    expected_row = F.linear(row.float(), weight.float()).bfloat16()
    got_row = cpu_fused.one_row(row, weight, None)  # its paths above the baseline check the CPU
    assert got_row is not None
    torch.testing.assert_close(got_row, expected_row, rtol=8e-3, atol=8e-3)
    # And Brook's float32 product.
    w32, x32 = torch.randn(64, 40), torch.randn(5, 40)
    assert cpu_matmul.available()
    got32 = cpu_matmul.matmul(x32, cpu_matmul.pack(w32), None)
    torch.testing.assert_close(got32, F.linear(x32, w32))

    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset())
    assert not cpu_decode.kernel_enabled()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kv_store_kernel_writes_what_the_cache_writes(dtype: torch.dtype) -> None:
    kv_heads, heads, dim = 2, 6, 64
    stored = LayerKVCache.allocate(8, 4, kv_heads, dim, "auto", dtype, torch.device("cpu"))
    written = LayerKVCache.allocate(8, 4, kv_heads, dim, "auto", dtype, torch.device("cpu"))
    qkv = torch.randn(3, heads + 2 * kv_heads, dim).to(dtype)  # keys and values are views
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.tensor([5, 0, 31])
    assert cpu_decode.store(stored, slots, k, v)
    written.write(slots, k, v)
    assert torch.equal(stored.k, written.k) and torch.equal(stored.v, written.v)
    with pytest.raises(IndexError, match="outside the cache's 32 slots"):
        cpu_decode.store(stored, torch.tensor([32]), k[:1], v[:1])
    # A cache that encodes what it stores is left to its own write.
    fp8 = LayerKVCache.allocate(8, 4, kv_heads, dim, "fp8_e4m3", dtype, torch.device("cpu"))
    assert not cpu_decode.store(fp8, slots, k, v)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@pytest.mark.parametrize(("kv_heads", "heads", "dim"), [(2, 6, 64), (1, 3, 24), (4, 4, 128)])
def test_the_int8_store_kernel_writes_the_codes_the_cache_writes(
    kv_heads: int, heads: int, dim: int
) -> None:
    """The folded map summed in another order than torch's product: the same codes, but
    for a value that lands within a rounding error of a half step (a code apart at most)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(256, heads, dim, generator=gen)
    keys = torch.randn(256, kv_heads, dim, generator=gen) * 2 + 0.5
    values = torch.randn(256, kv_heads, dim, generator=gen)
    params = Int8Params.fit(q, keys, values)
    stored = LayerKVCache.allocate(
        16, 16, kv_heads, dim, "int8", torch.float32, torch.device("cpu")
    )
    written = LayerKVCache.allocate(
        16, 16, kv_heads, dim, "int8", torch.float32, torch.device("cpu")
    )
    stored.int8 = written.int8 = params
    qkv = torch.randn(200, heads + 2 * kv_heads, dim, generator=gen)  # keys, values are views
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.randperm(256, generator=gen)[:200]
    assert cpu_decode.store(stored, slots, k, v)
    written.write(slots, k, v)
    for got, expected in ((stored.k, written.k), (stored.v, written.v)):
        apart = (got.int() - expected.int()).abs()
        assert apart.max() <= 1 and (apart > 0).float().mean() < 1e-3
        assert (got[:, slots] != 0).any()  # written where asked
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[slots] = False
    assert not stored.k[:, untouched].any() and not stored.v[:, untouched].any()
    with pytest.raises(IndexError, match="outside the cache's 256 slots"):
        cpu_decode.store(stored, torch.tensor([256]), k[:1], v[:1])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot build")
@pytest.mark.parametrize(("kv_heads", "heads", "dim"), [(3, 9, 64), (1, 3, 24), (4, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_query_and_output_maps_turn_as_the_cache_does(
    kv_heads: int, heads: int, dim: int, dtype: torch.dtype
) -> None:
    """An INT8 layer's query turned to score the stored integers, and the attention output
    turned back, by the C kernel: torch's batched product within float32 rounding, and each
    row the same whether it is mapped alone or among 300 (split between threads). A head
    size that is not a multiple of 16 (24) takes torch's product."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(256, heads, dim, generator=gen)
    keys = torch.randn(256, kv_heads, dim, generator=gen) * 2 + 0.5
    params = Int8Params.fit(q, keys, torch.randn(256, kv_heads, dim, generator=gen))
    cache = LayerKVCache.allocate(4, 16, kv_heads, dim, "int8", dtype, torch.device("cpu"))
    cache.int8 = params
    qkv = torch.randn(300, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    x = qkv[:, :heads]  # a view whose rows are not contiguous, as the projection's
    for name, got, expected in (
        ("query", cpu_decode.query(cache, x), cache.query(x)),
        ("output", cpu_decode.output(cache, x.float()), cache.output(x.float())),
    ):
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert got.is_contiguous()
        # float32 sums in another order; a BF16 output may round the other way (one ulp)
        bf16 = name == "output" and dtype == torch.bfloat16
        tolerance = {"rtol": 2**-7, "atol": 1e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-4}
        torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    assert (cpu_decode._head_map(cache, x, "query") is not None) == (dim % 16 == 0)
    if dim % 16 == 0:
        alone = torch.cat([cpu_decode.query(cache, x[i : i + 1]) for i in (0, 150, 299)])
        assert torch.equal(alone, cpu_decode.query(cache, x)[[0, 150, 299]])
    plain = LayerKVCache.allocate(4, 16, kv_heads, dim, "auto", dtype, torch.device("cpu"))
    assert cpu_decode.query(plain, x) is x  # not INT8: the query as it is
