"""``brook deploy`` against the emulated kube-apiserver: it applies under its own field
manager, and with ``--wait`` follows the rollout to Ready (exit 0) or stops with the pods'
reason — an image that cannot be pulled, a crash loop with the engine's last error line (exit
3) — or times out naming what holds it (exit 4). The emulated server runs no controllers:
the test writes the status the operator would write and the pods the kubelet would report."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from brook_operator.cli import main
from support.kube_api import KubeApi

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "crds" / "examples" / "tiny-cpu.yaml"
NAME, NAMESPACE = "tiny-cpu", "default"


class Deploy:
    """``brook deploy ARGS`` on a thread; ``result()`` its exit code."""

    def __init__(self, *args: str) -> None:
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(list(args),), daemon=True)
        self.thread.start()

    def _run(self, args: list[str]) -> None:
        self.code = main(["deploy", "-f", str(EXAMPLE), *args])

    def result(self, timeout: float = 60) -> int | None:
        self.thread.join(timeout)
        return self.code


def _wait_for_resource(api: KubeApi) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while (obj := api.get("llmi", NAME, NAMESPACE)) is None:
        assert time.monotonic() < deadline, "brook deploy did not apply the resource"
        time.sleep(0.05)
    return obj


def _report_pod(
    api: KubeApi, container_status: dict[str, Any], conditions: list[dict[str, Any]] | None = None
) -> None:
    """An engine pod as the kubelet reports it (created, then its status written)."""
    pod = _pod(container_status, conditions)
    status = pod.pop("status")
    api.create(pod)
    api.set_status("pods", pod["metadata"]["name"], status, NAMESPACE)


def _pod(container_status: dict[str, Any], conditions: list[dict[str, Any]] | None = None) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{NAME}-abc12",
            "namespace": NAMESPACE,
            "labels": {"brook.dev/llminference": NAME, "brook.dev/role": "leader"},
        },
        "spec": {"containers": [{"name": "engine", "image": "brook-engine:x"}]},
        "status": {
            "phase": "Pending",
            "conditions": conditions or [],
            "containerStatuses": [{"name": "engine", **container_status}],
        },
    }


def test_wait_follows_the_rollout_to_ready(
    brook_crd: dict[str, Any], kube_api: KubeApi, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = Deploy("--wait", "--timeout", "30")
    obj = _wait_for_resource(kube_api)
    managers = {m["manager"] for m in obj["metadata"]["managedFields"]}
    assert "brook-deploy" in managers and "brook-operator" not in managers
    time.sleep(0.3)  # a first progress line, before the operator's status
    kube_api.set_status(
        "llmi",
        NAME,
        {
            "observedGeneration": obj["metadata"]["generation"],
            "readyReplicas": 1,
            "desiredReplicas": 1,
            "endpoint": "http://tiny-cpu.default.svc:8000/v1",
            "conditions": [
                {"type": "SpecValid", "status": "True", "reason": "Valid", "message": "ok"},
                {"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": "1/1"},
            ],
        },
        NAMESPACE,
    )
    assert deploy.result() == 0
    out = capsys.readouterr().out
    assert "LLMInference/tiny-cpu in default: applied" in out
    assert "waiting for the operator" in out
    assert "ready: http://tiny-cpu.default.svc:8000/v1" in out


@pytest.mark.parametrize(
    ("container_status", "shown"),
    [
        (
            {
                "state": {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": 'Back-off pulling image "brook-engine:x"',
                    }
                }
            },
            "container engine: ImagePullBackOff (Back-off pulling image",
        ),
        (
            {
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {
                    "terminated": {
                        "exitCode": 1,
                        "reason": "Error",
                        "message": "Traceback ...\nConfigError: parallel.tensor (3) must "
                        "divide the model's 4 attention heads\n",
                    }
                },
                "restartCount": 3,
            },
            "CrashLoopBackOff (exit code 1: ConfigError: parallel.tensor (3) must divide",
        ),
    ],
    ids=["image-pull", "crash-loop"],
)
def test_a_pod_that_will_not_recover_fails_the_wait_with_its_reason(
    container_status: dict[str, Any],
    shown: str,
    brook_crd: dict[str, Any],
    kube_api: KubeApi,
    capsys: pytest.CaptureFixture[str],
) -> None:
    deploy = Deploy("--wait", "--timeout", "30")
    _wait_for_resource(kube_api)
    _report_pod(kube_api, container_status)
    assert deploy.result() == 3
    out = capsys.readouterr().out
    assert "failed: pod tiny-cpu-abc12 " in out and shown in out


def test_an_unschedulable_pod_is_shown_until_the_timeout(
    brook_crd: dict[str, Any], kube_api: KubeApi, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = Deploy("--wait", "--timeout", "2")
    _wait_for_resource(kube_api)
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient huawei.com/Ascend910.",
    }
    _report_pod(kube_api, {"state": {"waiting": {"reason": "ContainerCreating"}}}, [unschedulable])
    assert deploy.result() == 4
    out = capsys.readouterr().out
    assert "timed out after 2 s" in out
    assert "Unschedulable (0/3 nodes are available: 3 Insufficient huawei.com/Ascend910.)" in out


def test_dry_run_stores_nothing_and_an_invalid_manifest_is_not_sent(
    brook_crd: dict[str, Any], kube_api: KubeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["deploy", "-f", str(EXAMPLE), "--dry-run"]) == 0
    assert "valid on the server (dry run)" in capsys.readouterr().out
    assert kube_api.get("llmi", NAME, NAMESPACE) is None
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("maxNumSeqs: 16", "maxNumSeqs: 0"))
    kube_api.clear_requests()
    assert main(["deploy", "-f", str(bad)]) == 1
    assert "maxNumSeqs" in capsys.readouterr().err
    assert not [r for r in kube_api.requests if r.method == "PATCH"]
