"""``brook monitor [NAME] [--dashboard]``: which resources, from which source, shown how."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from kubernetes.config import ConfigException

from brook_operator.kube import KubeClient, KubeError
from brook_operator.monitor import table
from brook_operator.monitor.figures import Figures, Frame, History
from brook_operator.monitor.sources import (
    READ_TIMEOUT_SECONDS,
    ClusterSource,
    LocalSource,
    MonitorError,
    PrometheusSource,
    Source,
    list_resources,
    local_sources,
)

OK, NOT_FOUND, USAGE = 0, 1, 2


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    monitor = sub.add_parser(
        "monitor",
        help="live figures of LLMInference resources: a table, or a full-screen dashboard",
        description="Figures come from each resource's status and its engine pods' /metrics "
        "(through the API server's pod proxy, or --prometheus), or from the servers `brook up` "
        "runs here (--local). Exit codes: 0 shown (or Ctrl-C), 1 nothing to watch, 2 usage "
        "or API error. Examples: brook monitor -n prod; brook monitor qwen-7b --dashboard; "
        "brook monitor --local --dashboard. See docs/monitoring.md.",
    )
    monitor.add_argument(
        "name",
        nargs="?",
        help="the LLMInference (default: every one in the namespace; --dashboard needs one "
        "unless there is only one); with --local, the manifest's name",
    )
    scope = monitor.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", default="default", help="namespace (default: default)")
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="every namespace (table only)"
    )
    monitor.add_argument(
        "--dashboard", action="store_true", help="a full-screen dashboard of one resource"
    )
    monitor.add_argument(
        "-w", "--watch", action="store_true", help="print the table again every --interval"
    )
    monitor.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between refreshes (default 2)",
    )
    monitor.add_argument(
        "--window",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="seconds the latency quantiles and hit rate cover once watched that long "
        "(default 300; before that: since the engines started)",
    )
    source = monitor.add_mutually_exclusive_group()
    source.add_argument(
        "--prometheus",
        metavar="URL",
        help="read the engines' metrics from this Prometheus (e.g. http://prometheus:9090) "
        "instead of the pod proxy",
    )
    source.add_argument(
        "--local", action="store_true", help="watch the servers `brook up` runs on this machine"
    )
    monitor.add_argument("--kubeconfig", help="kubeconfig (default: KUBECONFIG or ~/.kube/config)")
    monitor.add_argument(
        "--frames",
        type=int,
        help="with --dashboard: stop after this many refreshes, drawn inline (not full screen)",
    )
    monitor.add_argument(
        "--screenshot", metavar="FILE.svg", help="with --frames: write the last one as SVG"
    )
    monitor.set_defaults(func=main)


def _sources(args: argparse.Namespace) -> list[Source]:
    if args.local:
        return list(local_sources([args.name] if args.name else ()))
    # One try, briefly: the next refresh is the retry, and a dead pod must not stall a frame.
    kube = KubeClient.from_environment(args.kubeconfig, timeout_seconds=READ_TIMEOUT_SECONDS)
    kube.attempts = 1
    if args.name:
        targets = [(args.namespace, args.name)]
    else:
        namespace = None if args.all_namespaces else args.namespace
        objs = list_resources(kube, namespace)
        targets = [
            (o["metadata"].get("namespace") or args.namespace, o["metadata"]["name"]) for o in objs
        ]
        if not targets:
            where = "any namespace" if namespace is None else f"namespace {namespace}"
            raise MonitorError(f"no LLMInference in {where}")
    if args.prometheus:
        return [PrometheusSource(kube, ns, name, args.prometheus) for ns, name in targets]
    return [ClusterSource(kube, ns, name) for ns, name in targets]


def _label(source: Source) -> str:
    return f"{source.namespace}/{source.name}" if source.namespace else source.name


def _check(args: argparse.Namespace) -> str | None:
    if args.interval <= 0 or args.window <= 0:
        return "--interval and --window: give a positive number of seconds"
    if args.frames is not None and (not args.dashboard or args.frames < 1):
        return "--frames: give a positive count, with --dashboard"
    if args.screenshot and args.frames is None:
        return "--screenshot: give --frames N too (the screenshot is the last refresh)"
    if args.dashboard and (args.all_namespaces or args.watch):
        return "--dashboard shows one resource and refreshes itself: drop -A / --watch"
    if args.name and args.all_namespaces:
        return "NAME with -A: name its namespace with -n instead"
    return None


def main(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return USAGE
    try:
        sources = _sources(args)
        if args.dashboard:
            return _dashboard(args, sources)
        return _table(args, sources)
    except MonitorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return NOT_FOUND
    except KubeError as exc:
        print(f"error: the API server: {exc}", file=sys.stderr)
        return USAGE
    except ConfigException as exc:  # no kubeconfig, no in-cluster credentials
        print(f"error: no cluster to watch ({exc}); give --kubeconfig, or --local", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        return OK


def _dashboard(args: argparse.Namespace, sources: Sequence[Source]) -> int:
    from rich.console import Console

    from brook_operator.monitor import dashboard  # Rich: loaded only for the dashboard

    if len(sources) != 1:
        listed = ", ".join(_label(s) for s in sources)
        raise MonitorError(f"--dashboard shows one resource; name one of: {listed}")
    source = sources[0]
    origin = (
        source.server.url
        if isinstance(source, LocalSource)
        else f"Prometheus {args.prometheus}"
        if args.prometheus
        else "pod proxy"
    )
    dashboard.run(
        _label(source),
        source.read,
        History(window_seconds=args.window),
        origin,
        args.interval,
        Console(),
        frames=args.frames,
        screenshot=args.screenshot,
    )
    return OK


def _table(
    args: argparse.Namespace,
    sources: Sequence[Source],
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    histories = [History(window_seconds=args.window) for _ in sources]
    last: list[tuple[Frame, Figures] | None] = [None] * len(sources)

    def refresh() -> list[str]:
        problems = []
        for i, source in enumerate(sources):
            try:
                frame = source.read()
            except MonitorError as exc:
                problems.append(str(exc))
                continue
            last[i] = (frame, histories[i].add(frame))
        return problems

    problems = refresh()  # the rates need two reads
    if len(problems) == len(sources):
        raise MonitorError("; ".join(problems))
    while True:
        sleep(args.interval)
        for problem in refresh():
            print(f"error: {problem}", file=sys.stderr)
        rows = []
        for source, seen in zip(sources, last, strict=True):
            frame, figures = seen if seen is not None else (None, None)
            rows.append(table.row(source.name, frame.resource if frame else None, figures))
        namespaces = [s.namespace or "-" for s in sources] if args.all_namespaces else None
        sys.stdout.write(table.render(rows, namespaces))
        sys.stdout.flush()
        if not args.watch:
            return OK
        sys.stdout.write("\n")
