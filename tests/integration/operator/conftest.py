"""Operator integration tests run against an emulated kube-apiserver on 127.0.0.1
(``tests/support/kube_api``; its docstring documents the fixture API and what is and is
not emulated)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.kube_api import KubeApi

REPO = Path(__file__).resolve().parents[3]

LLMINFERENCE_CRD = REPO / "crds" / "llminference.yaml"


@pytest.fixture
def kube_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApi]:
    """A fresh emulated kube-apiserver; KUBECONFIG points at it for the test."""
    with KubeApi.running(tmp_path / "kube-api") as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        try:
            import kubernetes
        except ImportError:  # pragma: no cover
            pass
        else:
            # The kubernetes package reads KUBECONFIG once, at import; kopf's default login
            # (and load_kube_config()) set a process-wide default configuration.
            monkeypatch.setattr(
                kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(api.kubeconfig)
            )
            monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)
        yield api
        failures = api.internal_errors
    if failures:
        pytest.fail(f"the emulated kube-apiserver failed internally: {failures!r}")


@pytest.fixture
def brook_crd(kube_api: KubeApi) -> dict[str, Any]:
    """The project's LLMInference CRD, installed."""
    (crd,) = kube_api.load(LLMINFERENCE_CRD)
    return crd
