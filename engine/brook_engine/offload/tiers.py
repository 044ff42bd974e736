"""Where streamed pieces live between uses: the host pool (a buffer per piece, pinned where
the device copies from it asynchronously) and the spill file (pieces written once at load,
read on demand with ``preadv`` straight into the slot or a staging buffer: no memory map, so
the file's pages never count against the process).

On CPU the host pool is the device's own memory, so there a model larger than the budget
streams from the spill file; on NPU and CUDA the pool is pinned host memory and the file is
the tier behind it for hosts whose memory cannot hold the model either."""

from __future__ import annotations

import ctypes
import os
import tempfile

import torch

#: Pieces start at multiples of this in the spill file (direct-I/O friendly).
FILE_ALIGN = 4096


def writable(buffer: torch.Tensor) -> memoryview:
    """A writable view of a CPU tensor's bytes (contiguous uint8) for ``os.preadv``."""
    raw = (ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())
    return memoryview(raw).cast("B")


class HostPool:
    """Streamed pieces in host memory, one buffer each."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: dict[int, torch.Tensor] = {}

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def put(self, key: int, data: torch.Tensor) -> None:
        self.buffers[key] = data

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


class SpillFile:
    """Streamed pieces in one file, unlinked as soon as it is opened (nothing is left behind,
    even after a crash). ``BROOK_OFFLOAD_DIR`` picks the folder (default: the system's
    temporary folder)."""

    def __init__(self, folder: str | None = None) -> None:
        folder = folder or os.environ.get("BROOK_OFFLOAD_DIR") or tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="brook-offload-", suffix=".bin", dir=folder)
        os.unlink(path)
        self.fd = fd
        self.folder = folder
        self.offsets: dict[int, tuple[int, int]] = {}
        self.size = 0

    def put(self, key: int, data: torch.Tensor) -> None:
        """Write a piece's bytes (a CPU uint8 tensor): over its earlier bytes when the key was
        written before with the same size (a piece the adaptive policy moves out again),
        else at the end."""
        earlier = self.offsets.get(key)
        if earlier is not None and earlier[1] == data.numel():
            offset = earlier[0]
        else:
            offset = -(-self.size // FILE_ALIGN) * FILE_ALIGN
        view = memoryview(bytes(0)) if data.numel() == 0 else writable(data)
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], offset + written)
        self.offsets[key] = (offset, data.numel())
        self.size = max(self.size, offset + data.numel())

    def read_into(self, key: int, out: torch.Tensor) -> None:
        """Read a piece into ``out`` (a CPU uint8 tensor of its size)."""
        offset, nbytes = self.offsets[key]
        view = writable(out)[:nbytes]
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"spill file ended early reading {nbytes} bytes at {offset}")
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
