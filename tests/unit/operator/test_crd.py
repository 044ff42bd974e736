"""The generated CRD: no drift from crds/, a structural schema the API server accepts, useful
descriptions, and the subresources and columns kubectl uses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from brook_operator.cli import main
from brook_operator.crd.generate import crd_yaml
from brook_operator.crd.validate import _strict

ROOT = Path(__file__).parents[3]
CRD_FILE = ROOT / "crds" / "llminference.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_brook_crd_equals_the_committed_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    printed = capsys.readouterr().out
    assert printed == crd_yaml()
    assert printed == CRD_FILE.read_text(), "crds/llminference.yaml drifted: run `make crd`"


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{key}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    for path, node in _nodes(schema):
        assert "$ref" not in node and "allOf" not in node and "oneOf" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node.get("anyOf", [{"type": "integer"}, {"type": "string"}]) == [
                {"type": "integer"},
                {"type": "string"},
            ], path
            continue
        assert "anyOf" not in node, path
        assert isinstance(node.get("type"), str), f"{path} has no single type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_every_field_is_described(schema: dict[str, Any]) -> None:
    undocumented = [
        path
        for path, node in _nodes(schema["properties"]["spec"], ".spec")
        if not node.get("description")
        and not (path.endswith(("{}", "[]")) and node.get("type") != "object")
    ]
    assert undocumented == []


def test_defaults_satisfy_their_own_schema(schema: dict[str, Any]) -> None:
    checked = 0
    for _, node in _nodes(schema):
        if "default" in node:
            jsonschema.Draft4Validator(_strict(node)).validate(node["default"])
            checked += 1
    assert checked > 30


def _field_exists(schema: dict[str, Any], dotted: str) -> bool:
    node = schema
    for part in dotted.split("."):
        props = node.get("properties", {})
        if part not in props:
            return bool(node.get("x-kubernetes-preserve-unknown-fields"))
        node = props[part]
    return True


def test_cel_rules_only_name_fields_that_exist(schema: dict[str, Any]) -> None:
    """The API server type-checks rules against the schema when the CRD is created."""
    rules = 0
    for path, node in _nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            rules += 1
            for ref in re.findall(r"self((?:\.[A-Za-z_]\w*)+)", rule["rule"]):
                fields = ref.lstrip(".")
                # Calls like .size() / .matches() / .all() end the field chain.
                chain = re.sub(r"\.(size|matches|all|exists|filter|startsWith)$", "", fields)
                if path == "" and chain.startswith("metadata."):
                    continue
                assert _field_exists(node, chain), f"{path}: {rule['rule']} names {chain}"
            if "fieldPath" in rule:
                assert _field_exists(node, rule["fieldPath"].lstrip(".")), rule
    assert rules >= 15


def test_names_columns_and_subresources(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "llminferences.brook.dev"
    assert spec["group"] == "brook.dev"
    assert spec["names"]["plural"] == "llminferences"
    assert spec["names"]["shortNames"] == ["llmi"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "TP", "PP", "Replicas", "Ready", "Age"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "conditions"
    ]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_field_reference_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd", "--reference"]) == 0
    assert capsys.readouterr().out == (ROOT / "docs" / "crd-reference.md").read_text(), (
        "docs/crd-reference.md drifted: run `make crd`"
    )
