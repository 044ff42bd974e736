"""``brook-engine``: the engine side's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from brook_engine import __version__
from brook_engine.config import ConfigError, dump_engine_config, load_engine_config


def _cmd_config(args: argparse.Namespace) -> int:
    try:
        config = load_engine_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(dump_engine_config(config, fmt=args.format))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brook-engine", description="The Brook inference engine.")
    parser.add_argument("--version", action="version", version=f"brook-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config = sub.add_parser(
        "config", help="validate an engine configuration file and print it with every default"
    )
    config.add_argument("--config", required=True, help="engine configuration file (YAML or JSON)")
    config.add_argument("--format", choices=("yaml", "json"), default="yaml")
    config.set_defaults(func=_cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
