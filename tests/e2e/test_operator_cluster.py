"""The operator's scenarios on a real cluster (kind in CI: .github/workflows/e2e-kind.yaml).

Runs only when ``KUBECONFIG`` names a reachable cluster and ``BROOK_E2E=1`` says that this
cluster may be used (so that ``make test`` on a laptop whose kubeconfig points at production
never creates anything there); skipped otherwise. Each test works
in a namespace of its own, created and deleted here. The operator is the one the chart
installed (``BROOK_E2E_OPERATOR=installed``) or, by default, ``brook operator`` started by the
test for that namespace. The CRD is applied when absent. Engine pods are not expected to
become ready (the scenarios check what the operator does, not the engine), so readiness is
asserted only on the emulated API server, where the test plays the Deployment controller.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import operator_scenarios as scenarios
from support.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]


def _kubectl_binary() -> str | None:
    local = Path(sys.executable).parent / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


def _reachable() -> str | None:
    """Why the suite cannot run here, or None."""
    if not os.environ.get("KUBECONFIG"):
        return "KUBECONFIG is not set: no cluster to run the end-to-end scenarios on"
    if os.environ.get("BROOK_E2E") != "1":
        return "set BROOK_E2E=1 to run the end-to-end scenarios on the cluster in KUBECONFIG"
    kubectl = _kubectl_binary()
    if kubectl is None:
        return "kubectl is not installed"
    result = subprocess.run(
        [kubectl, "version", "--request-timeout=5s"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        return f"the cluster in KUBECONFIG does not answer: {result.stderr.strip()[:200]}"
    return None


_WHY_NOT = _reachable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")


@dataclass
class RealCluster:
    namespace: str
    timeout: float = 180.0
    runs_controllers: bool = True

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        kubectl = _kubectl_binary()
        assert kubectl is not None
        result = subprocess.run(
            [kubectl, *args], input=input, capture_output=True, text=True, timeout=120, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result

    def mark_workload_ready(self, kind: str, name: str, replicas: int) -> None:
        """The Deployment controller reports for itself here."""

    def has(self, resource: str) -> bool:
        return resource in self.kubectl("api-resources", "-o", "name").stdout.split()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RealCluster]:
    cluster = RealCluster(namespace=f"brook-e2e-{uuid.uuid4().hex[:8]}")
    if not cluster.has("llminferences.brook.dev"):
        cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "llminference.yaml"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/llminferences.brook.dev", "--timeout=60s"
        )
    cluster.kubectl("create", "namespace", cluster.namespace)
    operator = None
    if os.environ.get("BROOK_E2E_OPERATOR") != "installed":
        operator = OperatorProcess.start(
            Path(os.environ["KUBECONFIG"]),
            tmp_path / "operator.log",
            namespaces=[cluster.namespace],
        )
    try:
        yield cluster
    finally:
        if operator is not None:
            operator.stop()
        cluster.kubectl("delete", "namespace", cluster.namespace, "--wait=false", check=False)


def test_create_update_scale_delete(cluster: RealCluster) -> None:
    scenarios.create_converges(cluster)
    scenarios.printer_columns(cluster)
    scenarios.update_image_and_scale(cluster)
    scenarios.delete_collects_children(cluster)


def test_topology_change_between_deployment_and_leader_worker_set(
    cluster: RealCluster,
) -> None:
    if not cluster.has("leaderworkersets.leaderworkerset.x-k8s.io"):
        pytest.skip("LeaderWorkerSet is not installed in this cluster")
    scenarios.create_converges(cluster)
    scenarios.topology_change(cluster)
