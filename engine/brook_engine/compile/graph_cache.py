"""The bounded kernel cache: compiled layer graphs by token bucket, the least recently used
dropped beyond ``shapes.kernelCacheSize``, with the counts ``/metrics`` reports."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from brook_engine.compile.layer_graph import LayerGraph


@dataclass(frozen=True)
class CompileStats:
    """Running totals of the kernel cache (one rank's)."""

    graphs: int = 0  # held now
    hits: int = 0  # steps that ran a compiled graph
    misses: int = 0  # steps that ran eager: their bucket not compiled (yet), or failed
    evictions: int = 0
    compiles: int = 0
    failures: int = 0  # buckets whose compilation failed (they run eager)
    compile_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        steps = self.hits + self.misses
        return self.hits / steps if steps else 0.0


class GraphCache:
    """Compiled graphs by bucket, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a kernel cache holds at least one graph, not {capacity}")
        self.capacity = capacity
        self._graphs: OrderedDict[int, LayerGraph] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, bucket: int) -> bool:
        return bucket in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def buckets(self) -> list[int]:
        """Held buckets, least recently used first."""
        return list(self._graphs)

    def get(self, bucket: int) -> LayerGraph | None:
        """The graph of ``bucket`` (now the most recently used), counted as a hit or a miss."""
        graph = self._graphs.get(bucket)
        if graph is None:
            self.misses += 1
            return None
        self.hits += 1
        self._graphs.move_to_end(bucket)
        return graph

    def put(self, bucket: int, graph: LayerGraph) -> list[int]:
        """Hold ``graph`` for ``bucket``; returns the buckets dropped to stay in bounds."""
        self._graphs[bucket] = graph
        self._graphs.move_to_end(bucket)
        dropped = []
        while len(self._graphs) > self.capacity:
            old, _ = self._graphs.popitem(last=False)
            dropped.append(old)
            self.evictions += 1
        return dropped

    def drop(self, bucket: int) -> None:
        self._graphs.pop(bucket, None)
