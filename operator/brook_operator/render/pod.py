"""The engine pod: one container running ``brook-engine serve`` on the mounted config, with
its devices, rendezvous and HCCL settings, probes, volumes and a restricted security
context."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from brook_operator.api import API_KEY_PATH, LLMInference, topology
from brook_operator.api.pod_overrides import Container, PodOverrides, Volume
from brook_operator.render.config_map import ENGINE_CONFIG_FILE, config_map_name
from brook_operator.render.labels import ROLE_LABEL, child_labels
from brook_operator.render.model_source import (
    FETCH_CONTAINER,
    model_source,
    restricted_container_context,
)
from brook_operator.render.settings import RENDEZVOUS_PORT, OperatorSettings

CONFIG_DIR = "/etc/brook"
ENGINE_CONTAINER = "engine"
#: Name of the engine container's API port (probes, the Service and the autoscaler's
#: scrape find it by this name).
HTTP_PORT = "http"
#: LeaderWorkerSet's label holding a pod's index inside its group (0 = the leader), and the
#: env var it injects with the leader's address.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
#: Non-root user of the engine image.
ENGINE_UID = 1000

Role = Literal["leader", "worker"]


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(llmi: LLMInference, multi_pod: bool) -> list[dict[str, Any]]:
    spec = llmi.spec
    shape = topology(spec)
    env: list[dict[str, Any]] = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        # torch.distributed rendezvous: the replica's leader runs the TCP store; a pod's
        # first global rank is POD_RANK × DEVICES_PER_POD.
        {"name": "BROOK_WORLD_SIZE", "value": str(shape.devices_per_replica)},
        {"name": "BROOK_NUM_PODS", "value": str(shape.pods_per_replica)},
        {"name": "BROOK_DEVICES_PER_POD", "value": str(shape.devices_per_pod)},
    ]
    if multi_pod:
        env += [
            _field_env("BROOK_POD_RANK", f"metadata.labels['{LWS_WORKER_INDEX_LABEL}']"),
            # LeaderWorkerSet puts its variables first in the container's env, so this
            # reference expands to the group leader's DNS name.
            {"name": "MASTER_ADDR", "value": f"$({LWS_LEADER_ADDRESS_ENV})"},
        ]
    else:
        env += [
            {"name": "BROOK_POD_RANK", "value": "0"},
            {"name": "MASTER_ADDR", "value": "127.0.0.1"},
        ]
    env.append({"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)})
    if spec.accelerator.type == "npu":
        hccl = spec.accelerator.hccl
        env.append({"name": "HCCL_IF_IP", "value": "$(POD_IP)"})
        if hccl.socket_ifname:
            env.append({"name": "HCCL_SOCKET_IFNAME", "value": hccl.socket_ifname})
        env += [
            {"name": "HCCL_CONNECT_TIMEOUT", "value": str(hccl.connect_timeout_seconds)},
            {"name": "HCCL_BUFFSIZE", "value": str(hccl.buffer_size_mb)},
        ]
    env.append({"name": "HOME", "value": "/tmp"})
    return env


def _resources(llmi: LLMInference) -> dict[str, Any]:
    spec = llmi.spec
    requests: dict[str, Any] = dict(spec.resources.requests)
    limits: dict[str, Any] = dict(spec.resources.limits)
    resource = spec.accelerator.effective_resource_name
    if resource is not None:
        devices = topology(spec).devices_per_pod
        requests[resource] = devices
        limits[resource] = devices
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probes() -> dict[str, Any]:
    return {
        # Loading a large checkpoint takes minutes: up to an hour before liveness applies.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT},
            "periodSeconds": 10,
            "failureThreshold": 360,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": HTTP_PORT},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


#: Seconds a terminating leader keeps serving before its SIGTERM: the time endpoints,
#: kube-proxy and gateways take to stop sending it new requests (the engine then stops
#: answering /ready and drains what it has).
PRESTOP_SLEEP_SECONDS = 5


def termination_grace_seconds(drain_timeout: float) -> int:
    """Above the pre-stop wait and the engine's drain timeout, so SIGKILL never cuts a
    drain short."""
    return PRESTOP_SLEEP_SECONDS + math.ceil(drain_timeout) + 30


def pod_template(llmi: LLMInference, settings: OperatorSettings, role: Role) -> dict[str, Any]:
    spec = llmi.spec
    shape = topology(spec)
    multi_pod = shape.pods_per_replica > 1
    source = model_source(spec, settings)
    port = spec.server.port
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(llmi)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size_limit}},
        *source.volumes,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
        *source.mounts,
    ]
    cache_dir = spec.shapes.cache_dir
    if cache_dir is not None and not (cache_dir + "/").startswith("/tmp/"):
        # compiled graphs outlive a container restart (a crash loop recompiles nothing)
        volumes.append({"name": "compile-cache", "emptyDir": {}})
        mounts.append({"name": "compile-cache", "mountPath": cache_dir})
    if spec.server.api_key_secret_ref is not None:
        ref = spec.server.api_key_secret_ref
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key, "path": API_KEY_PATH.rsplit("/", 1)[1]}],
                },
            }
        )
        mounts.append(
            {"name": "api-key", "mountPath": API_KEY_PATH.rsplit("/", 1)[0], "readOnly": True}
        )
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.image or settings.image_for(spec.accelerator.type),
        "command": ["brook-engine", "serve", "--config", f"{CONFIG_DIR}/{ENGINE_CONFIG_FILE}"],
        "ports": [
            {"name": HTTP_PORT, "containerPort": port, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        ],
        "env": _env(llmi, multi_pod),
        "resources": _resources(llmi),
        "volumeMounts": mounts,
        "securityContext": restricted_container_context(),
        # A crash's last log lines become the termination message, which the operator puts
        # in the Ready condition and `brook deploy --wait` prints.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if role == "leader":
        container.update(_probes())
        # `sleep` from the image (the native sleep action needs Kubernetes 1.30)
        sleep = ["sleep", str(PRESTOP_SLEEP_SECONDS)]
        container["lifecycle"] = {"preStop": {"exec": {"command": sleep}}}
    scheduling = spec.scheduling
    pod_spec: dict[str, Any] = {
        "serviceAccountName": "default",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(
            spec.server.drain_timeout_seconds
        ),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": source.init_containers,
        "containers": [container],
        "volumes": volumes,
    }
    if not source.init_containers:
        del pod_spec["initContainers"]
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations
        ]
    if scheduling.affinity:
        pod_spec["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    scheduler = scheduling.scheduler_name or ("volcano" if scheduling.gang else None)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    annotations: dict[str, str] = {}
    if role == "leader":
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics",
            }
        )
    metadata: dict[str, Any] = {"labels": {**child_labels(llmi), ROLE_LABEL: role}}
    if annotations:
        metadata["annotations"] = annotations
    if spec.pod is not None:
        _add_overrides(spec.pod, metadata, pod_spec, container)
    return {"metadata": metadata, "spec": pod_spec}


def _add_overrides(
    pod: PodOverrides, metadata: dict[str, Any], pod_spec: dict[str, Any], engine: dict[str, Any]
) -> None:
    """``spec.pod`` added to the rendered pod: the validation already refused every name and
    path the operator uses, so adding never replaces the operator's own. The environment and
    mounts reach the model download too (a Hub mirror, a proxy, a CA bundle)."""
    if pod.labels:
        metadata["labels"] = {**pod.labels, **metadata["labels"]}
    if pod.annotations:
        metadata["annotations"] = {**pod.annotations, **metadata.get("annotations", {})}
    if pod.service_account_name:
        pod_spec["serviceAccountName"] = pod.service_account_name
    pod_spec["automountServiceAccountToken"] = pod.automount_service_account_token
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in pod.image_pull_secrets]
    if pod.runtime_class_name:
        pod_spec["runtimeClassName"] = pod.runtime_class_name
    env = [v.model_dump(by_alias=True, exclude_none=True) for v in pod.env]
    mounts = [
        m.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
        | {"name": m.name, "mountPath": m.mount_path}
        for m in pod.volume_mounts
    ]
    fetch = [c for c in pod_spec.get("initContainers", []) if c["name"] == FETCH_CONTAINER]
    for container in [engine, *fetch]:
        container["env"] = [*container.get("env", []), *env]
        if pod.env_from:
            container["envFrom"] = list(pod.env_from)
        container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
    pod_spec["volumes"] += [_passed(v) for v in pod.volumes]
    if pod.init_containers:
        extra = [_passed(c) for c in pod.init_containers]
        pod_spec["initContainers"] = [*pod_spec.get("initContainers", []), *extra]
    pod_spec["containers"] += [_passed(c) for c in pod.sidecars]
    for key, items in (
        ("topologySpreadConstraints", pod.topology_spread_constraints),
        ("hostAliases", pod.host_aliases),
    ):
        if items:
            pod_spec[key] = list(items)


def _passed(obj: Volume | Container) -> dict[str, Any]:
    """A passed-through Kubernetes object as written."""
    return obj.model_dump(by_alias=True)


def http_port(pod: Mapping[str, Any]) -> int | None:
    """The port of a running engine pod's container port named ``http`` (the API and
    /metrics), as rendered above."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == HTTP_PORT and port.get("containerPort"):
                return int(port["containerPort"])
    return None
