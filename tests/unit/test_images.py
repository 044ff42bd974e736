"""The image definitions: every base image is pinned by digest (a tag moves, so an unpinned
Dockerfile builds a different image from one week to the next), and the operator and the
engine build on the same base."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

IMAGES = Path(__file__).resolve().parents[2] / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
DIGEST = re.compile(r"^[\w./:-]+@sha256:[0-9a-f]{64}$")


def _bases(dockerfile: Path) -> list[str]:
    """The image each FROM builds on, with ``${ARG}`` replaced by the ARG's default; stages
    named earlier in the file are not images."""
    defaults: dict[str, str] = {}
    stages: set[str] = set()
    bases: list[str] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "ARG" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            defaults[name] = value
        elif words[0] == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m[1] or m[2]], words[1])
            if image not in stages:
                bases.append(image)
            if len(words) >= 4 and words[2].upper() == "AS":
                stages.add(words[3])
    return bases


def test_there_are_images_to_check() -> None:
    assert [path.name for path in DOCKERFILES] == ["engine.Dockerfile", "operator.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_base_image_is_pinned_by_digest(dockerfile: Path) -> None:
    bases = _bases(dockerfile)
    assert bases, f"{dockerfile.name} has no FROM"
    for base in bases:
        assert DIGEST.match(base), f"{dockerfile.name}: {base} is not pinned by digest"


def test_the_operator_and_the_engine_share_their_base() -> None:
    assert len({base for path in DOCKERFILES for base in _bases(path)}) == 1


def test_an_unpinned_base_is_caught(tmp_path: Path) -> None:
    unpinned = tmp_path / "x.Dockerfile"
    unpinned.write_text("ARG BASE=python:3.11-slim\nFROM ${BASE} AS build\nFROM build\n")
    assert _bases(unpinned) == ["python:3.11-slim"]
    assert not DIGEST.match("python:3.11-slim")
