"""``brook``: the operator side's command line."""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
from collections.abc import Sequence

from brook_engine.config import ConfigError
from brook_operator import __version__, yaml_output
from brook_operator.api import LLMInference, topology
from brook_operator.crd.generate import crd_yaml
from brook_operator.crd.reference import reference_markdown
from brook_operator.crd.validate import validate_object
from brook_operator.manifests import Manifest, ManifestError, load_manifests
from brook_operator.model_configs import DEFAULT_ENDPOINT as DEFAULT_HUB_ENDPOINT
from brook_operator.model_configs import ModelConfigs, check_endpoint
from brook_operator.render import OperatorSettings, render_children


def _settings(args: argparse.Namespace) -> OperatorSettings:
    """``--engine-image`` for every accelerator, ``--engine-image-for TYPE=IMAGE`` for one."""
    images = dict(OperatorSettings().engine_images)
    for item in args.engine_image_for or []:
        kind, _, image = item.partition("=")
        if kind not in images or not image:
            raise ManifestError(
                f"--engine-image-for {item!r}: give TYPE=IMAGE with TYPE one of {', '.join(images)}"
            )
        images[kind] = image
    return OperatorSettings(engine_image=args.engine_image or None, engine_images=images)


def _cmd_crd(args: argparse.Namespace) -> int:
    sys.stdout.write(reference_markdown() if args.reference else crd_yaml())
    return 0


def _validated(manifests: list[Manifest]) -> tuple[list[Manifest], int]:
    """The valid manifests, and the number of problems printed for the others."""
    valid: list[Manifest] = []
    count = 0
    for manifest in manifests:
        problems = validate_object(manifest.obj)
        for problem in problems:
            print(f"{manifest.source}: {manifest.label}: {problem}", file=sys.stderr)
        count += len(problems)
        if not problems:
            valid.append(manifest)
    return valid, count


def _cmd_validate(args: argparse.Namespace) -> int:
    manifests = load_manifests(args.filename)  # ManifestError: main reports it
    valid, count = _validated(manifests)
    if args.model_config:
        valid, planned = _planned(valid, args.model_config, args.device_memory_gb)
        count += planned
    for manifest in valid:
        print(f"{manifest.source}: {manifest.label}: valid")
    if count:
        print(f"{count} problem(s) in {len(manifests) - len(valid)} object(s)", file=sys.stderr)
    return 1 if count else 0


def _planned(
    manifests: list[Manifest], model_config: str, device_memory_gb: float | None
) -> tuple[list[Manifest], int]:
    """The manifests whose memory plan fits, each plan printed; problems counted."""
    from pathlib import Path

    from brook_engine.offload.command import read_config_file
    from brook_operator.memory_plan import fitting_plan

    data = read_config_file(Path(model_config))
    fits: list[Manifest] = []
    for manifest in manifests:
        try:
            llmi = LLMInference.model_validate(manifest.obj)
            plan = fitting_plan(llmi, data, device_memory_gb)
        except ConfigError as exc:
            print(f"{manifest.source}: {manifest.label}: spec.{exc}", file=sys.stderr)
            continue
        print(f"{manifest.source}: {manifest.label}: memory plan\n{plan.table()}")
        fits.append(manifest)
    return fits, len(manifests) - len(fits)


def _cmd_render(args: argparse.Namespace) -> int:
    manifests = load_manifests(args.filename)  # ManifestError: main reports it
    valid, count = _validated(manifests)
    settings = _settings(args)
    objects = []
    for manifest in valid:
        llmi = LLMInference.model_validate(manifest.obj)
        shape = topology(llmi.spec)
        replicas = "autoscaled" if llmi.spec.autoscaling else llmi.spec.replicas or 1
        print(
            f"# {manifest.label}: {replicas} replica(s) × {shape.pods_per_replica} pod(s) "
            f"({shape.workload}), {shape.devices_per_replica} device(s) per replica",
            file=sys.stderr,
        )
        objects.extend(render_children(llmi, settings))
    sys.stdout.write(yaml_output.dump_all(objects))
    return 1 if count else 0


def _cmd_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from brook_operator.local_run import (
        LocalOptions,
        cluster_only_notes,
        fetch_model,
        local_engine_config,
        run_local,
    )

    manifests = load_manifests(args.filename)  # ManifestError: main reports it
    valid, count = _validated(manifests)
    if count:
        return 1
    if args.name:
        valid = [m for m in valid if m.obj.get("metadata", {}).get("name") == args.name]
    if len(valid) != 1:
        names = ", ".join(m.label for m in valid) or "none"
        which = f"named {args.name!r} " if args.name else ""
        print(
            f"error: `brook up` runs one LLMInference; {len(valid)} {which}found ({names}): "
            "pick one with --name",
            file=sys.stderr,
        )
        return 2
    llmi = LLMInference.model_validate(valid[0].obj)
    options = LocalOptions(
        model=Path(args.model) if args.model else None,
        host=args.host,
        port=args.port,
        device=args.device,
        api_key_file=args.api_key_file,
        api_key_env=args.api_key_env,
    )
    for note in cluster_only_notes(llmi, args.replicas):  # before a download's progress
        print(f"note: {note}", file=sys.stderr)
    config = local_engine_config(llmi, fetch_model(llmi, options))
    server = config.server
    print(
        f"{valid[0].label}: serving {config.model.served_name or config.model.uri} on "
        f"http://{server.host}:{server.port}/v1 ({config.device}, tensor "
        f"{config.parallel.tensor} x pipeline {config.parallel.pipeline}); Ctrl-C drains and "
        "stops",
        file=sys.stderr,
        flush=True,
    )
    return run_local(config, args.replicas, name=llmi.metadata.name)


def _cmd_deploy(args: argparse.Namespace) -> int:
    from brook_operator import deploy
    from brook_operator.kube import KubeClient, KubeError

    manifests = load_manifests(args.filename)  # ManifestError: main reports it
    valid, count = _validated(manifests)
    if count:
        return deploy.INVALID
    try:
        kube = KubeClient.from_environment(args.kubeconfig)
        applied = []
        for manifest in valid:
            obj = dict(manifest.obj)
            metadata = dict(obj.get("metadata") or {})
            metadata["namespace"] = metadata.get("namespace") or args.namespace
            obj["metadata"] = metadata
            kube.apply(obj, manager=deploy.DEPLOY_MANAGER, dry_run=args.dry_run)
            verb = "valid on the server (dry run)" if args.dry_run else "applied"
            print(f"{manifest.label} in {metadata['namespace']}: {verb}", flush=True)
            applied.append((metadata["namespace"], metadata["name"]))
        if not args.wait or args.dry_run:
            return deploy.READY
        worst = deploy.READY
        for namespace, name in applied:

            def say(line: str, who: str = name) -> None:
                print(f"{who}: {line}", flush=True)

            worst = max(worst, deploy.follow_rollout(kube, namespace, name, args.timeout, say))
        return worst
    except KubeError as exc:
        print(f"error: the API server: {exc}", file=sys.stderr)
        return deploy.USAGE


def _hub_endpoint(value: str) -> str:
    try:
        return check_endpoint(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model_configs(endpoint: str) -> ModelConfigs | None:
    """Where the operator reads hf:// models' config.json to plan them (``off``: nowhere)."""
    return None if endpoint == "off" else ModelConfigs(endpoint)


def _cmd_operator(args: argparse.Namespace) -> int:
    import logging

    import kopf
    from prometheus_client import CollectorRegistry, start_http_server

    from brook_operator import handlers
    from brook_operator.controller import Reconciler
    from brook_operator.kube import KubeClient
    from brook_operator.operator_metrics import OperatorMetrics

    if not args.all_namespaces and not args.namespace:
        print("error: pass --all-namespaces or --namespace NS (repeatable)", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    settings = _settings(args)
    registry = CollectorRegistry()
    start_http_server(args.metrics_port, addr=args.metrics_address, registry=registry)
    kube = KubeClient.from_environment(args.kubeconfig, timeout_seconds=args.api_timeout_seconds)
    memo = kopf.Memo(
        reconciler=Reconciler(kube, settings, _model_configs(args.hub_endpoint)),
        metrics=OperatorMetrics(registry),
        namespaces=None if args.all_namespaces else args.namespace,
        resync_seconds=args.resync_seconds,
        api_timeout_seconds=args.api_timeout_seconds,
    )
    del handlers  # imported for its registrations
    # An explicit identity: kopf's default asks getpass for a user name, which fails for a
    # uid without a passwd entry (the image's non-root user).
    # The chart sets POD_ID (the pod's name); elsewhere several processes may share a host.
    identity = (
        os.environ.get("POD_ID")
        or os.environ.get("POD_NAME")
        or f"{socket.gethostname()}-{os.getpid()}"
    )
    kopf.run(
        identity=identity,  # type: ignore[arg-type]  # kopf.Identity is a NewType of str
        standalone=args.peering is None,
        peering_name=args.peering,
        # Peers of equal priority would all act (kopf only warns): each process draws its own,
        # and the highest acts while the others stand by.
        priority=random.SystemRandom().randrange(1, 1 << 30),
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=f"http://{args.health_address}:{args.health_port}/healthz",
        memo=memo,
    )
    return 0


#: what a replica's start costs before the engine's process runs (scheduling, container)
DEFAULT_POD_START = 5.0


def _cmd_autoscale_simulate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from brook_operator.autoscaler import simulate as sim
    from brook_operator.autoscaler.simulate.profile import with_measured_start
    from brook_operator.autoscaler.simulate.report import (
        parse_window,
        plot,
        table,
        write_decisions,
    )

    try:
        trace_path = sim.resolve_trace(args.trace)
        requests = sim.scale_rate(sim.read_trace(trace_path), args.rate_scale)
        profile = sim.load_profile(args.profile)
        if args.cold_start_from is not None:
            pod_start = (
                DEFAULT_POD_START if args.pod_start_seconds is None else args.pod_start_seconds
            )
            profile = with_measured_start(profile, Path(args.cold_start_from), pod_start)
        elif args.pod_start_seconds is not None:
            raise sim.SimulationError("--pod-start-seconds applies with --cold-start-from")
        if args.uncached_start:
            if profile.cold_start_uncached_seconds is None:
                raise sim.SimulationError(
                    f"--uncached-start: profile {profile.name} has no cold_start_uncached_seconds"
                )
            profile = profile.model_copy(
                update={"cold_start_seconds": profile.cold_start_uncached_seconds}
            )
        spec = sim.load_spec(Path(args.policy), profile) if args.policy else None
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        try:
            window = parse_window(args.window) if args.window else None
        except ValueError as exc:
            raise sim.SimulationError(f"--window: {exc}") from None
        if not args.oracle_headroom > 0:
            raise sim.SimulationError(
                f"--oracle-headroom {args.oracle_headroom:g}: use a positive multiple, e.g. 1.5"
            )
        comparison = sim.compare(
            requests,
            profile,
            spec or sim.default_spec(profile),
            names,
            args.slo_ttft,
            args.oracle_headroom,
            args.router,
            args.read_gateway_queue,
            window,
        )
        if args.plot:
            title = f"{args.trace} on {profile.name}" + (
                f" (rate ×{args.rate_scale:g})" if args.rate_scale != 1 else ""
            )
            plot(comparison.results, comparison.slo_seconds, title, Path(args.plot))
        if args.decisions:
            write_decisions(comparison.results, Path(args.decisions))
    except sim.SimulationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "trace": args.trace,
            "profile": profile.name,
            "slo_ttft_s": comparison.slo_seconds,
            "rate_scale": args.rate_scale,
            "cold_start_s": profile.cold_start_seconds,
            "router": args.router,
            "read_gateway_queue": args.read_gateway_queue,
            "policies": comparison.rows,
        }
        print(json.dumps(out, indent=2))
        return 0
    peak = comparison.static_peak
    print(
        f"trace {args.trace}: {len(requests)} requests"
        + (f" (rate ×{args.rate_scale:g})" if args.rate_scale != 1 else "")
        + f"; profile {profile.name}; TTFT SLO {comparison.slo_seconds:g} s"
    )
    print(
        f"static-peak: {peak.replicas} replica(s)"
        + ("" if peak.meets_slo else " (maxReplicas, and still short of the SLO)")
        + f"; autoscaled fleets start at {comparison.initial_replicas}"
    )
    print()
    print(table(comparison.rows))
    if window is not None:
        print(f"\nrequests arriving {args.window}, each day: SLO met (P99 TTFT s)")
        for name, row in comparison.rows.items():
            days = "  ".join(
                f"day {w['day']}: {w['slo_attainment']:.3f} ({w['ttft_p99_s']})"
                for w in row["window"]
            )
            print(f"  {name:<18} {days}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from brook_operator.autoscaler.simulate.baselines import POLICIES
    from brook_operator.autoscaler.simulate.router import DEFAULT_ROUTER, ROUTERS

    parser = argparse.ArgumentParser(
        prog="brook", description="Brook: LLM inference on Kubernetes NPU clusters."
    )
    parser.add_argument("--version", action="version", version=f"brook {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = sub.add_parser("crd", help="print the LLMInference CustomResourceDefinition")
    crd.add_argument(
        "--reference", action="store_true", help="print a Markdown reference of every field"
    )
    crd.set_defaults(func=_cmd_crd)

    files_help = "manifest file or folder (repeatable; - reads standard input)"
    validate = sub.add_parser(
        "validate",
        help="check LLMInference manifests offline against the CRD's schema and CEL rules",
    )
    validate.add_argument("-f", "--filename", action="append", required=True, help=files_help)
    validate.add_argument(
        "--model-config",
        help="the model's config.json (or its folder): also check the engine's memory plan "
        "(weights per rank, what offload streams, the KV cache left) and print it",
    )
    validate.add_argument(
        "--device-memory-gb",
        type=float,
        help="with --model-config: GiB of memory per device, for the KV cache the plan leaves",
    )
    validate.set_defaults(func=_cmd_validate)

    render = sub.add_parser(
        "render", help="print the objects the operator creates for each LLMInference"
    )
    render.add_argument("-f", "--filename", action="append", required=True, help=files_help)
    render.add_argument(
        "--engine-image", help="engine image of resources without spec.image (any accelerator)"
    )
    render.add_argument(
        "--engine-image-for",
        action="append",
        metavar="TYPE=IMAGE",
        help="engine image of resources on accelerator TYPE (cpu, cuda, npu) without "
        "spec.image (repeatable; default ghcr.io/brook-dev/brook-engine:VERSION, -cuda, -cann)",
    )
    render.set_defaults(func=_cmd_render)

    up = sub.add_parser(
        "up",
        help="run an LLMInference on this machine, no cluster: the engine configuration the "
        "operator would mount, its ranks as local processes, the OpenAI API on a local port",
        description="Run the manifest you will deploy on this machine first. Example: "
        "brook up -f crds/examples/smollm2-cpu.yaml --model models/SmolLM2-135M-Instruct "
        "--port 8000",
    )
    up.add_argument("-f", "--filename", action="append", required=True, help=files_help)
    up.add_argument("--name", help="the LLMInference to run when the files hold several")
    up.add_argument(
        "--model",
        help="the model's folder on this machine (needed where spec.model.uri is neither "
        "file:// nor hf://, which is downloaded into the Hugging Face cache)",
    )
    up.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    up.add_argument("--port", type=int, help="port (default: spec.server.port, 8000)")
    up.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "npu"),
        help="run on this device instead of spec.accelerator.type (e.g. cpu on a laptop)",
    )
    up.add_argument("--api-key-file", help="API key file, where the manifest asks for a key")
    up.add_argument("--api-key-env", help="environment variable holding the API key")
    up.add_argument(
        "--replicas", type=int, help="replicas to run here (one: a machine's devices are shared)"
    )
    up.set_defaults(func=_cmd_up)

    deploy = sub.add_parser(
        "deploy",
        help="validate offline, apply by server-side apply and (--wait) follow the rollout",
        description="Exit codes: 0 applied (and ready with --wait), 1 invalid manifest, 2 "
        "usage or API error, 3 the rollout failed (an image that cannot be pulled, a crash "
        "loop, a spec the operator refused), 4 timed out. Example: brook deploy -f "
        "crds/examples/qwen-7b-autoscaled.yaml --wait --timeout 1200",
    )
    deploy.add_argument("-f", "--filename", action="append", required=True, help=files_help)
    deploy.add_argument(
        "-n", "--namespace", default="default", help="namespace of manifests that name none"
    )
    deploy.add_argument("--wait", action="store_true", help="follow the rollout until Ready")
    deploy.add_argument(
        "--timeout", type=float, default=900.0, help="seconds --wait waits (default 900)"
    )
    deploy.add_argument(
        "--dry-run", action="store_true", help="the server checks the apply and stores nothing"
    )
    deploy.add_argument("--kubeconfig", help="kubeconfig (default: KUBECONFIG or ~/.kube/config)")
    deploy.set_defaults(func=_cmd_deploy)

    from brook_operator.monitor import command as monitor_command

    monitor_command.add_parser(sub)

    operator = sub.add_parser(
        "operator", help="run the controller that turns LLMInference resources into pods"
    )
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    scope.add_argument(
        "-n", "--namespace", action="append", help="watch this namespace (repeatable)"
    )
    operator.add_argument(
        "--engine-image",
        help="engine image of resources that set no spec.image, for every accelerator",
    )
    operator.add_argument(
        "--engine-image-for",
        action="append",
        metavar="TYPE=IMAGE",
        help="engine image of resources on accelerator TYPE (cpu, cuda, npu) that set no "
        "spec.image (repeatable; default ghcr.io/brook-dev/brook-engine:VERSION, -cuda, -cann)",
    )
    operator.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics")
    operator.add_argument("--metrics-address", default="0.0.0.0", help="address of /metrics")
    operator.add_argument("--health-port", type=int, default=8080, help="liveness at /healthz")
    operator.add_argument("--health-address", default="0.0.0.0", help="address of /healthz")
    operator.add_argument(
        "--hub-endpoint",
        type=_hub_endpoint,
        default=os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT,
        metavar="URL|off",
        help="where hf:// models' config.json is read, to plan each replica's memory before "
        "a pod is scheduled (a plan that cannot fit is SpecValid=False; a pod without a "
        "memory request gets the plan's); default HF_ENDPOINT or the Hugging Face Hub; off: "
        "the engine checks the plan at start",
    )
    operator.add_argument(
        "--peering",
        metavar="NAME",
        help="with several operator replicas: kopf's peering object (a ClusterKopfPeering with "
        "--all-namespaces, else a KopfPeering in each namespace) through which they elect the "
        "one that handles events; without it the operator runs standalone",
    )
    operator.add_argument(
        "--kubeconfig", help="kubeconfig outside a cluster (default: KUBECONFIG or ~/.kube)"
    )
    operator.add_argument(
        "--resync-seconds",
        type=float,
        default=60.0,
        help="how often every resource's status is refreshed (and a Degraded one reconciled)",
    )
    operator.add_argument(
        "--api-timeout-seconds",
        type=float,
        default=30.0,
        help="longest one Kubernetes API call may take (each retry gets as long again)",
    )
    operator.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    operator.set_defaults(func=_cmd_operator)

    autoscale = sub.add_parser("autoscale", help="the autoscaler's offline tools")
    autoscale_sub = autoscale.add_subparsers(dest="autoscale_command", required=True)
    simulate = autoscale_sub.add_parser(
        "simulate",
        help="replay a request trace against Brook's autoscaling policy and baselines",
        description=(
            "Replay a request trace on simulated replicas (a fluid model calibrated by a "
            "profile) resized by Brook's policy, its ablations and baselines; report TTFT SLO "
            "attainment and replica-hours. See docs/autoscaler-simulator.md."
        ),
    )
    simulate.add_argument(
        "--trace",
        required=True,
        help="trace file (.csv or .csv.gz: arrival_s,input_tokens,output_tokens) or a shipped "
        "trace: diurnal, spike, flat, long-prompt-burst, daily-surge",
    )
    simulate.add_argument(
        "--profile",
        default="smollm2-135m-cpu",
        help="profile file (.json) or a shipped profile: smollm2-135m-cpu (default), "
        "npu-72b-tp4pp2",
    )
    simulate.add_argument(
        "--policy",
        help="YAML or JSON file of spec.autoscaling fields (camelCase) for brook and its ablations "
        "(default: every default, maxReplicas from the profile)",
    )
    simulate.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma list of policies to run (default: all of {', '.join(POLICIES)})",
    )
    simulate.add_argument(
        "--oracle-headroom",
        type=float,
        default=1.0,
        help="size the oracles' fleets at this multiple of the demand (default 1)",
    )
    simulate.add_argument(
        "--slo-ttft", type=float, help="TTFT SLO in seconds (default: the profile's)"
    )
    simulate.add_argument(
        "--uncached-start",
        action="store_true",
        help="replicas start without a warm compile cache (the profile's "
        "cold_start_uncached_seconds instead of cold_start_seconds)",
    )
    simulate.add_argument(
        "--cold-start-from",
        metavar="FILE",
        help="take the replicas' starts from a `brook-engine bench --workload cold-start "
        "--json` report (the warm-cache start, and the empty-cache one for --uncached-start) "
        "instead of the profile's",
    )
    simulate.add_argument(
        "--pod-start-seconds",
        type=float,
        default=None,
        help="with --cold-start-from: seconds added to each measured start for scheduling the "
        f"pod and starting its container (default {DEFAULT_POD_START:g})",
    )
    simulate.add_argument(
        "--router",
        choices=ROUTERS,
        default=DEFAULT_ROUTER,
        help="how requests reach replicas: service (a Kubernetes Service, random), "
        "least-loaded (an endpoint picker reading the engines' metrics; the default) or "
        "flow-control (held at the gateway until a replica has room)",
    )
    simulate.add_argument(
        "--window",
        metavar="HH:MM-HH:MM",
        help="also score the requests arriving in this time of day, each day of the trace "
        "(its time 0 is a midnight): SLO attainment and P99 TTFT per day",
    )
    simulate.add_argument(
        "--read-gateway-queue",
        action="store_true",
        help="with --router flow-control: the autoscaled policies also count the requests held "
        "at the gateway as waiting (what reading the endpoint picker's queue would give; the "
        "operator's loop reads only the engines today)",
    )
    simulate.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="replay the trace at this multiple of its arrival rate (same shape over time)",
    )
    simulate.add_argument("--json", action="store_true", help="print one JSON object")
    simulate.add_argument("--plot", help="write replicas and TTFT p99 over time to this PNG")
    simulate.add_argument(
        "--decisions", help="write every autoscaling decision, with its reason, to this CSV"
    )
    simulate.set_defaults(func=_cmd_autoscale_simulate)
    from brook_engine.completion import add_completion_command

    add_completion_command(sub, "brook", build_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ManifestError as exc:  # files that cannot be read as manifests (validate, render)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # a --model-config that cannot be read, a manifest `up` cannot run
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
