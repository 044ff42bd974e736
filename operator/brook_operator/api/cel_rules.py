"""The CRD's CEL rules (``x-kubernetes-validations``), one list per model.

Each rule is the API server's twin of a pydantic validator, so a manifest is refused the same
way by ``kubectl apply`` and by ``brook validate`` (which evaluates these very rules). Rules
run after defaulting, so fields with defaults are always present; optional fields are guarded
with ``has()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from brook_engine.config import (
    KVCacheConfig,
    LayerPolicy,
    MoEConfig,
    OffloadConfig,
    SchedulerConfig,
)
from brook_operator.api.autoscaling import MAX_HISTORY_SECONDS, AutoscalingSpec, HistorySpec
from brook_operator.api.kube import RolloutSpec
from brook_operator.api.pod_overrides import (
    OPERATOR_ANNOTATION_PREFIXES,
    OPERATOR_CONTAINERS,
    OPERATOR_ENV,
    OPERATOR_ENV_PREFIX,
    OPERATOR_LABEL_PREFIXES,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUMES,
    PodOverrides,
)
from brook_operator.api.spec import LLMInferenceSpec


@dataclass(frozen=True)
class Rule:
    rule: str
    message: str
    field_path: str | None = None

    def to_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


_DEVICES = "self.parallel.tensor * self.parallel.pipeline"
_RESOURCE = (
    "(has(self.accelerator.resourceName) ? self.accelerator.resourceName : "
    "self.accelerator.type == 'npu' ? 'huawei.com/Ascend910' : "
    "self.accelerator.type == 'cuda' ? 'nvidia.com/gpu' : '')"
)
_PER_NODE = "self.accelerator.devicesPerNode"


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


CEL_RULES: dict[type[BaseModel], list[Rule]] = {
    LLMInferenceSpec: [
        Rule(
            "!has(self.router) || size(self.router.hostnames) == 0 || "
            "size(self.router.gateways) > 0",
            "router.hostnames: host names are matched by the HTTPRoute, which gateways make; "
            "give router.gateways or remove hostnames",
            ".router.hostnames",
        ),
        Rule(
            "!has(self.model.cache) || self.model.uri.startsWith('hf://')",
            "model.cache: the shared cache holds hf:// downloads; remove cache for other "
            "sources (pvc:// and file:// need none; s3:// and oci:// are not cached yet)",
            ".model.cache",
        ),
        Rule(
            "(!has(self.model.include) && size(self.model.exclude) == 0) || "
            "self.model.uri.startsWith('hf://') || self.model.uri.startsWith('s3://')",
            "model.include: file patterns filter hf:// and s3:// downloads; remove include and "
            "exclude for other sources",
            ".model.include",
        ),
        Rule(
            "!has(self.pod) || !has(self.shapes.cacheDir) || "
            "self.pod.volumeMounts.all(m, !(m.mountPath in "
            "[self.shapes.cacheDir, self.shapes.cacheDir + '/']))",
            "pod.volumeMounts: shapes.cacheDir is where the operator mounts the compile cache; "
            "mount elsewhere",
            ".pod.volumeMounts",
        ),
        # What this engine build cannot honour yet (brook_engine.config.supported).
        Rule(
            "self.offload.policy == 'none' || self.shapes.oneRowWeights == 'model'",
            "shapes.oneRowWeights: one-row copies would double the weights that offload "
            "keeps under its budget; use model with weight offload",
            ".shapes.oneRowWeights",
        ),
        Rule(
            "self.quantization.weights == 'none' || self.shapes.oneRowWeights == 'model'",
            "shapes.oneRowWeights: one-row copies are of float weights; with "
            "quantization.weights w8a16 the int8 weights serve one row too — use model",
            ".shapes.oneRowWeights",
        ),
        Rule(
            "self.shapes.oneRowWeights == 'model' || self.accelerator.type == 'cpu'",
            "shapes.oneRowWeights: one-row copies are read by Brook's CPU kernels; with an "
            "npu or cuda accelerator use model",
            ".shapes.oneRowWeights",
        ),
        Rule(
            "!has(self.quantization.groupSize) || self.quantization.weights == 'w8a16'",
            "quantization.groupSize: groups apply to quantized weights; set "
            "quantization.weights: w8a16 or remove groupSize",
            ".quantization.groupSize",
        ),
        Rule(
            f"self.moe.reroute || self.moe.loadThreshold == {MoEConfig().load_threshold}",
            "moe.loadThreshold: applies to rerouting; set moe.reroute: true or remove "
            "moe.loadThreshold",
            ".moe.loadThreshold",
        ),
        *(
            Rule(
                f"self.shapes.mode == 'compile' || {unset}",
                f"shapes.{name}: applies to compiled shapes; set shapes.mode: compile or "
                f"remove shapes.{name}",
                f".shapes.{name}",
            )
            for name, unset in (
                ("patterns", "size(self.shapes.patterns) == 0"),
                ("kernelCacheSize", "self.shapes.kernelCacheSize == 32"),
                ("onlineLearning", "!self.shapes.onlineLearning"),
                ("cacheDir", "!has(self.shapes.cacheDir)"),
            )
        ),
        Rule(
            "!(has(self.autoscaling) && has(self.server) && has(self.server.apiKeySecretRef) && "
            "has(self.server.metricsRequireApiKey) && self.server.metricsRequireApiKey)",
            "the autoscaler reads the engines' /metrics without the key, so it would see no "
            "metrics; with autoscaling leave metricsRequireApiKey off and limit who reaches "
            "/metrics with server.allowedClients",
            ".server.metricsRequireApiKey",
        ),
        Rule(
            "!(has(self.replicas) && has(self.autoscaling))",
            "set replicas or autoscaling, not both: with autoscaling the replica count "
            "belongs to the autoscaler (kubectl scale is refused; change "
            "autoscaling.minReplicas/maxReplicas instead)",
            ".replicas",
        ),
        Rule(
            f"{_DEVICES} <= {_PER_NODE} || ({_DEVICES} % {_PER_NODE} == 0 && "
            f"{_PER_NODE} % self.parallel.tensor == 0)",
            "tensor × pipeline devices must fit one node (accelerator.devicesPerNode) or fill "
            "whole nodes (a multiple of devicesPerNode, with tensor dividing devicesPerNode)",
            ".parallel",
        ),
        Rule(
            "!has(self.model.maxModelLen) || !has(self.kvCache.maxSeqLen) || "
            "self.kvCache.maxSeqLen <= self.model.maxModelLen",
            "must not exceed model.maxModelLen",
            ".kvCache.maxSeqLen",
        ),
        Rule(
            "!has(self.model.maxModelLen) || self.scheduler.chunkedPrefill || "
            "self.scheduler.maxNumBatchedTokens >= self.model.maxModelLen",
            "must be at least model.maxModelLen when chunkedPrefill is off; raise it or turn "
            "chunkedPrefill on",
            ".scheduler.maxNumBatchedTokens",
        ),
        Rule(
            "!has(self.model.maxModelLen) || self.shapes.patterns.all(p, "
            "p.inputLen + p.outputLen <= self.model.maxModelLen)",
            "inputLen + outputLen must not exceed model.maxModelLen",
            ".shapes.patterns",
        ),
        Rule(
            "!has(self.scheduling.gang) || !has(self.scheduling.schedulerName) || "
            "self.scheduling.schedulerName == 'volcano'",
            "gang scheduling runs on the volcano scheduler; leave schedulerName unset or set "
            "it to volcano",
            ".scheduling.schedulerName",
        ),
        Rule(
            f"!({_RESOURCE} in self.resources.requests) && !({_RESOURCE} in self.resources.limits)",
            "must not list the accelerator resource; the operator requests it from parallel "
            "and accelerator",
            ".resources",
        ),
    ],
    AutoscalingSpec: [
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "must not exceed maxReplicas",
            ".minReplicas",
        ),
        Rule(
            "!has(self.standbyReplicas) || self.standbyReplicas < self.maxReplicas",
            "must be below maxReplicas: at least one replica is sized by the signals",
            ".standbyReplicas",
        ),
        Rule(
            "!has(self.standbyReplicas) || self.standbyReplicas == 0 || "
            "has(self.replicaTokensPerSecond)",
            "needs replicaTokensPerSecond: a fleet kept above its need never runs near its "
            "target, where what a replica serves is learned",
            ".standbyReplicas",
        ),
        Rule(
            "!has(self.fallbackReplicas) || (self.fallbackReplicas >= self.minReplicas && "
            "self.fallbackReplicas <= self.maxReplicas)",
            "must lie between minReplicas and maxReplicas",
            ".fallbackReplicas",
        ),
    ],
    HistorySpec: [
        Rule(
            "self.leadSeconds < self.periodSeconds",
            "must be shorter than periodSeconds: a lead of a whole period looks at today",
            ".leadSeconds",
        ),
        Rule(
            f"self.periods * self.periodSeconds <= {MAX_HISTORY_SECONDS}",
            f"times periodSeconds must not exceed {MAX_HISTORY_SECONDS // 86_400} days, more "
            "than its ConfigMap holds; keep fewer periods",
            ".periods",
        ),
    ],
    OffloadConfig: [
        Rule(
            "self.policy == 'none' || has(self.deviceMemoryLimitGb)",
            "required when policy is static or adaptive: the GiB the weights may use",
            ".deviceMemoryLimitGb",
        ),
        Rule(
            "self.priorityLayers.all(k, self.priorityLayers.filter(j, j == k).size() == 1)",
            "lists a kind twice; list each kind once",
            ".priorityLayers",
        ),
    ],
    KVCacheConfig: [
        Rule(
            "!(has(self.memoryFraction) && has(self.numBlocks))",
            "set memoryFraction or numBlocks, not both",
            ".numBlocks",
        ),
        Rule(
            "self.layerPolicies.all(a, self.layerPolicies.filter(b, "
            "a.start < b.end && b.start < a.end).size() == 1)",
            "ranges overlap; make each layer fall in one range",
            ".layerPolicies",
        ),
        Rule(
            "!has(self.prefixSharing.minPrefixLen) || "
            "self.prefixSharing.minPrefixLen % self.blockSize == 0",
            "must be a multiple of kvCache.blockSize (only full blocks are shared)",
            ".prefixSharing.minPrefixLen",
        ),
    ],
    LayerPolicy: [
        Rule("self.start < self.end", "must be below end; ranges are [start, end)", ".start"),
    ],
    SchedulerConfig: [
        Rule(
            "self.maxNumBatchedTokens >= self.maxNumSeqs",
            "must be at least maxNumSeqs (a decode step needs one token per sequence)",
            ".maxNumBatchedTokens",
        ),
    ],
    RolloutSpec: [
        Rule(
            "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
            "maxSurge and maxUnavailable cannot both be 0",
            ".maxSurge",
        ),
        Rule(
            "string(self.maxSurge).matches('^[0-9]{1,3}%?$') && "
            "string(self.maxUnavailable).matches('^[0-9]{1,3}%?$')",
            "maxSurge and maxUnavailable take a count (1) or a percentage (25%)",
            ".maxSurge",
        ),
    ],
    PodOverrides: [
        Rule(
            f"self.env.all(e, !(e.name in {_cel_list(OPERATOR_ENV)}) && "
            f"!e.name.startsWith('{OPERATOR_ENV_PREFIX}'))",
            f"the operator sets {', '.join(OPERATOR_ENV)} and every {OPERATOR_ENV_PREFIX}* "
            "variable (the rendezvous, the devices, accelerator.hccl); change the spec field "
            "that sets it instead",
            ".env",
        ),
        Rule(
            f"self.volumes.all(v, !(v.name in {_cel_list(OPERATOR_VOLUMES)}))",
            f"each volume needs a name other than the operator's ({', '.join(OPERATOR_VOLUMES)})",
            ".volumes",
        ),
        Rule(
            "self.volumeMounts.all(m, self.volumes.exists(v, v.name == m.name))",
            "each mount names one of pod.volumes",
            ".volumeMounts",
        ),
        Rule(
            f"self.volumeMounts.all(m, m.mountPath != '/' && "
            f"!{_cel_list(OPERATOR_MOUNT_PATHS)}.exists(p, m.mountPath == p || "
            "m.mountPath.startsWith(p + '/')))",
            f"the operator mounts its own volumes at {', '.join(OPERATOR_MOUNT_PATHS)}; "
            "mount elsewhere",
            ".volumeMounts",
        ),
        Rule(
            f"self.initContainers.all(c, !(c.name in {_cel_list(OPERATOR_CONTAINERS)}))",
            f"each container needs a name other than the operator's "
            f"({', '.join(OPERATOR_CONTAINERS)})",
            ".initContainers",
        ),
        Rule(
            f"self.sidecars.all(c, !(c.name in {_cel_list(OPERATOR_CONTAINERS)}))",
            f"each container needs a name other than the operator's "
            f"({', '.join(OPERATOR_CONTAINERS)})",
            ".sidecars",
        ),
        Rule(
            "self.sidecars.all(c, !self.initContainers.exists(i, i.name == c.name))",
            "a pod's containers need distinct names: this one is also in initContainers",
            ".sidecars",
        ),
        Rule(
            "self.env.all(e, !(has(e.value) && has(e.valueFrom)))",
            "set value or valueFrom, not both",
            ".env",
        ),
        Rule(
            "self.labels.all(k, "
            + " && ".join(f"!k.startsWith('{p}')" for p in OPERATOR_LABEL_PREFIXES)
            + ")",
            f"the operator owns the label prefixes {', '.join(OPERATOR_LABEL_PREFIXES)} (its "
            "selectors)",
            ".labels",
        ),
        Rule(
            "self.annotations.all(k, "
            + " && ".join(f"!k.startsWith('{p}')" for p in OPERATOR_ANNOTATION_PREFIXES)
            + ")",
            f"the operator owns the annotation prefixes {', '.join(OPERATOR_ANNOTATION_PREFIXES)}",
            ".annotations",
        ),
    ],
}
