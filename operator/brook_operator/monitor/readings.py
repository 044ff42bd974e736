"""One engine's ``/metrics`` at one moment, parsed with prometheus_client's own parser and
read by the names the engine exports (``brook_engine.metrics.names``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from brook_engine.metrics import names

Labels = frozenset[tuple[str, str]]


class ReadingError(Exception):
    """A body that is not Prometheus text, or not a Brook engine's."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (``+Inf`` last), as exported."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier`` (all of them after a restart: a bucket
        that went down, as PromQL's ``increase`` judges each series)."""
        if earlier is None:
            return self
        before = dict(earlier.buckets)
        if any(n < before.get(le, 0.0) for le, n in self.buckets):
            return self
        return Histogram(tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets))

    def plus(self, other: Histogram) -> Histogram:
        if not self.buckets:
            return other
        theirs = dict(other.buckets)
        return Histogram(tuple((le, n + theirs.get(le, 0.0)) for le, n in self.buckets))

    def quantile(self, q: float) -> float | None:
        """As PromQL's ``histogram_quantile``: linear within the bucket holding the rank;
        the largest finite bound when the rank falls in ``+Inf``; None without observations."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return lower
                if n == below:
                    return le
                return lower + (le - lower) * (rank - below) / (n - below)
            lower, below = le, n
        return lower


@dataclass(frozen=True)
class Reading:
    """Every sample of one scrape, by name and labels."""

    samples: Mapping[tuple[str, Labels], float] = field(default_factory=dict)
    time: float | None = None
    """When the engine was scraped, where the source says (Prometheus); else the frame's."""

    @classmethod
    def parse(cls, text: str) -> Reading:
        samples: dict[tuple[str, Labels], float] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        except ValueError as exc:
            raise ReadingError(f"not Prometheus text: {exc}") from None
        reading = cls(samples)
        if reading.value(names.KV_CACHE_USAGE_RATIO) is None:
            raise ReadingError(f"no {names.KV_CACHE_USAGE_RATIO} (is this a Brook engine?)")
        return reading

    @classmethod
    def from_series(
        cls, series: Iterable[tuple[Mapping[str, str], float]], time: float | None = None
    ) -> Reading:
        """From labelled values (a Prometheus query's answer: ``__name__`` among the labels)
        scraped at ``time``."""
        samples: dict[tuple[str, Labels], float] = {}
        for labels, value in series:
            rest = frozenset((k, v) for k, v in labels.items() if k != "__name__")
            samples[(labels["__name__"], rest)] = value
        return cls(samples, time)

    def value(self, name: str, **labels: str) -> float | None:
        """The sample ``name`` whose labels include ``labels`` (the first, when several);
        None when absent or not finite."""
        wanted = set(labels.items())
        for (sample, have), value in self.samples.items():
            if sample == name and wanted <= have and math.isfinite(value):
                return value
        return None

    def total(self, name: str) -> float | None:
        """The sum of every series of ``name`` (a counter split by a label)."""
        values = [v for (s, _), v in self.samples.items() if s == name and math.isfinite(v)]
        return sum(values) if values else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s series keyed by the value of ``label``."""
        found: dict[str, float] = {}
        for (sample, have), value in self.samples.items():
            if sample == name:
                key = dict(have).get(label)
                if key is not None and math.isfinite(value):
                    found[key] = value
        return found

    def histogram(self, name: str) -> Histogram | None:
        buckets = {}
        for le, value in self.by_label(f"{name}_bucket", "le").items():
            try:
                buckets[float(le)] = value  # "+Inf" reads as infinity
            except ValueError:
                return None  # not a histogram as Prometheus writes them
        if not buckets:
            return None
        return Histogram(tuple(sorted(buckets.items())))

    def labels(self, name: str) -> dict[str, str]:
        """The labels of the first series of ``name`` (an info gauge's)."""
        for sample, have in self.samples:
            if sample == name:
                return dict(have)
        return {}
