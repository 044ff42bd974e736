"""Markers come from the folder a test lives in: tests/unit → unit, and so on."""

from __future__ import annotations

from pathlib import Path

import pytest

_FOLDERS = ("unit", "integration", "e2e")
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = Path(item.path).relative_to(_TESTS)
        if relative.parts and relative.parts[0] in _FOLDERS:
            item.add_marker(getattr(pytest.mark, relative.parts[0]))
