"""Where streamed pieces live between uses: the host pool (a buffer per piece, pinned where
the device copies from it asynchronously) and the spill file (pieces written once at load).

On NPU and CUDA the pool is pinned host memory and the file is the tier behind it, read on
demand with ``preadv`` into pinned staging buffers. On CPU the host is the device's own
memory, so there the file is the tier, and it is not copied at all: it is mapped
(``SpillMap``), each streamed piece's tensors are views of its own pages, fetching a piece
maps its pages in (``MADV_POPULATE_READ``: from the page cache, no copy; from the disk when
the page cache does not hold them) and a piece its layer is done with is unmapped again
(``MADV_DONTNEED``), so the process holds no more of the file than the ring's slots."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile

import torch

from brook_engine.offload.plan import aligned

log = logging.getLogger(__name__)

#: Pieces start at multiples of this in the spill file: direct-I/O friendly, and the
#: kernel's fault-around window (64 KiB by default), so mapping a piece's last page in maps
#: no page of the next piece.
FILE_ALIGN = 65536
#: The mapping's start is a multiple of this (2 MiB: a huge page, where the kernel maps the
#: page cache's large folios whole).
MAP_ALIGN = 2 << 20
#: ``madvise``'s MADV_POPULATE_READ (Linux 5.14+; Python's mmap module does not name it).
MADV_POPULATE_READ = 22


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
            offset = aligned(self.size, FILE_ALIGN)
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


class SpillMap:
    """The spill file mapped (private, so nothing is ever written back to it): a window per
    piece, and its pages mapped in before use and out after.

    Mapping pages from the page cache is a page-table update, not a copy: 36 MiB took
    0.03-0.14 ms here where ``preadv`` into a slot took 3.9 ms of a core
    (docs/offload.md), and a core is what a copy takes from the products on CPU.

    One mapping serves the state's lifetime: ``reserve`` bytes (every piece the rank could
    stream), more than the file holds yet, so pieces the adaptive policy moves out later
    are inside it. Its start is aligned to ``MAP_ALIGN`` (a multiple of the pieces'
    ``FILE_ALIGN`` in the file), so the kernel's fault-around (aligned in addresses) never
    maps a page of the next piece. ``mmap`` and ``madvise`` are libc's through ctypes,
    which lets go of the GIL: a piece read from the disk must not stall the compute
    thread."""

    def __init__(self, spill: SpillFile, reserve: int) -> None:
        self.offsets = spill.offsets  # live: pieces moved out later are written after
        self.map_fd = spill.fd
        self.length = aligned(max(reserve, spill.size, 1), MAP_ALIGN)
        self.base = _map_aligned(spill.fd, self.length)
        self.populates = True

    def window(self, key: int) -> torch.Tensor:
        """Piece ``key``'s bytes, in place (uint8; views bound to it read the file)."""
        offset, nbytes = self.offsets[key]
        if offset + nbytes > self.length:
            raise RuntimeError(f"spill file piece at {offset} is past the mapping's reserve")
        raw = (ctypes.c_char * nbytes).from_address(self.base + offset)
        return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes)

    def populate(self, key: int) -> None:
        """Map piece ``key``'s pages in (reading them from disk if the page cache has not)."""
        offset, nbytes = self.offsets[key]
        if nbytes == 0:
            return
        if self.populates:
            try:
                _madvise(self.base + offset, nbytes, MADV_POPULATE_READ)
                return
            except OSError as exc:  # a kernel before 5.14: touch a byte of every page
                self.populates = False
                log.info("weight offload: MADV_POPULATE_READ unavailable (%s); touching pages", exc)
        _madvise(self.base + offset, nbytes, mmap.MADV_WILLNEED)
        int(self.window(key)[:: mmap.PAGESIZE].sum())

    def drop(self, key: int) -> None:
        """Unmap piece ``key``'s pages (the page cache may keep them; the process does not)."""
        offset, nbytes = self.offsets[key]
        if nbytes:
            _madvise(self.base + offset, nbytes, mmap.MADV_DONTNEED)  # to the page's end

    def close(self) -> None:
        """Unmap the file; no tensor may point into it any more (pieces are parked first)."""
        if self.base:
            _libc.munmap(self.base, self.length)
            self.base = 0

    def resident_bytes(self) -> int:
        """Bytes of the mapping mapped in now (the Rss ``/proc/self/smaps`` gives its
        areas); -1 where that file cannot be read."""
        start, end = self.base, self.base + self.length
        total, inside = 0, False
        try:
            with open("/proc/self/smaps") as smaps:
                for line in smaps:
                    head = line.split(maxsplit=1)[0]
                    if not head.endswith(":"):  # an area's first line: "low-high perms ..."
                        low, high = (int(x, 16) for x in head.split("-"))
                        inside = start <= low and high <= end
                    elif inside and head == "Rss:":
                        total += int(line.split()[1]) * 1024
        except OSError:
            return -1
        return total


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000


def _map_aligned(fd: int, length: int) -> int:
    """``fd`` mapped private and writable (copy on write) at an address that is a multiple
    of ``MAP_ALIGN``: an anonymous reservation ``MAP_ALIGN`` larger, the file mapped over
    its aligned part, the slack either side given back."""
    span = length + MAP_ALIGN
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    got_reserve = _libc.mmap(None, span, _PROT_NONE, flags, -1, 0)
    if got_reserve in (None, _MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"reserving {span} bytes of addresses: {os.strerror(errno)}")
    reserved = int(got_reserve)
    start = aligned(reserved, MAP_ALIGN)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _libc.mmap(start, length, prot, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
    if got != start:
        errno = ctypes.get_errno()
        _libc.munmap(reserved, span)
        raise OSError(errno, f"mapping the spill file: {os.strerror(errno)}")
    if start > reserved:
        _libc.munmap(reserved, start - reserved)
    tail = reserved + span - (start + length)
    if tail:
        _libc.munmap(start + length, tail)
    return start


def _madvise(address: int, length: int, advice: int) -> None:
    """``madvise`` without the GIL; OSError on failure."""
    if _libc.madvise(address, length, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
