"""Request traces: ``arrival_s,input_tokens,output_tokens`` rows in a ``.csv`` or ``.csv.gz``
file, read strictly (a bad row is an error that names its line and column), written
deterministically (a gzip stream with no timestamp and no file name)."""

from __future__ import annotations

import gzip
import io
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from brook_operator.autoscaler.simulate.simulation_error import SimulationError

HEADER = ("arrival_s", "input_tokens", "output_tokens")
#: The traces shipped with Brook, by name (``diurnal`` is ``traces/diurnal.csv.gz``).
TRACES_DIR = Path(__file__).resolve().parent.parent / "traces"
SUFFIXES = (".csv.gz", ".csv")


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int


def shipped_traces() -> list[str]:
    return sorted(p.name.removesuffix(".csv.gz") for p in TRACES_DIR.glob("*.csv.gz"))


def resolve_trace(name_or_path: str) -> Path:
    """A path as given when it exists, else the shipped trace of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = TRACES_DIR / f"{name_or_path}.csv.gz"
    if shipped.is_file():
        return shipped
    raise SimulationError(
        f"trace {name_or_path!r}: no such file and no shipped trace of that name "
        f"(shipped: {', '.join(shipped_traces())})"
    )


def _field(text: str, source: str, line: int, column: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise SimulationError(
            f"{source}: line {line}, column {column}: {text!r} is not "
            f"{'an integer' if kind is int else 'a number'}"
        ) from None
    if not math.isfinite(value) or value < (0 if column == "arrival_s" else 1):
        least = "0" if column == "arrival_s" else "1"
        raise SimulationError(f"{source}: line {line}, column {column}: {text!r} is below {least}")
    return value


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[Request]:
    """Requests of a trace, in arrival order (arrivals must not go back in time)."""
    requests: list[Request] = []
    last = 0.0
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if number == 1:
            if tuple(c.strip() for c in line.split(",")) != HEADER:
                raise SimulationError(
                    f"{source}: line 1: header {line!r}, expected {','.join(HEADER)}"
                )
            continue
        if not line:
            continue
        cells = line.split(",")
        if len(cells) != len(HEADER):
            raise SimulationError(
                f"{source}: line {number}: {len(cells)} column(s), expected {len(HEADER)} "
                f"({','.join(HEADER)})"
            )
        arrival = _field(cells[0].strip(), source, number, HEADER[0], float)
        if arrival < last:
            raise SimulationError(
                f"{source}: line {number}, column arrival_s: {arrival} is before the previous "
                f"row's {last}; sort the trace by arrival"
            )
        last = arrival
        requests.append(
            Request(
                arrival,
                int(_field(cells[1].strip(), source, number, HEADER[1], int)),
                int(_field(cells[2].strip(), source, number, HEADER[2], int)),
            )
        )
    if not requests:
        raise SimulationError(f"{source}: no requests (a header and at least one row are needed)")
    return requests


def read_trace(path: Path) -> list[Request]:
    if not path.name.endswith(SUFFIXES):
        raise SimulationError(f"{path}: a trace is a .csv or .csv.gz file")
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
                return parse_trace(f, str(path))
        with path.open(encoding="utf-8", newline="") as f:
            return parse_trace(f, str(path))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise SimulationError(f"{path}: unreadable trace: {exc}") from None


def trace_text(requests: Sequence[Request]) -> str:
    rows = [",".join(HEADER)]
    rows.extend(f"{r.arrival_s:.3f},{r.input_tokens},{r.output_tokens}" for r in requests)
    return "\n".join(rows) + "\n"


def write_trace(requests: Sequence[Request], path: Path) -> None:
    """The same requests always give the same bytes (no timestamp or name in the header)."""
    data = trace_text(requests).encode()
    if not path.name.endswith(".gz"):
        path.write_bytes(data)
        return
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(data)
    path.write_bytes(buffer.getvalue())


def scale_rate(requests: Sequence[Request], factor: float, seed: int = 0) -> list[Request]:
    """The trace at ``factor`` times its arrival rate, same shape over time: each request
    stands for ``factor`` requests on average (copies arrive within a second of it)."""
    if factor <= 0 or not math.isfinite(factor):
        raise SimulationError(f"rate scale {factor}: use a positive number")
    if factor == 1:
        return list(requests)
    rng = random.Random(seed)
    whole, fraction = int(factor), factor - int(factor)
    out: list[Request] = []
    for r in requests:
        copies = whole + (rng.random() < fraction)
        for i in range(copies):
            shift = 0.0 if i == 0 else rng.random()
            out.append(Request(r.arrival_s + shift, r.input_tokens, r.output_tokens))
    out.sort(key=lambda r: r.arrival_s)
    return out
