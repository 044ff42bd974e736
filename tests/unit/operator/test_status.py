"""Status and conditions from what the workload reports (pure functions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from brook_operator.api import LLMInference
from brook_operator.controller.conditions import (
    Observed,
    compute_status,
    invalid_status,
    spec_error,
)
from brook_operator.controller.reconcile import parse

ROOT = Path(__file__).resolve().parents[3]


def _llmi(name: str = "tiny-cpu", generation: int = 3) -> LLMInference:
    obj = yaml.safe_load((ROOT / "crds" / "examples" / f"{name}.yaml").read_text())
    obj["metadata"].update(uid="u-1", generation=generation, namespace="ai")
    return LLMInference.model_validate(obj)


def _deployment(generation: int, observed: int, **status: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {"observedGeneration": observed, **status},
    }


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_ready_when_every_desired_replica_is_ready() -> None:
    workload = _deployment(2, 2, replicas=1, readyReplicas=1, updatedReplicas=1)
    status = compute_status(_llmi(), Observed(workload, desired_replicas=1), None, now="T1")
    conditions = _conditions(status)
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["status"] == "False"
    assert conditions["SpecValid"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    assert status["observedGeneration"] == 3
    assert status["readyReplicas"] == 1 and status["replicas"] == 1
    assert status["endpoint"] == "http://tiny-cpu.ai.svc:8000/v1"
    assert status["selector"] == (
        "app.kubernetes.io/name=brook-engine,brook.dev/llminference=tiny-cpu,brook.dev/role=leader"
    )
    assert status["topology"]["workload"] == "Deployment"


def test_progressing_while_the_rollout_runs_and_transition_times_move_only_on_change() -> None:
    llmi = _llmi()
    rolling = _deployment(3, 2, replicas=2, readyReplicas=1, updatedReplicas=0)
    first = compute_status(llmi, Observed(rolling, desired_replicas=2), None, now="T1")
    assert _conditions(first)["Progressing"]["status"] == "True"
    assert _conditions(first)["Ready"]["message"] == "1/2 replicas ready"
    again = compute_status(llmi, Observed(rolling, desired_replicas=2), first, now="T2")
    assert _conditions(again)["Ready"]["lastTransitionTime"] == "T1"
    done = _deployment(3, 3, replicas=2, readyReplicas=2, updatedReplicas=2)
    after = compute_status(llmi, Observed(done, desired_replicas=2), again, now="T3")
    assert _conditions(after)["Ready"]["status"] == "True"
    assert _conditions(after)["Ready"]["lastTransitionTime"] == "T3"
    assert _conditions(after)["Progressing"]["status"] == "False"


def test_missing_leader_worker_set_api_is_degraded_with_its_reason() -> None:
    llmi = _llmi("qwen-110b-npu-tp4-pp2")
    status = compute_status(llmi, Observed(None, desired_replicas=1, lws_missing=True), None)
    degraded = _conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert "leaderworkerset.x-k8s.io" in degraded["message"]
    assert _conditions(status)["Ready"]["status"] == "False"


def test_invalid_spec_names_the_field_and_keeps_its_other_fields() -> None:
    """Status is applied server-side by one writer per set of fields: the invalid status
    holds every field of the reconciler's (those it left out would be removed) as it was,
    and none of the autoscaler's (which stays on the server, owned by the autoscaler)."""
    body = yaml.safe_load((ROOT / "crds" / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"]["generation"] = 4
    body["spec"]["parallel"] = {"tensor": 0}
    degraded = {"type": "Degraded", "status": "False", "reason": "AsExpected"}
    body["status"] = {
        "replicas": 2,
        "selector": "a=b",
        "conditions": [{"type": "ScalingActive", "status": "True"}, degraded],
    }
    with pytest.raises(ValidationError) as caught:
        parse(body)
    message = spec_error(caught.value)
    assert "spec.parallel.tensor" in message
    status = invalid_status(body, message, now="T")
    conditions = _conditions(status)
    assert conditions["SpecValid"]["status"] == "False"
    assert conditions["SpecValid"]["reason"] == "InvalidSpec"
    assert "spec.parallel.tensor" in conditions["SpecValid"]["message"]
    assert conditions["Degraded"] == degraded
    assert "ScalingActive" not in conditions
    assert (status["replicas"], status["selector"]) == (2, "a=b")
    assert status["observedGeneration"] == 4


def test_suspended_resource_is_not_ready_for_that_reason() -> None:
    llmi = _llmi().model_copy(update={"spec": _llmi().spec.model_copy(update={"suspend": True})})
    workload = _deployment(1, 1, replicas=0)
    ready = _conditions(compute_status(llmi, Observed(workload, desired_replicas=0)))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "Suspended")


def _problem_pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def test_ready_says_why_with_the_pods_reasons_and_kstatus_follows() -> None:
    from brook_operator.controller.pod_reasons import pod_problems

    workload = _deployment(2, 2, replicas=3, readyReplicas=1, updatedReplicas=3)
    crash = _problem_pod(
        "tiny-cpu-a",
        containerStatuses=[
            {
                "name": "engine",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {
                    "terminated": {
                        "exitCode": 1,
                        "message": "loading...\nConfigError: model.uri: no config.json",
                    }
                },
            }
        ],
    )
    pending = _problem_pod(
        "tiny-cpu-b",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient huawei.com/Ascend910.",
            }
        ],
    )
    problems = tuple(p for pod in (pending, crash) for p in pod_problems(pod))
    observed = Observed(workload, desired_replicas=3, pod_problems=problems)
    conditions = _conditions(compute_status(_llmi(), observed, None, now="T1"))
    ready = conditions["Ready"]
    assert ready["status"] == "False"
    assert ready["reason"] == "CrashLoopBackOff"  # the one that will not clear by itself
    assert ready["message"].startswith("1/3 replicas ready: pod tiny-cpu-b: Unschedulable")
    assert "exit code 1: ConfigError: model.uri: no config.json" in ready["message"]
    assert conditions["Stalled"]["status"] == "True"
    assert conditions["Stalled"]["reason"] == "CrashLoopBackOff"
    assert conditions["Reconciling"]["status"] == "False"

    # only a pod no node can take yet: not stalled (a node may come), reconciling
    waiting = Observed(workload, desired_replicas=3, pod_problems=pod_problems_of(pending))
    conditions = _conditions(compute_status(_llmi(), waiting, None, now="T1"))
    assert conditions["Ready"]["reason"] == "Unschedulable"
    assert "Insufficient huawei.com/Ascend910" in conditions["Ready"]["message"]
    assert conditions["Stalled"]["status"] == "False"
    assert conditions["Reconciling"]["status"] == "True"

    # every replica ready: neither
    done = _deployment(2, 2, replicas=3, readyReplicas=3, updatedReplicas=3)
    conditions = _conditions(compute_status(_llmi(), Observed(done, 3), None, now="T1"))
    assert conditions["Reconciling"]["status"] == conditions["Stalled"]["status"] == "False"


def pod_problems_of(pod: dict[str, Any]) -> tuple[Any, ...]:
    from brook_operator.controller.pod_reasons import pod_problems

    return tuple(pod_problems(pod))


def test_an_invalid_spec_is_stalled() -> None:
    body = {"metadata": {"generation": 2}, "spec": {}, "status": {}}
    conditions = _conditions(invalid_status(body, "spec.model: Field required", now="T1"))
    assert conditions["Stalled"]["status"] == "True"
    assert conditions["Stalled"]["reason"] == "InvalidSpec"
    assert conditions["Reconciling"]["status"] == "False"


def test_reconciling_lasts_until_the_rollout_replaced_every_replica() -> None:
    # the spec changed (workload generation 3, its controller has seen 2): the old pods
    # still answer, but the new generation is not rolled out
    rolling = _deployment(3, 2, replicas=3, readyReplicas=3, updatedReplicas=0)
    conditions = _conditions(compute_status(_llmi(), Observed(rolling, 3), None, now="T1"))
    assert conditions["Progressing"]["status"] == "True"
    assert conditions["Reconciling"]["status"] == "True"
    assert conditions["Reconciling"]["reason"] == "RollingOut"
    done = _deployment(3, 3, replicas=3, readyReplicas=3, updatedReplicas=3)
    conditions = _conditions(compute_status(_llmi(), Observed(done, 3), None, now="T1"))
    assert conditions["Reconciling"]["status"] == "False"


def test_a_crash_loop_seen_while_running_and_pods_never_created_are_reasons() -> None:
    from brook_operator.controller.pod_reasons import pod_problems

    # a model that loads for longer than the back-off: running now, three failed starts
    loading = _problem_pod(
        "tiny-cpu-a",
        containerStatuses=[
            {
                "name": "engine",
                "restartCount": 3,
                "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
            }
        ],
    )
    [problem] = pod_problems(loading)
    assert problem.reason == "RestartingOnErrors" and problem.fatal
    assert "3 restart(s); last exit code 137" in problem.message
    # a first image pull error may be a registry's hiccup: a reason, not a verdict
    pulling = _problem_pod(
        "tiny-cpu-b",
        containerStatuses=[{"name": "engine", "state": {"waiting": {"reason": "ErrImagePull"}}}],
    )
    [problem] = pod_problems(pulling)
    assert problem.reason == "ErrImagePull" and not problem.fatal
    # admission refused the pods: the Deployment's ReplicaFailure names why
    refused = _deployment(2, 2, replicas=0, readyReplicas=0, updatedReplicas=0)
    refused |= {"kind": "Deployment", "metadata": {"name": "tiny-cpu", "generation": 2}}
    refused["status"]["conditions"] = [
        {
            "type": "ReplicaFailure",
            "status": "True",
            "reason": "FailedCreate",
            "message": 'pods "tiny-cpu-x" is forbidden: violates PodSecurity "restricted"',
        }
    ]
    conditions = _conditions(compute_status(_llmi(), Observed(refused, 1), None, now="T1"))
    assert conditions["Ready"]["reason"] == "FailedCreate"
    assert (
        'deployment tiny-cpu: FailedCreate (pods "tiny-cpu-x" is forbidden'
        in (conditions["Ready"]["message"])
    )
    assert conditions["Stalled"]["status"] == "True"
