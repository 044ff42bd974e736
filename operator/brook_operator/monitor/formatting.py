"""Figures as short text: the table's cells and the dashboard's labels."""

from __future__ import annotations

from collections.abc import Iterable

NONE = "-"
_BARS = "▁▂▃▄▅▆▇█"


def seconds(value: float | None) -> str:
    if value is None:
        return NONE
    if value < 1:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}s"


def percent(value: float | None) -> str:
    return NONE if value is None else f"{value * 100:.0f}%"


def number(value: float | None, unit: str = "") -> str:
    if value is None:
        return NONE
    text = f"{value:.0f}" if value >= 100 or value == int(value) else f"{value:.1f}"
    return text + unit


def size(value: float | None) -> str:
    if value is None:
        return NONE
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def pair(first: str, second: str) -> str:
    return NONE if first == second == NONE else f"{first}/{second}"


def sparkline(
    values: Iterable[float | None], width: int, floor: float = 0.0, top: float | None = None
) -> str:
    """The last ``width`` values as block characters from ``floor`` to ``top`` (default:
    their maximum); a gap where a value is unknown."""
    points = list(values)[-width:]
    known = [v for v in points if v is not None]
    if top is None:
        top = max(known, default=0.0)
    span = top - floor
    chars = []
    for v in points:
        if v is None:
            chars.append(" ")
        elif span <= 0:
            chars.append(_BARS[0])
        else:
            index = round((v - floor) / span * (len(_BARS) - 1))
            chars.append(_BARS[max(0, min(len(_BARS) - 1, index))])
    return "".join(chars).rjust(width)
