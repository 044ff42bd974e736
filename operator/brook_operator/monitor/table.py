"""``brook monitor`` without ``--dashboard``: one line per resource, as ``kubectl get``
prints them, with live figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from brook_operator.deploy import replica_counts
from brook_operator.monitor import formatting as fmt
from brook_operator.monitor.figures import Figures

COLUMNS = (
    "NAME",
    "READY",
    "KV",
    "WAITING",
    "RUNNING",
    "TOKENS/S",
    "TTFT P50/P99",
    "TPOT P50/P99",
    "PREFIX HIT",
    "OVERLAP",
)


def ready_cell(resource: Mapping[str, Any] | None, figures: Figures | None) -> str:
    """``ready/desired`` from the status; a local server counts as one replica."""
    if resource is None:
        return f"{figures.replicas_reporting if figures else 0}/1"
    ready, desired = replica_counts(resource)
    return f"{ready}/{desired}"


def row(name: str, resource: Mapping[str, Any] | None, figures: Figures | None) -> list[str]:
    if figures is None or not figures.replicas_reporting:
        return [name, ready_cell(resource, figures), *([fmt.NONE] * (len(COLUMNS) - 2))]
    return [
        name,
        ready_cell(resource, figures),
        fmt.percent(figures.kv_cache_usage),
        fmt.number(figures.waiting),
        fmt.number(figures.running),
        fmt.number(figures.generation_tokens_per_s),
        fmt.pair(fmt.seconds(figures.ttft_p50), fmt.seconds(figures.ttft_p99)),
        fmt.pair(fmt.seconds(figures.tpot_p50), fmt.seconds(figures.tpot_p99)),
        fmt.percent(figures.prefix_hit_rate),
        fmt.percent(figures.overlap),
    ]


def render(rows: Sequence[Sequence[str]], namespaces: Sequence[str] | None = None) -> str:
    """Left-aligned columns three spaces apart; a NAMESPACE column first when given."""
    header = list(COLUMNS)
    body = [list(r) for r in rows]
    if namespaces is not None:
        header.insert(0, "NAMESPACE")
        body = [[ns, *r] for ns, r in zip(namespaces, body, strict=True)]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *body]
    ]
    return "\n".join(lines) + "\n"
