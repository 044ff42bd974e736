"""Read Kubernetes manifests from files, folders or standard input."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


class ManifestError(ValueError):
    """A manifest file that cannot be read or parsed."""


@dataclass(frozen=True)
class Manifest:
    source: str
    """File (and document number when a file holds several)."""

    obj: Any

    @property
    def label(self) -> str:
        if isinstance(self.obj, dict):
            kind = self.obj.get("kind", "?")
            name = (self.obj.get("metadata") or {}).get("name", "?")
            return f"{kind}/{name}"
        return "?"


def _files(paths: list[str]) -> Iterator[str]:
    for raw in paths:
        path = Path(raw)
        if raw != "-" and path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in MANIFEST_SUFFIXES)
            if not found:
                raise ManifestError(f"{raw}: no {'/'.join(MANIFEST_SUFFIXES)} files in folder")
            yield from map(str, found)
        else:
            yield raw


def load_manifests(paths: list[str]) -> list[Manifest]:
    """Every YAML/JSON document in ``paths`` (files, folders, or ``-`` for standard input)."""
    manifests: list[Manifest] = []
    for name in _files(paths):
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
        except OSError as exc:
            raise ManifestError(f"{name}: cannot read: {exc.strerror}") from None
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            raise ManifestError(f"{name}: not valid YAML: {exc}") from None
        for index, doc in enumerate(docs):
            source = name if len(docs) == 1 else f"{name}#{index + 1}"
            manifests.append(Manifest(source, doc))
    return manifests
