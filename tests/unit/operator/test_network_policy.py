"""The engine pods' NetworkPolicies, read the way a network plugin enforces them: the API port
is open to the allowed clients (anyone by default), the rendezvous and the collectives' ports
only to the pods of the same replica group, and nothing else to anyone."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from brook_operator.api import LLMInference, to_engine_config
from brook_operator.crd.validate import validate_object
from brook_operator.render import OperatorSettings, render_children
from brook_operator.render.network_policy import LWS_GROUP_INDEX_LABEL
from brook_operator.render.pod import LWS_WORKER_INDEX_LABEL
from brook_operator.render.settings import RENDEZVOUS_PORT
from support.examples import example_manifest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
SETTINGS = OperatorSettings(engine_image="registry.example/brook-engine:test")
#: A port gloo or HCCL might pick for a connection between ranks.
EPHEMERAL_PORT = 41_873
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
ALLOWED = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    },
    {"podSelector": {"matchLabels": {"role": "gateway"}}},
]


def _llmi(name: str, **changes: Any) -> LLMInference:
    return LLMInference.model_validate(example_manifest(name, **changes))


def _policies(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in children if c["kind"] == "NetworkPolicy"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_admits(peer: dict[str, Any], source: tuple[str, dict[str, str]], namespace: str) -> bool:
    source_namespace, source_labels = source
    namespace_labels = {"kubernetes.io/metadata.name": source_namespace}
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif source_namespace != namespace:  # a podSelector alone: this namespace only
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], source_labels)


def admitted(
    policies: list[dict[str, Any]],
    pod: dict[str, str],
    port: int,
    source: tuple[str, dict[str, str]],
    namespace: str,
) -> bool:
    """Whether TCP from ``source`` (namespace, labels) reaches ``port`` of a pod labelled
    ``pod``: allowed where no policy selects it, else where some rule of one that does
    admits it (NetworkPolicy semantics, without named ports or ipBlocks)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(
                p.get("protocol", "TCP") == "TCP" and p.get("port", port) == port for p in ports
            ):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_admits(p, source, namespace) for p in peers):
                return True
    return False


def _pod_labels(llmi: LLMInference, group: int | None, worker: int = 0) -> dict[str, str]:
    """The labels a running engine pod carries (LeaderWorkerSet adds its own)."""
    children = {c["kind"]: c for c in render_children(llmi, SETTINGS)}
    workload = children.get("Deployment") or children["LeaderWorkerSet"]
    if workload["kind"] == "Deployment":
        return {**workload["spec"]["template"]["metadata"]["labels"], "pod-template-hash": "x"}
    templates = workload["spec"]["leaderWorkerTemplate"]
    template = templates["workerTemplate" if worker else "leaderTemplate"]
    return {
        **template["metadata"]["labels"],
        "leaderworkerset.sigs.k8s.io/name": workload["metadata"]["name"],
        LWS_GROUP_INDEX_LABEL: str(group),
        LWS_WORKER_INDEX_LABEL: str(worker),
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_engine_pod_is_isolated_but_for_its_api(path: Path) -> None:
    llmi = _llmi(path.stem)
    namespace = llmi.metadata.namespace or "default"
    policies = _policies(render_children(llmi, SETTINGS))
    port = llmi.spec.server.port
    multi_pod = "LeaderWorkerSet" in {c["kind"] for c in render_children(llmi, SETTINGS)}
    stranger = ("elsewhere", {"app": "curious"})
    for worker in (0, 1) if multi_pod else (0,):
        pod = _pod_labels(llmi, 0, worker)
        # The API (and /metrics) is open to anyone by default, as without a policy.
        assert admitted(policies, pod, port, stranger, namespace)
        for closed in (RENDEZVOUS_PORT, EPHEMERAL_PORT):
            assert not admitted(policies, pod, closed, stranger, namespace)
            # Not even from another pod of the same resource: that is another replica.
            other = _pod_labels(llmi, 1, worker) if multi_pod else _pod_labels(llmi, None)
            assert admitted(policies, pod, closed, (namespace, other), namespace) is False
            assert admitted(policies, pod, closed, (namespace, pod), namespace) is multi_pod


def test_a_multi_pod_replica_group_meets_only_itself() -> None:
    llmi = _llmi("qwen-110b-npu-tp4-pp2", replicas=3)
    namespace = "inference"
    policies = _policies(render_children(llmi, SETTINGS))
    for group in range(3):
        leader, worker = _pod_labels(llmi, group, 0), _pod_labels(llmi, group, 1)
        for port in (RENDEZVOUS_PORT, EPHEMERAL_PORT):
            assert admitted(policies, leader, port, (namespace, worker), namespace)
            assert admitted(policies, worker, port, (namespace, leader), namespace)
            for other in {0, 1, 2} - {group}:
                intruder = _pod_labels(llmi, other, 1)
                assert not admitted(policies, leader, port, (namespace, intruder), namespace)
            # The same labels from another namespace are someone else's pods.
            assert not admitted(policies, leader, port, ("other", worker), namespace)


@pytest.mark.parametrize(
    ("changes", "groups"),
    [
        ({"replicas": 3, "rollout": {}}, 4),  # maxSurge 1 by default
        ({"replicas": 3, "rollout": {"maxSurge": "50%", "maxUnavailable": 0}}, 5),
        ({"replicas": 2, "rollout": {"maxSurge": 0, "maxUnavailable": 1}}, 2),
        ({"replicas": 0, "rollout": {}}, 1),
        ({"replicas": 1, "suspend": True}, 0),  # the example: maxSurge 0
    ],
)
def test_every_group_a_rollout_can_create_has_its_policy(
    changes: dict[str, Any], groups: int
) -> None:
    llmi = _llmi("qwen-110b-npu-tp4-pp2", **changes)
    names = [p["metadata"]["name"] for p in _policies(render_children(llmi, SETTINGS))]
    assert names == ["qwen-110b-engine", *(f"qwen-110b-group-{i}" for i in range(groups))]


def test_autoscaled_groups_get_their_policies_before_their_pods() -> None:
    llmi = _llmi(
        "qwen-110b-npu-tp4-pp2",
        replicas=None,
        autoscaling={"minReplicas": 1, "maxReplicas": 8},
    )
    children = render_children(llmi, SETTINGS, autoscaled=5)
    kinds = [c["kind"] for c in children]
    assert kinds.index("LeaderWorkerSet") > max(
        i for i, kind in enumerate(kinds) if kind == "NetworkPolicy"
    )
    assert len(_policies(children)) == 1 + 5  # the example rolls out with maxSurge 0


def test_allowed_clients_close_the_api_to_everyone_else() -> None:
    for name in ("tiny-cpu", "qwen-110b-npu-tp4-pp2"):
        llmi = _llmi(name, **{"server.allowedClients": ALLOWED})
        namespace = llmi.metadata.namespace or "default"
        policies = _policies(render_children(llmi, SETTINGS))
        pod, port = _pod_labels(llmi, 0), llmi.spec.server.port
        assert admitted(policies, pod, port, PROMETHEUS, namespace)
        assert admitted(policies, pod, port, (namespace, {"role": "gateway"}), namespace)
        assert not admitted(policies, pod, port, ("other", {"role": "gateway"}), namespace)
        assert not admitted(policies, pod, port, ("monitoring", {"app": "grafana"}), namespace)
        assert not admitted(policies, pod, RENDEZVOUS_PORT, PROMETHEUS, namespace)
        (api_rule,) = policies[0]["spec"]["ingress"]
        assert api_rule["from"] == ALLOWED


def test_allowed_clients_stay_out_of_the_engine_config() -> None:
    llmi = _llmi("tiny-cpu", **{"server.allowedClients": ALLOWED})
    assert "allowed_clients" not in to_engine_config(llmi.spec).server.model_dump()


@pytest.mark.parametrize(
    "clients",
    [[], [{}], [{"podSelector": {"matchLabels": {"app": "bad value!"}}}], [{"ipBlock": {}}]],
    ids=["empty-list", "empty-peer", "bad-label-value", "unknown-field"],
)
def test_bad_allowed_clients_are_refused(clients: list[Any]) -> None:
    manifest = example_manifest("tiny-cpu", **{"server.allowedClients": copy.deepcopy(clients)})
    problems = validate_object(manifest)
    assert problems and all(p.path.startswith("spec.server.allowedClients") for p in problems)
    with pytest.raises(ValidationError):
        LLMInference.model_validate(manifest)
