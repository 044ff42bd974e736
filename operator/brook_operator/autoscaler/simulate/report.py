"""What a run scores: SLO attainment, TTFT percentiles, replica-hours, scale events and
reversals; as a dict (for ``--json``), a table, and a two-panel PNG."""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from brook_operator.autoscaler.simulate.run import RunResult
from brook_operator.autoscaler.simulate.simulation_error import SimulationError


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (as ``brook-engine bench`` reports them)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def reversals(events: Sequence[tuple[float, int, int]], window_seconds: float) -> int:
    """Scale events opposite in direction to the previous one, and less than
    ``window_seconds`` after it: the fleet changed its mind."""
    count = 0
    for (t0, before0, after0), (t1, before1, after1) in itertools.pairwise(events):
        if (after0 > before0) != (after1 > before1) and t1 - t0 < window_seconds:
            count += 1
    return count


DAY_SECONDS = 86_400.0


def parse_window(text: str) -> tuple[float, float]:
    """``HH:MM-HH:MM`` → seconds after midnight (the trace's time 0 is a midnight);
    ``ValueError`` naming the form otherwise."""
    try:
        start, end = (
            int(h) * 3600.0 + int(m) * 60.0
            for h, m in (part.strip().split(":") for part in text.split("-"))
        )
    except ValueError:
        raise ValueError(f"window {text!r}: use HH:MM-HH:MM, e.g. 08:50-09:30") from None
    if not 0 <= start < end <= DAY_SECONDS:
        raise ValueError(f"window {text!r}: the start must come before the end, within a day")
    return start, end


def window_scores(
    result: RunResult, slo_seconds: float, window: tuple[float, float]
) -> list[dict[str, Any]]:
    """SLO attainment and P99 TTFT of the requests arriving in ``window`` (time of day),
    one entry per day of the trace that has such requests."""
    days = int(max(result.arrivals) // DAY_SECONDS) + 1
    out = []
    for day in range(days):
        start, end = day * DAY_SECONDS + window[0], day * DAY_SECONDS + window[1]
        ttft = [t for a, t in zip(result.arrivals, result.ttft, strict=True) if start <= a < end]
        if not ttft:
            continue
        served = [t for t in ttft if not math.isnan(t)]
        out.append(
            {
                "day": day + 1,
                "requests": len(ttft),
                "slo_attainment": round(sum(1 for t in served if t <= slo_seconds) / len(ttft), 4),
                "ttft_p99_s": _rounded(percentile(served, 99)),
            }
        )
    return out


def summary(
    result: RunResult,
    slo_seconds: float,
    static_peak_hours: float | None,
    reversal_window_seconds: float,
    window: tuple[float, float] | None = None,
) -> dict[str, Any]:
    served = [t for t in result.ttft if not math.isnan(t)]
    requests = len(result.ttft)
    hours = result.replica_seconds / 3600
    windowed = {"window": window_scores(result, slo_seconds, window)} if window else {}
    changed_mind = reversals(result.scale_events, reversal_window_seconds)
    return {
        **windowed,
        "slo_attainment": round(sum(1 for t in served if t <= slo_seconds) / requests, 4),
        "ttft_p50_s": _rounded(percentile(served, 50)),
        "ttft_p99_s": _rounded(percentile(served, 99)),
        "replica_hours": round(hours, 3),
        "replica_hours_vs_static_peak": (
            round(hours / static_peak_hours, 3) if static_peak_hours else None
        ),
        "mean_replicas": round(result.replica_seconds / result.duration_s, 2),
        "max_replicas": max(n for _, n in result.timeline),
        "scale_events": len(result.scale_events),
        "reversals": changed_mind,
        "reversals_per_hour": round(changed_mind / (result.duration_s / 3600), 2),
        "requests": requests,
        "completed": result.completed,
        "preemptions": result.preemptions,
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


_COLUMNS = (
    ("policy", "{}", 18),
    ("slo_attainment", "{:.4f}", 8),
    ("ttft_p50_s", "{:.2f}", 7),
    ("ttft_p99_s", "{:.2f}", 7),
    ("replica_hours", "{:.2f}", 8),
    ("replica_hours_vs_static_peak", "{:.2f}", 8),
    ("replica_hours_vs_clairvoyant", "{:.2f}", 9),
    ("mean_replicas", "{:.2f}", 7),
    ("max_replicas", "{}", 5),
    ("scale_events", "{}", 6),
    ("reversals", "{}", 5),
    ("reversals_per_hour", "{:.2f}", 6),
    ("preemptions", "{}", 6),
)
_HEADERS = {
    "slo_attainment": "SLO met",
    "ttft_p50_s": "p50 s",
    "ttft_p99_s": "p99 s",
    "replica_hours": "rep·h",
    "replica_hours_vs_static_peak": "vs peak",
    "replica_hours_vs_clairvoyant": "vs clairv",
    "mean_replicas": "mean",
    "max_replicas": "max",
    "scale_events": "scales",
    "reversals": "revs",
    "reversals_per_hour": "revs/h",
    "preemptions": "preempt",
}


def table(policies: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per policy, aligned."""
    header = "  ".join(
        f"{_HEADERS.get(name, name):<{width}}"
        if name == "policy"
        else f"{_HEADERS.get(name, name):>{width}}"
        for name, _, width in _COLUMNS
    )
    lines = [header, "-" * len(header)]
    for policy, row in policies.items():
        cells = []
        for name, fmt, width in _COLUMNS:
            value = policy if name == "policy" else row.get(name)
            text = "-" if value is None else fmt.format(value)
            cells.append(f"{text:<{width}}" if name == "policy" else f"{text:>{width}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def ttft_p99_per_minute(result: RunResult) -> list[tuple[float, float]]:
    """(minute, p99 TTFT of the requests that arrived in it), for minutes with requests."""
    minutes: dict[int, list[float]] = {}
    for arrival, ttft in zip(result.arrivals, result.ttft, strict=True):
        if not math.isnan(ttft):
            minutes.setdefault(int(arrival // 60), []).append(ttft)
    return [(m, percentile(v, 99) or 0.0) for m, v in sorted(minutes.items())]


def plot(results: Mapping[str, RunResult], slo_seconds: float, title: str, path: Path) -> None:
    """Replicas over time (top) and per-minute p99 TTFT with the SLO line (bottom)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulationError("--plot needs matplotlib: pip install 'brook[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, result in results.items():
        times = [t / 60 for t, _ in result.timeline] + [result.duration_s / 60]
        counts = [n for _, n in result.timeline] + [result.timeline[-1][1]]
        top.step(times, counts, where="post", label=name)
        per_minute = ttft_p99_per_minute(result)
        bottom.plot([m + 0.5 for m, _ in per_minute], [v for _, v in per_minute], label=name)
    bottom.axhline(slo_seconds, color="black", linestyle="--", linewidth=1, label="TTFT SLO")
    top.set_ylabel("replicas")
    top.set_title(title)
    top.legend(loc="upper left", fontsize="small")
    bottom.set_ylabel("TTFT p99 per minute (s)")
    bottom.set_xlabel("minutes")
    bottom.set_yscale("log")
    bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise SimulationError(f"{path}: cannot write the plot: {exc}") from None
    finally:
        plt.close(fig)


def write_decisions(results: Mapping[str, RunResult], path: Path) -> None:
    """Every decision of every autoscaled run: policy, time, current, desired, why."""
    try:
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["policy", "time_s", "current", "desired", "limited_by", "reason"])
            for name, result in results.items():
                for now, current, desired, limited_by, reason in result.decisions:
                    writer.writerow([name, f"{now:g}", current, desired, limited_by or "", reason])
    except OSError as exc:
        raise SimulationError(f"{path}: cannot write decisions: {exc}") from None
