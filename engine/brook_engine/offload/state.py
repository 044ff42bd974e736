"""A rank's offload at run time: every piece of its layers, which of them stream, the tiers
their bytes live in, the slots of the rings, and the ledger. The static policy builds it
once at load; the adaptive policy moves pieces between resident and streamed between steps
(``evict`` / ``restore``), after which the rings are laid out again.

A streamed piece's bytes are written to the host pool or the spill file once and read back
on every use (on CPU the spill file is read in place, mapped); a resident piece owns its
tensors (on CPU, float weights packed)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from brook_engine.layers.linear import pack_cpu_weights
from brook_engine.offload.ledger import WeightLedger
from brook_engine.offload.payload import Handle, bind, layout, pack, point
from brook_engine.offload.plan import PIECE_KINDS, PieceKind, RankPlan, aligned, size_text
from brook_engine.offload.streamer import Ring, WeightStreamer
from brook_engine.offload.tiers import FILE_ALIGN, HostPool, SpillFile, SpillMap

log = logging.getLogger(__name__)

PART = {"attention": "self_attn", "ffn": "mlp"}
Key = tuple[int, PieceKind]  # (global layer, kind)


@dataclass
class Piece:
    layer: int  # global index
    kind: PieceKind
    module: nn.Module
    handles: list[Handle] = field(default_factory=list)  # set while it streams


class OffloadState:
    """One rank's pieces, tiers, slots and ledger; ``holder.streamer`` is kept current."""

    def __init__(
        self,
        plan: RankPlan,
        layers: nn.ModuleList,
        device: torch.device,
        ledger: WeightLedger,
        holder: Any,
        pool_limit: int | None,
        prefetch: int,
    ) -> None:
        self.plan = plan
        self.device = device
        self.ledger = ledger
        self.holder = holder  # the model: its ``streamer`` attribute is set here
        self.start = plan.layers[0]
        self.prefetch = prefetch
        self.piece_bytes: dict[str, int] = dict(plan.piece_bytes)
        self.pieces: dict[Key, Piece] = {
            (i, k): Piece(i, k, layers[i - self.start].get_submodule(PART[k]))
            for i in range(*plan.layers)
            for k in PIECE_KINDS
        }
        self.streamed: list[Key] = []  # in execution order after ``_sort``
        self.pool_limit = pool_limit  # bytes; None: no limit
        self.host = HostPool(pinned=device.type != "cpu")
        self.spill: SpillFile | None = None
        self.mapped: SpillMap | None = None  # CPU: the spill file mapped, for good
        self._unmappable = False
        self.slots: dict[str, list[torch.Tensor | None]] = {k: [] for k in PIECE_KINDS}
        self.changes = 0
        self._threads_before: int | None = None  # compute threads before one was given up

    # -- where a streamed piece's bytes live -----------------------------------------------

    def _store(self, piece: Piece, key: int) -> None:
        """Pack ``piece``'s current tensors into the pool (room permitting) or the spill file
        under ``key`` and remember their layout."""
        handles, size = layout(piece.module)
        if size != self.piece_bytes[piece.kind]:
            raise RuntimeError(
                f"layer {piece.layer}'s {piece.kind} holds {size} bytes where the memory plan "
                f"counted {self.piece_bytes[piece.kind]} (a bug: the plan and the loader "
                "disagree)"
            )
        staging = 0  # accelerators read disk through pinned staging slots, in the pool too
        if self.device.type != "cpu":
            staging = sum((self.prefetch + 1) * n for n in self.piece_bytes.values())
        room = self.pool_limit is None or self.host.nbytes + size + staging <= self.pool_limit
        buffer = self.host.new_buffer(size) if room else torch.empty(size, dtype=torch.uint8)
        pack(piece.module, handles, buffer)
        if room:
            self.host.put(key, buffer)
        else:
            if self.spill is None:
                self.spill = SpillFile()
            self.spill.put(key, buffer)
        piece.handles = handles
        for sub in piece.module.modules():
            sub.__dict__["streamed"] = True  # packing and one-row copies leave it alone

    @staticmethod
    def key_of(piece: Key) -> int:
        layer, kind = piece
        return 2 * layer + PIECE_KINDS.index(kind)

    def load_streamed(self, load_piece: Callable[[nn.Module, str], None], progress: bool) -> None:
        """At load: read each planned streamed piece on its own and store it."""
        bar = tqdm(
            self.plan.streamed, desc="Offloading weights", unit="piece", disable=not progress
        )
        for layer, kind in bar:
            piece = self.pieces[(layer, kind)]
            load_piece(piece.module, f"model.layers.{layer - self.start}.{PART[kind]}")
            self._store(piece, self.key_of((layer, kind)))
            self.streamed.append((layer, kind))
            self._park(piece)

    def _park(self, piece: Piece) -> None:
        """Point a freshly stored piece at an empty placeholder until its slot is bound, so
        its host copy is freed (it is not in device memory)."""
        for h in piece.handles:
            point(h, torch.empty(0, dtype=h.dtype, device=self.device))

    # -- the rings -------------------------------------------------------------------------

    def build_streamer(self) -> WeightStreamer | None:
        """Lay the rings out for the current streamed pieces (slots charged or released to
        match) and start a streamer over them; ``holder.streamer`` is set to it."""
        old = getattr(self.holder, "streamer", None)
        if isinstance(old, WeightStreamer):
            old.close()  # every copy it issued has landed
        self._forget_row_plans()  # they hold the tensors of the old layout
        self.streamed.sort()
        by_kind: dict[str, list[Key]] = {
            k: [p for p in self.streamed if p[1] == k] for k in PIECE_KINDS
        }
        if self.mapped is None and self.device.type == "cpu" and self.spill is not None:
            self._map_spill(self.spill)
        windows: dict[str, list[torch.Tensor | None]] = {}
        for kind in PIECE_KINDS:
            windows[kind] = [self._window(k) for k in by_kind[kind]]
            copied = any(w is None for w in windows[kind])
            want = min(self.prefetch + 1, len(by_kind[kind]))
            have = self.slots[kind]
            size = self.piece_bytes[kind]
            while len(have) > want:
                have.pop()
                self.ledger.release(size, "slots")
            while len(have) < want:  # charged whether a buffer or mapped pages fill it
                self.ledger.charge(size, "slots", f"{kind} slot {len(have)}")
                have.append(None)
            for i, buffer in enumerate(have):  # a buffer only where pieces are copied in
                if copied and buffer is None:
                    have[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
                elif not copied:
                    have[i] = None
        rings: list[Ring] = []
        ring_kinds: list[str] = []
        layer_pieces: dict[int, list[tuple[int, int]]] = {}
        for kind in PIECE_KINDS:
            keys = by_kind[kind]
            if not keys:
                continue
            ring_index = len(rings)
            ring_kinds.append(kind)
            slots = self.slots[kind]
            for position, key in enumerate(keys):
                window = windows[kind][position]
                slot = slots[position % len(slots)]
                target = window if window is not None else slot
                assert target is not None
                bind(self.pieces[key].handles, target)
                layer_pieces.setdefault(key[0] - self.start, []).append((ring_index, position))
            rings.append(Ring(slots, [self.key_of(k) for k in keys], windows[kind]))
        streamer = None
        if rings:
            staging = None
            if self.device.type != "cpu" and self.spill is not None:
                staging = [
                    [
                        torch.empty(self.piece_bytes[k], dtype=torch.uint8, pin_memory=True)
                        for _ in ring.slots
                    ]
                    for ring, k in zip(rings, ring_kinds, strict=True)
                ]
            streamer = WeightStreamer(
                self.device, rings, layer_pieces, self.host, self.spill, staging, self.mapped
            )
            if isinstance(old, WeightStreamer):
                streamer.stats = old.stats  # the counters run on across layouts
        self.holder.streamer = streamer
        copies = any(w is None for ws in windows.values() for w in ws)
        self._share_cores(streamer is not None and copies)
        return streamer

    def _forget_row_plans(self) -> None:
        """Drop the one-row kernel's per-layer plans (they keep the tensors they point at)."""
        forget = getattr(getattr(self.holder, "row_decoding", None), "forget", None)
        if forget is not None:
            forget()

    def _map_spill(self, spill: SpillFile) -> None:
        """Map the spill file to read pieces in place; where its folder's filesystem cannot
        be mapped, pieces are copied into slots instead (said once)."""
        if self._unmappable:
            return
        try:
            self.mapped = SpillMap(spill, self._spill_reserve())
        except OSError as exc:
            self._unmappable = True
            log.warning(
                "weight offload: the spill file in %s cannot be mapped (%s); streamed pieces "
                "are copied instead, on a core of their own (set BROOK_OFFLOAD_DIR to a local "
                "filesystem to read them in place)",
                spill.folder,
                exc,
            )

    def _spill_reserve(self) -> int:
        """The most the spill file can hold: every piece of the rank (a piece moved out
        again is written over its earlier bytes)."""
        return sum(aligned(self.piece_bytes[k], FILE_ALIGN) for _, k in self.pieces)

    def _window(self, key: Key) -> torch.Tensor | None:
        """A streamed piece's bytes read in place (CPU, spill file), else None (copied)."""
        stored = self.key_of(key)
        if self.mapped is None or stored in self.host.buffers:
            return None
        return self.mapped.window(stored)

    def _share_cores(self, streaming: bool) -> None:
        """On CPU, leave one core to the copy thread while pieces are copied (from a host
        pool; the spill file is mapped, not copied): a copy on a core that an OpenMP thread
        of the products also runs on stalls every parallel region (measured: a 1 GiB model
        at 42% resident, 28.0 tok/s with both cores computing and 51.9 with one —
        docs/offload.md)."""
        if self.device.type != "cpu":
            return
        if streaming and self._threads_before is None:
            threads = torch.get_num_threads()
            if threads > 1:
                self._threads_before = threads
                torch.set_num_threads(threads - 1)
                log.info(
                    "weight offload: %d compute threads, one core left to the copy thread",
                    threads - 1,
                )
        elif not streaming and self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    # -- moving pieces (the adaptive policy) -----------------------------------------------

    def evict_many(self, keys: list[Key]) -> None:
        """Make resident pieces stream, then lay the rings out (slots charged last: the
        pieces' bytes are released first, so the ledger never passes the budget)."""
        for key in keys:
            self.evict(key)
        self.build_streamer()

    def restore_many(self, keys: list[Key]) -> None:
        """Make streamed pieces resident: the rings laid out without them first (slots
        released), then each piece charged and read back."""
        for key in keys:
            self.streamed.remove(key)
        self.build_streamer()
        for key in keys:
            self.restore(key)

    def evict(self, key: Key) -> int:
        """Make a resident piece stream (``build_streamer`` then binds it to a slot);
        returns the device bytes freed."""
        piece = self.pieces[key]
        for sub in piece.module.modules():  # oneDNN's opaque layout back to the plain one
            weight = sub._parameters.get("weight")
            if weight is not None and weight.is_mkldnn:
                plain = weight.to_dense().contiguous()
                sub._parameters["weight"] = nn.Parameter(plain, requires_grad=False)
        if self.device.type == "cpu":
            pack_cpu_weights(piece.module, streamable_only=True)  # streams in Brook's layout
        self._store(piece, self.key_of(key))
        self._park(piece)
        self.ledger.release(self.piece_bytes[piece.kind], "resident")
        self.streamed.append(key)
        self.changes += 1
        return self.piece_bytes[piece.kind]

    def restore(self, key: Key) -> int:
        """Give a piece taken out of ``streamed`` its own tensors again (repacked for the
        CPU's products); returns the device bytes it takes."""
        piece = self.pieces[key]
        size = self.piece_bytes[piece.kind]
        self.ledger.charge(size, "resident", f"layer {piece.layer}'s {piece.kind}")
        flat = torch.empty(size, dtype=torch.uint8)
        stored = self.key_of(key)
        source = self.host.buffers.pop(stored, None)
        if source is not None:
            flat.copy_(source)
        else:
            assert self.spill is not None
            self.spill.read_into(stored, flat)
        for h in piece.handles:
            own = flat[h.offset : h.offset + h.nbytes].view(h.dtype).view(h.shape)
            point(h, own.to(self.device, copy=True))
        piece.handles = []
        for sub in piece.module.modules():
            sub.__dict__.pop("streamed", None)
        if self.device.type == "cpu":
            pack_cpu_weights(piece.module)
        self.changes += 1
        return size

    def describe(self) -> str:
        return (
            f"{len(self.streamed)} of {len(self.pieces)} pieces streamed, weights on device "
            f"{size_text(self.ledger.held)}"
        )

    def close(self) -> None:
        streamer = getattr(self.holder, "streamer", None)
        if isinstance(streamer, WeightStreamer):
            streamer.close()
        if self.mapped is not None:
            for key in self.streamed:  # nothing points into the mapping once it is gone
                self._park(self.pieces[key])
            self._forget_row_plans()
            self.holder.streamer = None
            self.mapped.close()
        if self.spill is not None:
            self.spill.close()
        self._share_cores(False)
