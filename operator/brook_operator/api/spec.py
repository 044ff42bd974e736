"""``LLMInference.spec``: the engine's own configuration sections, plus what Kubernetes needs
to run them (image, replicas or autoscaling, accelerator, scheduling, rollout)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from brook_engine.config import (
    MODEL_URI_SCHEMES,
    ApiKeyConfig,
    EngineConfig,
    EngineSections,
    ModelConfig,
    Section,
    ServerConfig,
    ServerOptions,
)
from brook_engine.config.supported import unsupported_settings
from brook_operator.api.autoscaling import AutoscalingSpec
from brook_operator.api.kube import (
    LABEL_VALUE,
    ResourcesSpec,
    RolloutSpec,
    SchedulingSpec,
    SecretKeyRef,
)
from brook_operator.api.pod_overrides import PodOverrides, pod_problems
from brook_operator.api.router import RouterSpec

#: Where the operator mounts the API key Secret in the engine container.
API_KEY_PATH = "/var/run/secrets/brook/api-key"

MODEL_URI_PATTERN = rf"^({'|'.join(MODEL_URI_SCHEMES)})://.+$"

#: The accelerator resource each device type requests unless spec.accelerator says otherwise.
DEFAULT_RESOURCE_NAMES = {"npu": "huawei.com/Ascend910", "cuda": "nvidia.com/gpu", "cpu": None}


class ModelCache(Section):
    """A shared model cache: a PersistentVolumeClaim every replica mounts."""

    claim_name: str = Field(
        min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
    )
    """A ReadWriteMany claim in the resource's namespace (NFS, CephFS, a cloud file share).
    The first pod to start downloads the model into a folder of it named after the model and
    revision; the others wait for that download and find it complete; later restarts and new
    replicas download nothing."""


class ModelSpec(ModelConfig):
    """The model: its source, and how the engine loads it."""

    uri: str = Field(min_length=1, max_length=1024, pattern=MODEL_URI_PATTERN)
    """Where the model comes from: pvc://CLAIM/PATH (a PersistentVolumeClaim), hf://ORG/NAME
    (Hugging Face Hub, with revision), s3://BUCKET/PREFIX, oci://REGISTRY/REPO:TAG (an OCI
    artifact), or file://PATH (a folder inside the image)."""

    credentials_secret_ref: SecretKeyRef | None = None
    """Secret key holding the token for hf://, s3:// or oci:// (never logged)."""

    include: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        default=None, min_length=1, max_length=32
    )
    """For hf:// and s3://: the file patterns to download (default: what the engine reads —
    *.json, *.safetensors and the tokenizer's files — not the GGUF, .bin or ONNX copies many
    repositories also carry)."""

    exclude: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=32
    )
    """For hf:// and s3://: file patterns not to download, even where include matches."""

    cache: ModelCache | None = None
    """For hf://: download once into a shared claim that every replica mounts, instead of
    into each pod's own emptyDir at each start."""


#: The model fields only the operator reads (where and how to download), not the engine.
FETCH_FIELDS = frozenset({"credentials_secret_ref", "include", "exclude", "cache"})


class LabelSelector(Section):
    """Objects by their labels: those that carry every label listed (all when empty)."""

    match_labels: dict[str, Annotated[str, LABEL_VALUE]] = Field(
        default_factory=dict, max_length=32
    )
    """Labels the object must carry, every one of them."""


class ClientPeer(Section):
    """Clients by label, as a Kubernetes NetworkPolicyPeer: podSelector alone picks pods of
    this resource's namespace, namespaceSelector alone every pod of those namespaces, both
    together those pods in those namespaces. Set at least one."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1})

    pod_selector: LabelSelector | None = None
    """The client pods, by label."""

    namespace_selector: LabelSelector | None = None
    """The client namespaces, by label (`kubernetes.io/metadata.name` names one)."""

    @model_validator(mode="after")
    def _some_selector(self) -> ClientPeer:
        if self.pod_selector is None and self.namespace_selector is None:
            raise ValueError("set podSelector, namespaceSelector or both")
        return self


class ServerSpec(ServerOptions):
    """The engine's HTTP server inside the pod (it listens on all interfaces)."""

    api_key_secret_ref: SecretKeyRef | None = None
    """Secret key holding the API key clients must send as a bearer token; no key when
    unset."""

    allowed_clients: list[ClientPeer] | None = Field(default=None, min_length=1, max_length=32)
    """Who may reach the API port, which also serves /metrics (the engine pods' NetworkPolicy):
    any pod or namespace one entry selects. Anyone when unset. List Prometheus, and with
    autoscaling the Brook operator's pods, here too. The replica's rendezvous and collective
    ports are open only to the pods of its own replica, whatever this says."""


class HcclSpec(Section):
    """Settings of Huawei's collective library between NPUs (ignored on other devices)."""

    socket_ifname: str | None = Field(default=None, max_length=64)
    """Network interface HCCL uses between pods (HCCL_SOCKET_IFNAME); the pod's default
    interface when unset."""

    connect_timeout_seconds: int = Field(default=120, ge=1, le=7200)
    """HCCL_CONNECT_TIMEOUT: how long ranks wait for one another at start-up."""

    buffer_size_mb: int = Field(default=200, ge=1, le=65536)
    """HCCL_BUFFSIZE: communication buffer per rank, in MB."""


class AcceleratorSpec(Section):
    """The devices each replica runs on."""

    type: Literal["npu", "cuda", "cpu"] = "npu"
    """npu (Ascend through torch-npu), cuda (NVIDIA) or cpu."""

    resource_name: str | None = Field(
        default=None, max_length=253, pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9._-]+$"
    )
    """Extended resource requested per device; huawei.com/Ascend910 for npu and
    nvidia.com/gpu for cuda when unset."""

    devices_per_node: int = Field(default=8, ge=1, le=64)
    """Devices on one node: a replica needing more spans several pods (LeaderWorkerSet)."""

    hccl: HcclSpec = Field(default_factory=HcclSpec)
    """HCCL settings for NPU replicas."""

    @property
    def effective_resource_name(self) -> str | None:
        if self.resource_name is not None:
            return self.resource_name
        return DEFAULT_RESOURCE_NAMES[self.type]


class _SpecHead(Section):
    """``LLMInferenceSpec``'s first fields: a base listed after ``EngineSections`` only so
    that they come before the engine sections (pydantic lists inherited fields first)."""

    model: ModelSpec
    """The model to serve."""

    image: str | None = Field(default=None, min_length=1, max_length=1024)
    """Engine container image; the operator's default image when unset."""

    replicas: int | None = Field(default=None, ge=0, le=1000)
    """Fixed number of replicas (1 when neither this nor autoscaling is set)."""

    autoscaling: AutoscalingSpec | None = None
    """Size the replica count from the engines' metrics instead of spec.replicas."""

    suspend: bool = False
    """Scale every replica to zero, keeping the resource."""

    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec)
    """The devices each replica runs on."""


class LLMInferenceSpec(EngineSections, _SpecHead):
    """Desired state of an LLMInference: a model served by replicas of the Brook engine."""

    server: ServerSpec = Field(default_factory=ServerSpec)
    """The engine's HTTP server."""

    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """CPU and memory of the engine container."""

    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Node selection, tolerations and gang scheduling."""

    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """How spec changes roll out."""

    router: RouterSpec | None = None
    """Route through the Gateway API Inference Extension: an InferencePool of the replicas
    (and an HTTPRoute from your Gateways) whose endpoint picker chooses a replica per request
    from the engines' queue and KV-cache usage."""

    pod: PodOverrides | None = None
    """Added to every engine pod: environment, volumes and mounts, service account, image
    pull secrets, runtime class, labels, annotations, sidecars, init containers. The
    operator's own parts are protected: naming one is refused with the field that sets it."""

    @model_validator(mode="after")
    def _kubernetes_rules(self) -> LLMInferenceSpec:
        problems = spec_problems(self) + unsupported_settings(self)
        if problems:
            raise ValueError("; ".join(problems))
        try:
            to_engine_config(self)  # the engine's own cross-section rules
        except ValidationError as exc:
            raise ValueError(
                "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            ) from None
        return self


def spec_problems(spec: LLMInferenceSpec) -> list[str]:
    """The spec's cross-field rules (the CRD's CEL rules say the same to the API server)."""
    problems: list[str] = []
    if spec.replicas is not None and spec.autoscaling is not None:
        problems.append(
            "replicas: set replicas or autoscaling, not both; with autoscaling the replica "
            "count belongs to the autoscaler (change autoscaling.minReplicas/maxReplicas)"
        )
    devices = spec.parallel.world_size
    per_node = spec.accelerator.devices_per_node
    if devices > per_node and (devices % per_node or per_node % spec.parallel.tensor):
        problems.append(
            f"parallel: tensor × pipeline = {devices} devices neither fits one node "
            f"(accelerator.devicesPerNode = {per_node}) nor fills whole nodes; use a multiple "
            f"of {per_node} devices with tensor dividing {per_node}"
        )
    if spec.scheduling.gang is not None and spec.scheduling.scheduler_name not in (None, "volcano"):
        problems.append(
            "scheduling.schedulerName: gang scheduling runs on the volcano scheduler; leave "
            "schedulerName unset or set it to volcano"
        )
    if spec.shapes.one_row_weights != "model" and spec.accelerator.type != "cpu":
        problems.append(
            "shapes.oneRowWeights: one-row copies are read by Brook's CPU kernels; with an "
            "npu or cuda accelerator use model"
        )
    server = spec.server
    keyed_metrics = server.metrics_require_api_key and server.api_key_secret_ref is not None
    if spec.autoscaling is not None and keyed_metrics:
        problems.append(
            "server.metricsRequireApiKey: the autoscaler reads the engines' /metrics without "
            "the key, so it would see no metrics and hold the size; with autoscaling leave "
            "metricsRequireApiKey off and limit who reaches /metrics with "
            "server.allowedClients"
        )
    rollout = spec.rollout
    if str(rollout.max_surge) in ("0", "0%") and str(rollout.max_unavailable) in ("0", "0%"):
        problems.append("rollout: maxSurge and maxUnavailable cannot both be 0")
    scheme = spec.model.uri.split("://", 1)[0].lower()
    if spec.model.cache is not None and scheme != "hf":
        problems.append(
            f"model.cache: the shared cache holds hf:// downloads; a {scheme}:// model "
            "needs none (pvc://, file://) or is not cached yet (s3://, oci://): remove cache"
        )
    if (spec.model.include is not None or spec.model.exclude) and scheme not in ("hf", "s3"):
        problems.append(
            f"model.include: file patterns filter hf:// and s3:// downloads; a {scheme}:// "
            "model is used as it is: remove include and exclude"
        )
    if spec.router is not None and spec.router.hostnames and not spec.router.gateways:
        problems.append(
            "router.hostnames: host names are matched by the HTTPRoute, which gateways make; "
            "give router.gateways or remove hostnames"
        )
    if spec.pod is not None:
        problems += pod_problems(spec.pod)
        cache = spec.shapes.cache_dir
        for mount in spec.pod.volume_mounts:
            if cache and mount.mount_path in (cache, cache + "/"):
                problems.append(
                    f"pod.volumeMounts: {mount.mount_path} is shapes.cacheDir, where the "
                    "operator mounts the compile cache; mount elsewhere"
                )
    if spec.accelerator.effective_resource_name is not None:
        for kind in ("requests", "limits"):
            if spec.accelerator.effective_resource_name in getattr(spec.resources, kind):
                problems.append(
                    f"resources.{kind}: remove {spec.accelerator.effective_resource_name}; "
                    "the operator requests it from parallel and accelerator"
                )
    return problems


def to_engine_config(spec: LLMInferenceSpec) -> EngineConfig:
    """The ``EngineConfig`` an engine pod of this spec runs with: the spec's engine sections
    as they are, the device from the accelerator, and what only exists inside the pod (all
    interfaces, the mounted API key)."""
    model = ModelConfig.model_validate(
        spec.model.model_dump(exclude=set(FETCH_FIELDS), by_alias=False)
    )
    server = ServerConfig(
        **spec.server.model_dump(exclude={"api_key_secret_ref", "allowed_clients"}, by_alias=False),
        host="0.0.0.0",
        api_key=ApiKeyConfig(file=API_KEY_PATH) if spec.server.api_key_secret_ref else None,
    )
    sections = {name: getattr(spec, name) for name in EngineSections.model_fields}
    return EngineConfig(model=model, device=spec.accelerator.type, server=server, **sections)
