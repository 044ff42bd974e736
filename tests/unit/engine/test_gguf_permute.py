"""The GGUF rotary row order: llama.cpp's permutation of q_proj/k_proj and its inverse."""

from __future__ import annotations

import pytest
import torch

from brook_engine.convert import ConvertError, permute_qk, unpermute_qk


@pytest.mark.parametrize(
    ("num_heads", "head_dim", "columns"), [(9, 64, 576), (3, 64, 576), (2, 4, 3)]
)
def test_unpermute_inverts_permute(num_heads: int, head_dim: int, columns: int) -> None:
    weight = torch.randn(num_heads * head_dim, columns, generator=torch.Generator().manual_seed(0))
    permuted = permute_qk(weight, num_heads)
    assert not torch.equal(permuted, weight)  # it really moves rows
    assert torch.equal(unpermute_qk(permuted, num_heads), weight)
    assert torch.equal(permute_qk(unpermute_qk(weight, num_heads), num_heads), weight)


def test_permute_interleaves_each_heads_two_halves() -> None:
    # One head of dim 4 holds rows [a0, a1, b0, b1] (HF halves); GGUF stores [a0, b0, a1, b1].
    rows = torch.arange(8.0).reshape(8, 1)  # two heads
    assert permute_qk(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_qk(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_rows_that_do_not_split_into_heads_are_refused() -> None:
    with pytest.raises(ConvertError, match="do not split into 4 rotary heads"):
        unpermute_qk(torch.zeros(6, 2), 4)
