"""docs/architecture.md names every module of both packages, so the map cannot drift from
the code unnoticed: a module added, moved or renamed without its row fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "engine" / "brook_engine", ROOT / "operator" / "brook_operator")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def test_every_module_has_a_row() -> None:
    spans = _code_spans((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    missing = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            if path.name == "__init__.py":
                continue
            name = re.escape(path.stem)
            pattern = re.compile(rf"(^|[/ ]){name}(\.py)?$|(^|[/ ]){name}(\.py)? ")
            if not any(pattern.search(span) for span in spans):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"
