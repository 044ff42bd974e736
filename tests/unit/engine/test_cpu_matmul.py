"""Brook's float32 product over its packed layout (``layers/cpu_matmul.py``): every path this
CPU runs against a float64 reference, a row's result independent of its batch, the layout's
round trip, and the weights the loader packs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brook_engine.layers import cpu_kernels, cpu_matmul, linear

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="Brook's CPU kernels do not build here"
)

PATHS = ("avx512", "avx2", "c")


def _paths() -> Iterator[str]:
    """The paths this CPU runs (each forced with BROOK_CPU_ISA), named as the variable."""
    for name in PATHS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("BROOK_CPU_ISA", name)
            if cpu_matmul.isa() == cpu_kernels.ISA_LEVELS[name]:
                yield name


RUNNABLE = list(_paths())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("out", "inn"), [(32, 1), (64, 7), (96, 48), (160, 577)])
def test_every_path_matches_float64_at_every_row_count(
    path: str, out: int, inn: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path not in RUNNABLE:
        pytest.skip(f"this CPU has no {path} path")
    monkeypatch.setenv("BROOK_CPU_ISA", path)
    gen = torch.Generator().manual_seed(out + inn)
    weight = torch.randn(out, inn, generator=gen)
    bias = torch.randn(out, generator=gen)
    packed = cpu_matmul.pack(weight)
    # 1-13 cover every block size of each path; 17, 100 and 200 split into blocks and chunks.
    for rows in (*range(1, 14), 16, 17, 100, 200):
        x = torch.randn(rows, inn, generator=gen)
        for b in (None, bias):
            got = cpu_matmul.matmul(x, packed, b)
            expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
            assert got.dtype == torch.float32 and got.shape == (rows, out)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * inn**0.5)


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_result_does_not_depend_on_its_batch(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One multiply-add chain per output in input order: a row alone, in a decode batch (up
    to 48 rows, whose blocks take the inputs in parts) and in a prefill chunk gives the same
    bits."""
    if path not in RUNNABLE:
        pytest.skip(f"this CPU has no {path} path")
    monkeypatch.setenv("BROOK_CPU_ISA", path)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(128, 200, generator=gen)
    packed = cpu_matmul.pack(weight)
    batch = torch.randn(150, 200, generator=gen)
    whole = cpu_matmul.matmul(batch, packed, None)
    threads = torch.get_num_threads()
    try:  # another split of the pairs between threads: the same sums
        torch.set_num_threads(1)
        assert torch.equal(cpu_matmul.matmul(batch, packed, None), whole)
        torch.set_num_threads(3)
        assert torch.equal(cpu_matmul.matmul(batch, packed, None), whole)
    finally:
        torch.set_num_threads(threads)
    for row in (0, 5, 11, 12, 13, 95, 96, 149):
        assert torch.equal(
            cpu_matmul.matmul(batch[row : row + 1], packed, None), whole[row : row + 1]
        )
        assert torch.equal(cpu_matmul.matmul(batch[row : row + 7], packed, None)[0], whole[row])
        # 30 rows: several blocks over each part of the inputs in turn (sums carried over)
        assert torch.equal(cpu_matmul.matmul(batch[row : row + 30], packed, None)[0], whole[row])


def test_the_layout_round_trips_and_what_it_takes() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 40, generator=gen)
    packed = cpu_matmul.pack(weight)
    assert packed.shape == (3, 40, 32) and cpu_matmul.is_packed(packed)
    assert torch.equal(packed[1, 5], weight[32:64, 5])  # pair 1 holds channels 32-63 by input
    assert torch.equal(cpu_matmul.unpack(packed), weight)
    assert torch.equal(linear.dense(packed), weight)
    assert cpu_matmul.packs(weight)
    assert not cpu_matmul.packs(torch.randn(100, 40))  # not a multiple of 32: oneDNN's
    assert not cpu_matmul.packs(weight.bfloat16())  # BF16: oneDNN's where native
    assert not cpu_matmul.packs(torch.randn(0, 40))
    with pytest.raises(ValueError, match=r"\[96, 40\] weight"):
        cpu_matmul.matmul(torch.randn(2, 41), packed, None)


def test_leading_dimensions_and_other_input_types() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 24, generator=gen)
    packed = cpu_matmul.pack(weight)
    x = torch.randn(2, 3, 24, generator=gen)
    torch.testing.assert_close(cpu_matmul.matmul(x, packed, None), F.linear(x, weight))
    half = x.bfloat16()
    got = cpu_matmul.matmul(half, packed, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(half.float(), weight).bfloat16())


def test_the_loader_packs_float32_weights_in_brooks_layout_and_others_for_onednn() -> None:
    gen = torch.Generator().manual_seed(4)
    model = nn.Module()
    model.proj = linear.Linear(48, 96, bias=True)  # a multiple of 32: Brook's layout
    model.odd = linear.Linear(48, 80, bias=False)  # not one: oneDNN's, where built in
    model.head = linear.Linear(48, 128, bias=False)
    model.embed = nn.Embedding(128, 48)
    model.head.weight = model.embed.weight  # tied: the table stays plain, the head a copy
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    plain = {name: linear.dense(m.weight).detach().clone() for name, m in model.named_children()}
    x = torch.randn(5, 48, generator=gen)
    added = linear.pack_cpu_weights(model)
    assert cpu_matmul.is_packed(model.proj.weight) and model.proj.packed is None
    assert model.odd.weight.is_mkldnn == bool(torch.backends.mkldnn.is_available())
    assert model.head.weight is model.embed.weight and model.head.packed is not None
    assert cpu_matmul.is_packed(model.head.packed)
    assert added == 128 * 48 * 4  # only the tied copy costs memory
    with torch.no_grad():
        for name in ("proj", "odd", "head"):
            module = getattr(model, name)
            expected = F.linear(x, plain[name], module.bias)
            torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(module(x[:1]), expected[:1], rtol=1e-5, atol=1e-5)
            assert torch.equal(linear.dense(getattr(model, name).weight), plain[name])
