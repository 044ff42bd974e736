"""The shipped example manifests (crds/examples), loaded with changes for a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def example_manifest(name: str, **changes: Any) -> dict[str, Any]:
    """``crds/examples/<name>.yaml`` with ``changes`` ({dotted path under spec: value})
    applied and a uid set (as the API server would)."""
    obj = yaml.safe_load((ROOT / "crds" / "examples" / f"{name}.yaml").read_text())
    for path, value in changes.items():
        node = obj["spec"]
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    obj["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    return dict(obj)
