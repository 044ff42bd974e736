"""Two operator replicas, peered as the chart peers them (``replicas: 2``): kopf's peering
elects one to act and keeps the other standing by; when the one acting stops, the other
takes over. Real ``brook operator`` processes against the emulated kube-apiserver, with the
chart's own peering definitions and ``--peering`` argument.

Not covered: a replica killed without its clean exit. Its entry then holds the others back
until its lifetime (kopf's 60 s) passes, which is kopf's own timing, not Brook's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from brook_operator.cli import build_parser
from brook_operator.rbac import PEERING_NAMESPACED_RULES
from support import operator_scenarios as scenarios
from support.kube_api import KubeApi, leaderworkerset_crd
from support.operator_process import OperatorProcess
from support.operator_scenarios import EmulatedCluster

ROOT = Path(__file__).resolve().parents[3]
NAMESPACE = "ai"
RELEASE = "brook"


def _chart_peering() -> tuple[list[dict[str, Any]], str]:
    """The chart's peering objects and ``--peering`` value for two replicas watching
    ``NAMESPACE``."""
    values = {"replicas": 2, "rbac": {"scope": "namespace", "watchNamespaces": [NAMESPACE]}}
    with helm.Chart.load(ROOT / "charts" / "brook") as chart:
        rendered = chart.render(values, name=RELEASE, namespace="brook-system")
    objects = [
        doc
        for path, text in rendered.items()
        if not path.endswith(".txt")
        for doc in yaml.safe_load_all(text)
        if doc is not None
    ]
    peering = [
        o
        for o in objects
        if o["kind"] == "KopfPeering"
        or (o["kind"] == "CustomResourceDefinition" and o["spec"]["group"] == "kopf.dev")
    ]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    name = build_parser().parse_args(container["args"]).peering
    assert name, "the chart runs two replicas without peering"
    return peering, name


@pytest.fixture
def cluster(kube_api: KubeApi, brook_crd: dict[str, Any]) -> Iterator[EmulatedCluster]:
    kube_api.create_namespace(NAMESPACE)
    kube_api.create(leaderworkerset_crd())
    yield EmulatedCluster(kube_api, NAMESPACE)


def _peers(api: KubeApi, name: str) -> dict[str, dict[str, Any]]:
    """The live entries of the peering object, by identity."""
    peering = api.get("kopfpeerings.kopf.dev", name, NAMESPACE) or {}
    return dict(peering.get("status") or {})


def _applied(operator: OperatorProcess) -> float:
    """How many reconciles this process applied (its own ``/metrics``)."""
    found = re.search(
        r'^brook_operator_reconciles_total\{result="applied"\} (\S+)$', operator.metrics(), re.M
    )
    return float(found.group(1)) if found else 0.0


def test_two_replicas_elect_one_and_the_other_takes_over(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    api = cluster.api
    peering_objects, peering = _chart_peering()
    for obj in peering_objects:
        api.create(obj, obj["metadata"].get("namespace"))

    with ExitStack() as stack:
        operators: dict[str, OperatorProcess] = {}
        for identity in ("operator-a", "operator-b"):
            process = OperatorProcess.start(
                api.kubeconfig,
                tmp_path / f"{identity}.log",
                namespaces=[NAMESPACE],
                extra_args=(f"--peering={peering}",),
                env={"POD_ID": identity},
            )
            stack.callback(process.stop)
            operators[identity] = process
            # each joins the election under the identity the chart gives it (the pod's name)
            scenarios.wait_for(
                cluster, lambda i=identity: i in _peers(api, peering), f"{identity}'s entry"
            )

        entries = _peers(api, peering)
        leader = max(entries, key=lambda identity: entries[identity]["priority"])
        (standby,) = set(operators) - {leader}
        if standby == "operator-a":
            # The first acted until it saw the second's higher priority: wait until it has.
            scenarios.wait_for(
                cluster,
                lambda: "Pausing operations in favour of" in operators[standby].log(),
                "the first replica to stand by",
            )
        # (a later replica of lower priority starts paused: kopf acts only once its first
        # look at the peering object shows no one above it)

        # Only the one with the highest priority acts.
        scenarios.apply(cluster, scenarios.manifest("tiny-cpu", NAMESPACE))
        scenarios.wait_for(
            cluster, lambda: scenarios.get(cluster, "deployment", "tiny-cpu"), "the Deployment"
        )
        scenarios.wait_status(
            cluster,
            "tiny-cpu",
            lambda o: (o.get("status") or {}).get("observedGeneration") == 1,
            "the leader's status",
        )
        assert _applied(operators[leader]) >= 1, operators[leader].log()
        assert _applied(operators[standby]) == 0, operators[standby].log()

        # The leader stops as Kubernetes stops a pod: it leaves the election on its way out,
        # and the replica standing by resumes and handles what comes next.
        assert operators[leader].stop() == 0
        assert leader not in _peers(api, peering)
        scenarios.wait_for(
            cluster,
            lambda: "Resuming operations" in operators[standby].log(),
            "the standby replica to resume",
        )
        second = scenarios.manifest("tiny-cpu", NAMESPACE)
        second["metadata"]["name"] = "tiny-second"
        scenarios.apply(cluster, second)
        scenarios.wait_status(
            cluster,
            "tiny-second",
            lambda o: (o.get("status") or {}).get("observedGeneration") == 1,
            "the new leader's status",
        )
        assert scenarios.get(cluster, "deployment", "tiny-second") is not None
        assert _applied(operators[standby]) >= 1

        standby_log = operators[standby].log()
        assert operators[standby].stop() == 0
        assert "Traceback" not in standby_log, standby_log
        assert _peers(api, peering) == {}

    # What the peering took is exactly what the chart grants for it (kopf.dev rules).
    granted = {
        (verb, rule.api_group, resource)
        for rule in PEERING_NAMESPACED_RULES
        for resource in rule.resources
        for verb in rule.verbs
    }
    used = {
        (check.verb, check.api_group, check.resource)
        for check in api.rbac(user_agent="kopf")
        if check.api_group == "kopf.dev"
    }
    assert used and used <= granted, used - granted
