"""The ring of device slots streamed pieces run from, filled ahead of compute.

Each streamed kind (attention, ffn) has ``prefetchLayers + 1`` slots; its streamed pieces,
in execution order, take slots round-robin (piece ``k`` always slot ``k mod S``, so a
piece's tensors stay bound to the same memory). When a layer is done, each of its pieces
hands its slot to the next piece that uses it (``k + S``, or at the end of the stage the
next step's first), so while layer ``i`` computes, the next ``S - 1`` streamed pieces of
each kind are on their way.

A copy thread does the filling. On CPU a piece of the spill file is not copied: its tensors
are views of the file mapped in place, filling maps its pages in and the next piece to take
its slot maps them out again (``SpillMap``); a piece of a host pool is copied into the slot.
On NPU and CUDA it issues the host-to-device copy on a side stream
(waiting there for the slot's last reader) and the compute stream waits on the copy's
event, so the host never blocks on a transfer that is on time. ``before_layer`` waits only
for a piece that is not there yet: that wait is the transfer time compute did not hide.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from brook_engine.offload.tiers import HostPool, SpillFile, SpillMap

log = logging.getLogger(__name__)


@dataclass
class StreamStats:
    """Transfer counters since start (seconds are the copy thread's and the waits')."""

    transfers: int = 0
    bytes: int = 0
    transfer_seconds: float = 0.0
    exposed_seconds: float = 0.0
    out_of_turn: int = 0  # pieces a layer had to ask for itself (no prefetch had)

    @property
    def hidden_ratio(self) -> float:
        """Share of transfer time compute hid (1 with nothing streamed)."""
        if self.transfer_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_seconds / self.transfer_seconds)


@dataclass
class _Fill:
    ring: int
    slot: int
    position: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    ready: Any = None  # accelerators: the copy's event on the side stream
    started: Any = None


class Ring:
    """One kind's slots and the streamed pieces (keys into the tiers) they take in turn.

    ``windows[k]`` is piece ``k``'s own mapped bytes where it is read in place (CPU, spill
    file), else None and the piece is copied into its slot; a slot no piece is copied into
    has no buffer (None), only its share of the budget."""

    def __init__(
        self,
        slots: list[torch.Tensor | None],
        keys: list[int],
        windows: list[torch.Tensor | None] | None = None,
    ) -> None:
        self.slots = slots
        self.keys = keys
        self.windows = windows or [None] * len(keys)

    def slot_of(self, position: int) -> int:
        return position % len(self.slots)

    def next_after(self, position: int) -> int:
        """The piece that uses this piece's slot next (wrapping to the next step's)."""
        later = position + len(self.slots)
        return later if later < len(self.keys) else position % len(self.slots)


class WeightStreamer:
    """Fills the rings' slots ahead of the layers that read them."""

    def __init__(
        self,
        device: torch.device,
        rings: list[Ring],
        layer_pieces: dict[int, list[tuple[int, int]]],  # local layer → (ring, position)
        host: HostPool,
        spill: SpillFile | None,
        staging: list[list[torch.Tensor]] | None = None,  # accelerators: pinned, per slot
        mapped: SpillMap | None = None,  # CPU: the spill file read in place
    ) -> None:
        self.device = device
        self.rings = rings
        self.layer_pieces = layer_pieces
        self.host, self.spill, self.mapped = host, spill, mapped
        self._mapped_in: dict[tuple[int, int], int] = {}  # (ring, slot) → key mapped in
        self.staging = staging
        self.stats = StreamStats()
        self._lock = threading.Lock()
        self._state: dict[tuple[int, int], _Fill] = {}
        self._queue: queue.SimpleQueue[_Fill | None] = queue.SimpleQueue()
        self._accel = device.type != "cpu"
        self._staged: dict[tuple[int, int], Any] = {}
        self._timed: list[_Fill] = []
        self._waits: list[tuple[Any, Any]] = []
        if self._accel:
            module = getattr(torch, device.type)
            self._module = module
            self._side = module.Stream(device)
            self._free = {
                (r, s): module.Event()
                for r, ring in enumerate(rings)
                for s in range(len(ring.slots))
            }
        self._thread = threading.Thread(target=self._run, name="brook-weight-stream", daemon=True)
        self._thread.start()
        for r, ring in enumerate(rings):  # the first step's pieces
            for position in range(min(len(ring.slots), len(ring.keys))):
                self._submit(r, position)

    # -- the compute side ------------------------------------------------------------------

    def before_layer(self, layer: int) -> None:
        """Wait until every streamed piece of local ``layer`` is in its slot."""
        for r, position in self.layer_pieces.get(layer, ()):
            ring = self.rings[r]
            slot = ring.slot_of(position)
            fill = self._state.get((r, slot))
            if fill is None or fill.position != position:
                fill = self._submit(r, position)  # out of turn (a step that ended early)
                self.stats.out_of_turn += 1
            if not fill.done.is_set():
                started = time.perf_counter()
                fill.done.wait()
                if not self._accel:  # on accelerators the device's wait is what counts
                    self.stats.exposed_seconds += time.perf_counter() - started
            if fill.error is not None:
                self._state.pop((r, slot), None)  # the next step asks for it again
                raise RuntimeError(f"streaming a weight piece failed: {fill.error}") from fill.error
            if self._accel and fill.ready is not None:
                stream = self._module.current_stream(self.device)
                asked = self._module.Event(enable_timing=True)
                asked.record(stream)
                stream.wait_event(fill.ready)  # the device waits, not the host
                self._waits.append((asked, fill.ready))
                if len(self._waits) > 4096:  # read the events that completed (bounded lists)
                    self.snapshot()

    def after_layer(self, layer: int) -> None:
        """Layer ``layer`` is done with its slots: start filling them with their next pieces."""
        for r, position in self.layer_pieces.get(layer, ()):
            ring = self.rings[r]
            if self._accel:
                self._free[(r, ring.slot_of(position))].record(
                    self._module.current_stream(self.device)
                )
            following = ring.next_after(position)
            if following != position:
                self._submit(r, following)

    @contextlib.contextmanager
    def holding(self, layer: int) -> Iterator[None]:
        """Layer ``layer``'s pieces in place for work outside the forward pass (the KV
        calibration projects keys again after its prefill)."""
        self.before_layer(layer)
        try:
            yield
        finally:
            self.after_layer(layer)

    def mapped_in(self) -> list[int]:
        """The keys of the spill file's pieces mapped in once the fills queued are done
        (CPU; the pages the process holds of the file)."""
        for fill in list(self._state.values()):
            fill.done.wait()
        return list(self._mapped_in.values())

    def reset_stats(self) -> None:
        """Start the counters again (after start-up's calibration and warm-up)."""
        self.stats = StreamStats()

    # -- the copy thread -------------------------------------------------------------------

    def _submit(self, r: int, position: int) -> _Fill:
        fill = _Fill(r, self.rings[r].slot_of(position), position)
        self._state[(r, fill.slot)] = fill
        self._queue.put(fill)
        return fill

    def _run(self) -> None:
        while True:
            fill = self._queue.get()
            if fill is None:
                return
            started = time.perf_counter()
            try:
                nbytes = self._fill(fill)
            except BaseException as exc:  # reported to the layer that waits for it
                fill.error = exc
                nbytes = 0
            if not self._accel:  # accelerators: timed by the copy's events
                self.stats.transfer_seconds += time.perf_counter() - started
            self.stats.transfers += 1
            self.stats.bytes += nbytes
            fill.done.set()

    def _fill(self, fill: _Fill) -> int:
        ring = self.rings[fill.ring]
        key = ring.keys[fill.position]
        slot = ring.slots[fill.slot]
        source = self.host.buffers.get(key)
        if not self._accel:
            earlier = self._mapped_in.pop((fill.ring, fill.slot), None)
            if earlier is not None and earlier != key:
                assert self.mapped is not None
                self.mapped.drop(earlier)  # the slot's last piece: its layer is done
            window = ring.windows[fill.position]
            if window is not None:
                assert self.mapped is not None
                self.mapped.populate(key)
                self._mapped_in[(fill.ring, fill.slot)] = key
                return window.numel()
            assert slot is not None
            if source is not None:
                slot.copy_(source)
            else:
                assert self.spill is not None
                self.spill.read_into(key, slot)
            return slot.numel()
        assert slot is not None
        if source is None:  # disk → pinned staging → device
            assert self.spill is not None and self.staging is not None
            source = self.staging[fill.ring][fill.slot]
            previous = self._staged.get((fill.ring, fill.slot))
            if previous is not None:
                previous.synchronize()  # the staging buffer's last copy has left it
            self.spill.read_into(key, source)
        module = self._module
        with module.stream(self._side):
            self._side.wait_event(self._free[(fill.ring, fill.slot)])
            fill.started = module.Event(enable_timing=True)
            fill.ready = module.Event(enable_timing=True)
            fill.started.record(self._side)
            slot.copy_(source, non_blocking=True)
            fill.ready.record(self._side)
        self._staged[(fill.ring, fill.slot)] = fill.ready
        with self._lock:
            self._timed.append(fill)
        return slot.numel()

    def snapshot(self) -> StreamStats:
        """The counters now (on accelerators, with the copies and waits that have completed
        read from their events)."""
        if self._accel:
            with self._lock:
                pending = []
                for fill in self._timed:
                    if fill.ready.query():
                        self.stats.transfer_seconds += fill.started.elapsed_time(fill.ready) / 1e3
                    else:
                        pending.append(fill)
                self._timed = pending
            waits = []
            for asked, ready in self._waits:
                if asked.query() and ready.query():
                    self.stats.exposed_seconds += max(0.0, asked.elapsed_time(ready)) / 1e3
                else:
                    waits.append((asked, ready))
            self._waits = waits
        return StreamStats(**vars(self.stats))

    def close(self) -> None:
        """Stop the copy thread once the fills queued so far are done (the tiers belong to
        the offload state, which outlives a streamer when it lays the rings out again)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        if self._accel:
            self._side.synchronize()  # the copies issued have landed before slots change
        if self.mapped is not None:  # the next layout maps its own pieces in
            for key in self._mapped_in.values():
                self.mapped.drop(key)
            self._mapped_in.clear()
        self.snapshot()
