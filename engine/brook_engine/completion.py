"""Bash (and zsh, through ``bashcompinit``) completion for an ``argparse`` command line, read
from the parser itself so it never falls behind the commands: subcommands (nested too), each
command's flags, the choices a flag takes, and file names after flags that name files.

``brook completion bash`` and ``brook-engine completion bash`` print it::

    source <(brook completion bash)          # in ~/.bashrc
    autoload -U bashcompinit && bashcompinit && source <(brook completion bash)   # zsh
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

#: flags whose value is a path: complete file names after them
_PATH_WORDS = ("file", "config", "model", "dir", "output", "kubeconfig", "trace", "plot")


def _commands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every command path ("", "autoscale", "autoscale simulate") and its parser."""
    found = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, f"{prefix} {name}".strip()))
    return found


def _words(parser: argparse.ArgumentParser) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(subcommand names, flags, flag -> its choices)."""
    subcommands: list[str] = []
    flags: list[str] = []
    choices: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices)
        elif not action.option_strings and action.choices:  # a positional's values
            subcommands += [str(c) for c in action.choices]
        elif action.option_strings:
            flags += action.option_strings
            if action.choices:
                for flag in action.option_strings:
                    choices[flag] = [str(c) for c in action.choices]
    return subcommands, flags, choices


def bash_completion(parser: argparse.ArgumentParser, prog: str) -> str:
    """The completion script for ``prog``."""
    function = "_" + re.sub(r"\W", "_", prog) + "_complete"
    cases, values, paths = [], [], set()
    for path, sub in _commands(parser).items():
        subcommands, flags, choices = _words(sub)
        cases.append(f'        "{path}") words="{" ".join(subcommands + flags)}" ;;')
        for flag, options in choices.items():
            offer = f'COMPREPLY=($(compgen -W "{" ".join(options)}" -- "$cur")); return'
            values.append(f'        "{path}|{flag}") {offer} ;;')
        for flag in flags:
            if any(w in flag for w in _PATH_WORDS) or flag == "-f":
                paths.add(f"{path}|{flag}")
    path_case = "|".join(f'"{p}"' for p in sorted(paths)) or '"-"'
    return f"""# {prog} completion (generated from its command line)
{function}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local path="" i w words
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        [[ "$w" == -* ]] && continue
        case "${{path:+$path }}$w" in
{chr(10).join(f'            "{p}") path="{p}" ;;' for p in _commands(parser) if p)}
        esac
    done
    case "$path|$prev" in
{chr(10).join(values)}
        {path_case}) COMPREPLY=($(compgen -f -- "$cur")); return ;;
    esac
    case "$path" in
{chr(10).join(cases)}
    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -o default -F {function} {prog}
"""


def add_completion_command(
    sub: Any, prog: str, build_parser: Callable[[], argparse.ArgumentParser]
) -> None:
    """``prog completion bash|zsh`` on the subcommands ``sub`` of ``build_parser()``'s."""

    def run(args: argparse.Namespace) -> int:
        if args.shell == "zsh":
            print("autoload -U +X bashcompinit && bashcompinit")
        print(bash_completion(build_parser(), prog), end="")
        return 0

    completion = sub.add_parser(
        "completion",
        help=f"print shell completion: source <({prog} completion bash) (zsh: after "
        "autoload -U bashcompinit && bashcompinit)",
    )
    completion.add_argument("shell", choices=("bash", "zsh"))
    completion.set_defaults(func=run)
