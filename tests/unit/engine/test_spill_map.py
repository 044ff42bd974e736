"""The spill file read in place on CPU (``SpillMap``): a piece's window holds the bytes
written, mapping it in makes its pages resident in the process and mapping it out gives
them back (counted by the kernel, ``/proc/self/smaps``), neighbours untouched; the same
without ``MADV_POPULATE_READ`` (kernels before 5.14)."""

from __future__ import annotations

import mmap

import pytest
import torch

from brook_engine.offload.tiers import MAP_ALIGN, SpillFile, SpillMap

MIB = 1 << 20


@pytest.fixture
def spill() -> SpillFile:
    file = SpillFile()
    generator = torch.Generator().manual_seed(0)
    for key, size in ((0, 3 * MIB + 5), (1, 2 * MIB), (2, 17)):  # odd sizes: unaligned ends
        file.put(key, torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator))
    return file


def _written(spill: SpillFile, key: int) -> torch.Tensor:
    out = torch.empty(spill.offsets[key][1], dtype=torch.uint8)
    spill.read_into(key, out)
    return out


@pytest.mark.parametrize("populate", [True, False])
def test_pieces_map_in_and_out_within_their_pages(spill: SpillFile, populate: bool) -> None:
    mapped = SpillMap(spill, reserve=0)
    mapped.populates = populate
    try:
        assert mapped.resident_bytes() == 0  # nothing read yet
        for key in (0, 1, 2):
            assert spill.offsets[key][0] % mmap.PAGESIZE == 0
            assert torch.equal(mapped.window(key), _written(spill, key))
        for key in (0, 1, 2):
            mapped.drop(key)
        assert mapped.resident_bytes() == 0
        mapped.populate(0)
        held = mapped.resident_bytes()
        assert 3 * MIB < held <= 3 * MIB + mmap.PAGESIZE  # its pages, not its neighbour's
        mapped.populate(1)
        assert mapped.resident_bytes() == held + 2 * MIB
        mapped.drop(0)
        assert mapped.resident_bytes() == 2 * MIB
        assert torch.equal(mapped.window(0), _written(spill, 0))  # read again after a drop
    finally:
        mapped.close()
        spill.close()


def test_pieces_written_later_are_read_through_the_same_map(spill: SpillFile) -> None:
    """The adaptive policy moves pieces out after the map is made: a new one is written
    after the others, one moved out again over its earlier bytes; both inside the reserve,
    which is aligned so that no fault-around reaches past a piece."""
    mapped = SpillMap(spill, reserve=16 * MIB)
    try:
        assert mapped.base % MAP_ALIGN == 0 and mapped.length >= 16 * MIB
        again = torch.full((2 * MIB,), 7, dtype=torch.uint8)
        spill.put(1, again)
        new = torch.full((MIB + 3,), 9, dtype=torch.uint8)
        spill.put(3, new)
        assert torch.equal(mapped.window(1), again)
        assert torch.equal(mapped.window(3), new)
        for key in (1, 3):
            mapped.drop(key)
        mapped.populate(3)
        assert MIB < mapped.resident_bytes() <= MIB + mmap.PAGESIZE
    finally:
        mapped.close()
        spill.close()
