"""``brook``: the operator side's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from brook_operator import __version__, yaml_output
from brook_operator.api import LLMInference, topology
from brook_operator.crd.generate import crd_yaml
from brook_operator.crd.reference import reference_markdown
from brook_operator.crd.validate import validate_object
from brook_operator.manifests import Manifest, ManifestError, load_manifests
from brook_operator.render import engine_config_map


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
    try:
        manifests = load_manifests(args.filename)
    except ManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    valid, count = _validated(manifests)
    for manifest in valid:
        print(f"{manifest.source}: {manifest.label}: valid")
    if count:
        print(f"{count} problem(s) in {len(manifests) - len(valid)} object(s)", file=sys.stderr)
    return 1 if count else 0


def _cmd_render(args: argparse.Namespace) -> int:
    try:
        manifests = load_manifests(args.filename)
    except ManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    valid, count = _validated(manifests)
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
        objects.append(engine_config_map(llmi))
    sys.stdout.write(yaml_output.dump_all(objects))
    return 1 if count else 0


def build_parser() -> argparse.ArgumentParser:
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
    validate.set_defaults(func=_cmd_validate)

    render = sub.add_parser(
        "render", help="print the engine configuration each LLMInference's pods get"
    )
    render.add_argument("-f", "--filename", action="append", required=True, help=files_help)
    render.set_defaults(func=_cmd_render)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
