"""``brook monitor --dashboard``: one full-screen view of an ``LLMInference`` — replicas
and the autoscaler's last decisions with their reasons, throughput, TTFT and TPOT as
charts over the last minutes, KV-cache usage and per-layer precision, prefix-cache hit rate,
queue and communication overlap, offload and compile-cache figures, each replica — drawn
with Rich and refreshed in place."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from brook_engine.metrics import names
from brook_operator.deploy import replica_counts
from brook_operator.monitor import formatting as fmt
from brook_operator.monitor.figures import Figures, Frame, History
from brook_operator.monitor.sources import MonitorError

LABEL_WIDTH = 11
#: A chart's width in refreshes: what its panel leaves, within these bounds.
MIN_CHART_WIDTH, MAX_CHART_WIDTH = 8, 60
#: The autoscaler's decisions shown, newest first.
DECISIONS_SHOWN = 4
#: Panel titles, in the order they are laid out (tests look for each).
PANELS = (
    "Throughput",
    "Latency",
    "KV cache",
    "Queue and overlap",
    "Autoscaler",
    "Offload and compile",
    "Replicas",
)
#: Each storage dtype's cell in the per-layer precision strip: (prefix, letter, style).
_PRECISION_CELLS = (
    ("fp8", "8", "cyan"),
    ("int8", "i", "magenta"),
    ("float32", "F", "yellow"),
    ("fp32", "F", "yellow"),
    ("", "H", "green"),  # fp16, bf16
)


@dataclass(frozen=True)
class _ChartLine:
    """A label, the series as a sparkline as wide as the panel leaves (scaled to ``top``,
    else to the series' largest value) and the latest value."""

    label: str
    series: Sequence[float | None]
    now: str
    top: float | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = options.max_width - LABEL_WIDTH - len(self.now) - 1
        width = max(MIN_CHART_WIDTH, min(MAX_CHART_WIDTH, room))
        line = Text(f"{self.label:<{LABEL_WIDTH}}", style="bold", no_wrap=True)
        line.append(fmt.sparkline(self.series, width, top=self.top), style="green")
        line.append(f" {self.now}")
        yield line


def _chart_line(
    label: str, series: Sequence[float | None], now: str, top: float | None = None
) -> _ChartLine:
    return _ChartLine(label, series, now, top)


def _panel(title: str, body: RenderableType) -> Panel:
    return Panel(body, title=f"[bold]{title}[/]", title_align="left", border_style="blue")


def _series(history: History, name: str) -> Sequence[float | None]:
    return list(history.series.get(name, ()))


def _header(name: str, frame: Frame, figures: Figures, source: str, problem: str | None) -> Text:
    model = figures.model
    text = Text(name, style="bold")
    if model:
        text.append(
            f"  {model.get('model', '?')} · {model.get('device', '?')} {model.get('dtype', '')}"
            f" · tensor {model.get('tensor_parallel', '?')} × pipeline "
            f"{model.get('pipeline_parallel', '?')}"
        )
    status = (frame.resource or {}).get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if frame.resource is not None:
        count, desired = replica_counts(frame.resource)
        text.append(f"\nreplicas {count}/{desired} ready")
        if ready is not None:
            style = "green" if ready.get("status") == "True" else "yellow"
            text.append(f" · Ready={ready.get('status')}", style=style)
            if ready.get("status") != "True" and ready.get("reason"):
                text.append(f" ({ready.get('reason')}: {ready.get('message', '')})")
    else:
        text.append(f"\na local server · {figures.replicas_reporting}/1 answering")
    stamp = time.strftime("%H:%M:%S", time.localtime(frame.time))
    text.append(f" · {source} · {stamp}", style="dim")
    if problem:
        text.append(f"\nthe last refresh failed (showing {stamp}'s): {problem}", style="red")
    return text


def _local_time(stamp: str) -> str:
    """An RFC 3339 time as this machine's clock time (the header's too)."""
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return stamp
    return when.astimezone().strftime("%H:%M:%S")


def _throughput(history: History, figures: Figures) -> RenderableType:
    return Group(
        _chart_line(
            "generated",
            _series(history, "generation_tokens_per_s"),
            fmt.number(figures.generation_tokens_per_s, " tok/s"),
        ),
        Text(f"{'prompt':<11}{fmt.number(figures.prompt_tokens_per_s, ' tok/s')}"),
        Text(f"{'requests':<11}{fmt.number(figures.requests_per_s, ' /s')}"),
        Text(
            f"{'ended':<11}"
            + " · ".join(
                f"{fmt.number(figures.finished.get(r, 0.0))} {r}" for r in names.FINISH_REASONS
            ),
            style="dim",
            no_wrap=True,
            overflow="ellipsis",
        ),
        Text(f"{'preempted':<11}{fmt.number(figures.preemptions)}", style="dim"),
    )


def _latency(history: History, figures: Figures) -> RenderableType:
    span = (
        f"last {figures.window_seconds / 60:g} min"
        if figures.window_seconds is not None
        else "since the engines started"
    )
    return Group(
        _chart_line("TTFT P50", _series(history, "ttft_p50"), fmt.seconds(figures.ttft_p50)),
        _chart_line("TTFT P99", _series(history, "ttft_p99"), fmt.seconds(figures.ttft_p99)),
        _chart_line("TPOT P50", _series(history, "tpot_p50"), fmt.seconds(figures.tpot_p50)),
        _chart_line("TPOT P99", _series(history, "tpot_p99"), fmt.seconds(figures.tpot_p99)),
        Text(
            f"figures {span}; a chart point: the minute before",
            style="dim",
        ),
    )


def _precision(layers: Sequence[str], model_dtype: str) -> Text:
    """One cell per layer, layer 0 first: 8 FP8, i int8, H 16-bit, F float32 (``auto``
    layers store the model's dtype)."""
    text = Text(f"{'precision':<11}")
    if not layers:
        return text.append(fmt.NONE)
    dtypes = [model_dtype if d == "auto" else d for d in layers]
    for dtype in dtypes:
        _, letter, style = next(c for c in _PRECISION_CELLS if dtype.startswith(c[0]))
        text.append(letter, style=style)
    counts: dict[str, int] = {}
    for dtype in dtypes:
        counts[dtype] = counts.get(dtype, 0) + 1
    text.append("  " + ", ".join(f"{n} {d}" for d, n in counts.items()), style="dim")
    return text


def _kv_cache(history: History, figures: Figures) -> RenderableType:
    return Group(
        _chart_line(
            "usage",
            _series(history, "kv_cache_usage"),
            fmt.percent(figures.kv_cache_usage),
            top=1.0,
        ),
        Text(f"{'prefix hit':<11}{fmt.percent(figures.prefix_hit_rate)} of prompt tokens"),
        Text(f"{'per token':<11}{fmt.size(figures.kv_bytes_per_token)} over all layers"),
        _precision(figures.kv_layer_dtypes, figures.model.get("dtype", "auto")),
    )


def _queue(history: History, figures: Figures) -> RenderableType:
    return Group(
        _chart_line("waiting", _series(history, "waiting"), fmt.number(figures.waiting)),
        _chart_line("running", _series(history, "running"), fmt.number(figures.running)),
        _chart_line("overlap", _series(history, "overlap"), fmt.percent(figures.overlap), top=1.0),
        Text(f"{'bubble':<11}{fmt.percent(figures.pipeline_bubble)} of pipeline step time"),
    )


def _autoscaler(resource: Mapping[str, Any] | None) -> RenderableType:
    if resource is None:
        return Text("a local server: no autoscaler", style="dim")
    autoscaling = (resource.get("status") or {}).get("autoscaling") or {}
    if not (resource.get("spec") or {}).get("autoscaling"):
        replicas = (resource.get("spec") or {}).get("replicas", 1)
        return Text(f"not autoscaled: spec.replicas is {replicas}", style="dim")
    signals = autoscaling.get("signals") or {}
    lines: list[RenderableType] = [
        Text(
            f"signals: KV {fmt.percent(signals.get('kvCacheUsage'))} · overlap "
            f"{fmt.percent(signals.get('overlapRatio'))} · waiting "
            f"{fmt.number(signals.get('waitingRequests'))}/replica · arriving "
            f"{fmt.number(signals.get('demandTokensPerSecond'), ' tok/s')} of "
            f"{fmt.number(signals.get('replicaTokensPerSecond'), ' tok/s')}/replica · "
            f"{signals.get('replicasReporting', 0)} reporting"
        )
    ]
    decisions = autoscaling.get("lastDecisions") or []
    table = Table(box=None, show_header=True, header_style="bold", pad_edge=False, expand=True)
    table.add_column("time", no_wrap=True)
    table.add_column("replicas", no_wrap=True)
    table.add_column("limit", no_wrap=True)
    table.add_column("reason", ratio=1, no_wrap=True, overflow="ellipsis")
    for decision in decisions[-DECISIONS_SHOWN:][::-1]:
        table.add_row(
            _local_time(str(decision.get("time", ""))),
            f"{decision.get('fromReplicas')}→{decision.get('toReplicas')}",
            str(decision.get("limitedBy") or "-"),
            str(decision.get("reason", "")),
        )
    lines.append(table if decisions else Text("no decision yet", style="dim"))
    return Group(*lines)


def _offload_compile(figures: Figures) -> RenderableType:
    offload = figures.offload_bytes
    lines = []
    if offload:
        lines.append(
            Text(
                f"{'offload':<11}resident {fmt.size(offload.get('resident'))} · slots "
                f"{fmt.size(offload.get('slots'))} · streamed {fmt.size(offload.get('streamed'))}"
            )
        )
        lines.append(
            Text(f"{'':<11}{fmt.percent(figures.offload_exposed_ratio)} of streaming not hidden")
        )
    else:
        lines.append(Text(f"{'offload':<11}off"))
    if figures.compiled_graphs or figures.compile_hit_rate is not None:
        lines.append(
            Text(
                f"{'compile':<11}{fmt.number(figures.compiled_graphs)} graphs · hit rate "
                f"{fmt.percent(figures.compile_hit_rate)} · failures "
                f"{fmt.number(figures.compile_failures)}"
            )
        )
    else:
        lines.append(Text(f"{'compile':<11}off"))
    memory = figures.device_memory
    if memory:
        short = {"kv_cache": "KV", "activations": "activ."}
        parts = " · ".join(
            f"{short.get(k, k)} {fmt.size(memory.get(k))}" for k in names.MEMORY_KINDS
        )
        lines.append(Text(f"{'memory':<11}{parts}"))
    cold = figures.cold_start
    if cold:
        lines.append(
            Text(
                f"{'cold start':<11}ready {fmt.seconds(cold.get('ready'))} · first token "
                f"{fmt.seconds(cold.get('first_token'))}"
            )
        )
    return Group(*lines)


def _replicas(frame: Frame) -> RenderableType:
    table = Table(box=None, header_style="bold", pad_edge=False, expand=True)
    for column in ("replica", "KV", "waiting", "running", "generated", "state"):
        table.add_column(column, no_wrap=column != "state")
    for pod, reading in sorted(frame.readings.items()):
        table.add_row(
            pod,
            fmt.percent(reading.value(names.KV_CACHE_USAGE_RATIO)),
            fmt.number(reading.value(names.NUM_REQUESTS_WAITING)),
            fmt.number(reading.value(names.NUM_REQUESTS_RUNNING)),
            fmt.number(reading.value(names.GENERATION_TOKENS_TOTAL), " tok"),
            Text("metrics read", style="green"),
        )
    for pod, error in sorted(frame.errors.items()):
        table.add_row(pod, *([fmt.NONE] * 4), Text(error, style="red"))
    if not frame.readings and not frame.errors:
        table.add_row("no engine pod yet", *([fmt.NONE] * 4), "")
    return table


def render(
    name: str, frame: Frame, history: History, source: str, problem: str | None = None
) -> Layout:
    """The dashboard of ``frame`` (the latest, already added to ``history``); ``problem``:
    why the refresh after it failed."""
    figures = history.latest
    assert figures is not None, "add the frame to the history first"
    quiet: RenderableType | None = None
    if not frame.readings:
        quiet = Text("no replica's figures could be read: see Replicas", style="dim")

    def panel(title: str, body: Callable[[], RenderableType]) -> Layout:
        return Layout(_panel(title, quiet if quiet is not None else body()))

    layout = Layout()
    layout.split_column(
        Layout(
            _panel("brook monitor", _header(name, frame, figures, source, problem)),
            size=5 if problem else 4,
        ),
        Layout(name="row1", size=7),
        Layout(name="row2", size=6),
        Layout(name="row3", size=5 + DECISIONS_SHOWN),
        Layout(_panel("Replicas", _replicas(frame)), name="replicas", minimum_size=4),
    )
    layout["row1"].split_row(
        panel("Throughput", lambda: _throughput(history, figures)),
        panel("Latency", lambda: _latency(history, figures)),
    )
    layout["row2"].split_row(
        panel("KV cache", lambda: _kv_cache(history, figures)),
        panel("Queue and overlap", lambda: _queue(history, figures)),
    )
    layout["row3"].split_row(
        Layout(_panel("Autoscaler", _autoscaler(frame.resource))),
        panel("Offload and compile", lambda: _offload_compile(figures)),
    )
    return layout


def run(
    name: str,
    read: Callable[[], Frame],
    history: History,
    source: str,
    interval: float,
    console: Console,
    frames: int | None = None,
    screenshot: str | None = None,
) -> None:
    """Refresh every ``interval`` seconds until Ctrl-C (or ``frames`` refreshes, after which
    the last is written to ``screenshot`` as SVG when given)."""
    done = 0
    view: RenderableType | None = None
    frame: Frame | None = None
    with Live(console=console, screen=frames is None, auto_refresh=False) as live:
        while frames is None or done < frames:
            started = time.monotonic()
            try:
                frame = read()
                history.add(frame)
                problem = None
            except MonitorError as exc:  # the next refresh retries; the last frame stays
                problem = str(exc)
            if frame is not None:
                view = render(name, frame, history, source, problem)
            else:
                view = _panel("brook monitor", Text(f"{name}: {problem}", style="red"))
            live.update(view, refresh=True)
            done += 1
            if frames is not None and done >= frames:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    if screenshot and view is not None:
        save_svg(view, screenshot, f"brook monitor {name}", console.width, console.height)


def save_svg(view: RenderableType, path: str, title: str, width: int, height: int) -> None:
    """``view`` alone (not the refreshes before it) as an SVG screenshot."""
    recorder = Console(record=True, width=width, height=height, file=io.StringIO())
    recorder.print(view)
    recorder.save_svg(path, title=title)
