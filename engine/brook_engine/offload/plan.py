"""The memory plan: which weights of each rank stay in device memory and which stream, from a
model's ``config.json`` and the engine configuration alone (torch-free, no weights read).

A rank's weights are the *fixed* ones (embedding, final norm, LM head, every layer's two
norms: always resident) and two *pieces* per decoder layer: its attention projections and
its FFN projections. When the budget (``offload.deviceMemoryLimitGb``) holds them all, all
stay. Otherwise the kinds in ``priorityLayers`` are kept resident first (when the whole kind
fits), then as many whole layers as fit, spread over the stage so that each streamed piece
has resident layers' compute in front of it to hide behind; the rest stream through a ring
of ``prefetchLayers + 1`` device slots per streamed kind. Streamed pieces live in the host
pool (``cpuMemoryPoolGb``) and, beyond it, in a spill file on disk.

The engine builds its rank's plan with the same function and its weight ledger holds the
result to the budget, so the plan printed by ``brook-engine plan`` is what runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from brook_engine.config import CPU_KV_CACHE_CAP, ConfigError, EngineConfig, ModelFacts
from brook_engine.config.kv_cache import DEFAULT_MEMORY_FRACTION, kv_bytes_per_token
from brook_engine.parallel.topology import split_layers

PieceKind = Literal["attention", "ffn"]
PIECE_KINDS: tuple[PieceKind, ...] = ("attention", "ffn")
GIB = 1 << 30
#: Every tensor of a streamed piece starts at a multiple of this in its slot.
ALIGN = 64
#: Output channels per tile of Brook's CPU int8 layout (``quant.cpu_int8.TILE``).
INT8_TILE = 16

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Architectures whose attention norms each head's queries and keys (RMSNorm over head_dim)
QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
#: Qwen MoE families: transformers' defaults for (num_experts_per_tok, the shared expert's width)
_QWEN_MOE_DEFAULTS = {"Qwen2MoeForCausalLM": (4, 5632), "Qwen3MoeForCausalLM": (8, 0)}


def has_qkv_bias(data: Mapping[str, Any], architecture: str) -> bool:
    """Whether the q/k/v projections carry a bias: always for Qwen2, as ``qkv_bias`` says
    (default on) for Qwen2-MoE, else as ``attention_bias`` says."""
    if architecture == "Qwen2MoeForCausalLM":
        return bool(data.get("qkv_bias", True))
    return architecture == "Qwen2ForCausalLM" or bool(data.get("attention_bias", False))


@dataclass(frozen=True)
class ExpertShape:
    """A mixture-of-experts model's experts, as its ``config.json`` describes them."""

    num_experts: int
    experts_per_token: int
    expert_size: int  # each expert's MLP width
    shared_expert_size: int  # Qwen2-MoE's always-on expert (0: none)
    normalize_top_k: bool  # top-k weights renormalized to sum to 1
    sparse_layers: frozenset[int]  # layers whose FFN is the expert block (others: dense)

    @classmethod
    def from_config(cls, data: Mapping[str, Any], architecture: str) -> ExpertShape | None:
        """None for a dense model. Mixtral: ``num_local_experts`` experts of
        ``intermediate_size`` on every layer, top-k always renormalized; Qwen2/3-MoE:
        ``num_experts`` of ``moe_intermediate_size`` on the layers ``decoder_sparse_step`` and
        ``mlp_only_layers`` leave sparse, ``norm_topk_prob`` (Qwen2-MoE: a shared expert)."""
        layers = int(data["num_hidden_layers"])
        if architecture == "MixtralForCausalLM":
            return cls(
                num_experts=int(data["num_local_experts"]),
                experts_per_token=int(data.get("num_experts_per_tok", 2)),
                expert_size=int(data["intermediate_size"]),
                shared_expert_size=0,
                normalize_top_k=True,
                sparse_layers=frozenset(range(layers)),
            )
        if architecture not in _QWEN_MOE_DEFAULTS:
            return None
        # absent keys take transformers' own defaults for the family
        top_k, shared_default = _QWEN_MOE_DEFAULTS[architecture]
        experts = int(data.get("num_experts", data.get("num_local_experts", 0)) or 0)
        if experts == 0:
            return None  # transformers builds every layer dense then
        step = int(data.get("decoder_sparse_step", 1))
        dense = {int(i) for i in data.get("mlp_only_layers") or ()}
        sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        shared = 0
        if architecture == "Qwen2MoeForCausalLM":
            shared = int(data.get("shared_expert_intermediate_size", shared_default) or 0)
        return cls(
            num_experts=experts,
            experts_per_token=int(data.get("num_experts_per_tok", top_k)),
            expert_size=int(data["moe_intermediate_size"]),
            shared_expert_size=shared,
            normalize_top_k=bool(data.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )


class PlanError(ConfigError):
    """A configuration whose weights cannot fit; the message carries the numbers."""


def size_text(nbytes: float) -> str:
    """Bytes for a message: GiB from 0.1 GiB up, MiB below."""
    if nbytes >= 0.1 * GIB:
        return f"{nbytes / GIB:.3f} GiB"
    return f"{nbytes / (1 << 20):.2f} MiB"


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


def head_stored_int8(data: Mapping[str, Any]) -> bool:
    """A compressed-tensors checkpoint whose ``ignore`` leaves the LM head quantized."""
    block = data.get("quantization_config") or data.get("compression_config")
    if not isinstance(block, Mapping):
        return False
    return "lm_head" not in (block.get("ignore") or ())


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder's ``config.json``."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm
    experts: ExpertShape | None = None
    head_stored_int8: bool = False
    """The checkpoint stores the LM head in int8 (a GPTQ folder): no float table is kept."""

    @property
    def dense_layers(self) -> int:
        """Layers whose FFN is a dense MLP of ``intermediate_size``."""
        return self.num_layers - (len(self.experts.sparse_layers) if self.experts else 0)

    @classmethod
    def from_config(cls, data: Mapping[str, Any], source: str = "config.json") -> ModelShape:
        """From a Hugging Face ``config.json`` (the fields ``models.arch.ModelArch`` reads)."""
        try:
            hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
            archs = data.get("architectures") or ["LlamaForCausalLM"]
            return cls(
                architecture=str(archs[0]),
                hidden_size=hidden,
                intermediate_size=int(data["intermediate_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                vocab_size=int(data["vocab_size"]),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                qkv_bias=has_qkv_bias(data, str(archs[0])),
                o_bias=bool(data.get("attention_bias", False)),
                mlp_bias=bool(data.get("mlp_bias", False)),
                max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                qk_norm=archs[0] in QK_NORM_ARCHITECTURES,
                experts=ExpertShape.from_config(data, str(archs[0])),
                head_stored_int8=head_stored_int8(data),
            )
        except KeyError as exc:
            raise ConfigError(f"{source}: missing {exc.args[0]!r}") from None

    @property
    def facts(self) -> ModelFacts:
        """What the configuration's checks need (``EngineConfig.check_against_model``)."""
        experts = self.experts
        return ModelFacts(
            num_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            num_experts=experts.num_experts if experts else 0,
            experts_per_token=experts.experts_per_token if experts else 0,
            # the dense MLP's width, where a layer has one (experts are not split by width)
            intermediate_size=self.intermediate_size if self.dense_layers else 0,
            architecture=self.architecture,
            qk_norm=self.qk_norm,
            shared_expert_size=experts.shared_expert_size if experts else 0,
        )

    def activation_bytes(self, max_tokens: int, max_seqs: int, tensor: int, itemsize: int) -> int:
        """Bytes the largest step's activations take on one tensor rank (an estimate where
        the device keeps no allocator statistics): a step of ``max_tokens`` tokens, and
        float32 logits for ``max_seqs`` sequences."""
        per_token = 4 * self.hidden_size
        per_token += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim // tensor
        experts = self.experts
        if experts is None or self.dense_layers:
            per_token += 3 * self.intermediate_size // tensor  # gate_up output and its product
        if experts is not None:  # each token's rows copied to its experts, and their outputs
            per_token += experts.experts_per_token * (
                3 * experts.expert_size + 2 * self.hidden_size
            )
            per_token += 3 * experts.shared_expert_size // tensor + experts.num_experts
        return max_tokens * per_token * itemsize + max_seqs * self.vocab_size * 4


@dataclass(frozen=True)
class Target:
    """Where the plan runs: the device kind, the compute dtype, whether CPU weights are
    packed (a tied head then gains a packed copy) and whether Brook's CPU int8
    kernels tile W8A16 weights; the device's memory when known (for the KV figures)."""

    device: str  # "cpu" | "cuda" | "npu"
    dtype: str  # "float32" | "bfloat16" | "float16"
    cpu_packs_float: bool = False
    cpu_tiles_int8: bool = False
    device_memory_bytes: int | None = None


@dataclass(frozen=True)
class Linear:
    """One projection of a rank: ``out`` × ``inn`` and whether it has a bias."""

    out: int
    inn: int
    bias: bool
    quantizable: bool = True  # a router's gate stays in the model dtype under W8A16

    def tensors(
        self, dtype_bytes: int, int8_group: int | None, tiled: bool, int8: bool
    ) -> list[int]:
        """Bytes of each tensor the engine holds for this projection."""
        bias = [self.out * dtype_bytes] if self.bias else []
        if not int8 or not self.quantizable:
            return [self.out * self.inn * dtype_bytes, *bias]
        groups = 1 if int8_group is None else self.inn // int8_group
        scales = [self.out * groups * dtype_bytes]
        if not tiled:
            return [self.out * self.inn, *scales, *bias]
        padded = -(-self.out // INT8_TILE) * INT8_TILE
        tiled_bytes = [padded * self.inn, groups * padded * 4] + (
            [self.out * 4] if self.bias else []
        )
        return [*tiled_bytes, *scales, *bias]


@dataclass(frozen=True)
class RankPlan:
    """One rank's weights: what stays, what streams, from where."""

    rank: int
    stage: int
    tensor_rank: int
    layers: tuple[int, int]  # [first, end) global layer indexes of this stage
    fixed_bytes: dict[str, int]  # embedding, head, norms: always resident
    piece_bytes: dict[str, int]  # one layer's attention / ffn piece (as held in a slot)
    resident: list[tuple[int, PieceKind]]  # pieces in device memory (global layer index)
    streamed: list[tuple[int, PieceKind]]  # pieces that stream, in execution order
    slots: dict[str, int]  # ring slots per streamed kind
    host_pieces: int  # streamed pieces held in the host pool (the rest on disk)
    budget_bytes: int | None  # None: no offload (everything resident)
    kv: dict[str, int] = field(default_factory=dict)  # blocks, tokens, sequences, bytes

    @property
    def resident_bytes(self) -> int:
        return sum(self.fixed_bytes.values()) + sum(self.piece_bytes[k] for _, k in self.resident)

    @property
    def slot_bytes(self) -> int:
        return sum(n * self.piece_bytes[k] for k, n in self.slots.items())

    @property
    def device_bytes(self) -> int:
        """Device memory the weights take: resident pieces, fixed weights and slots."""
        return self.resident_bytes + self.slot_bytes

    @property
    def streamed_bytes(self) -> int:
        return sum(self.piece_bytes[k] for _, k in self.streamed)

    @property
    def host_bytes(self) -> int:
        return sum(self.piece_bytes[k] for _, k in self.streamed[: self.host_pieces])

    @property
    def disk_bytes(self) -> int:
        return self.streamed_bytes - self.host_bytes

    @property
    def total_bytes(self) -> int:
        """Every weight of the rank, wherever it lives (slots not counted)."""
        return self.resident_bytes + self.streamed_bytes

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            resident_bytes=self.resident_bytes,
            slot_bytes=self.slot_bytes,
            device_bytes=self.device_bytes,
            streamed_bytes=self.streamed_bytes,
            host_bytes=self.host_bytes,
            disk_bytes=self.disk_bytes,
            total_bytes=self.total_bytes,
        )
        return out


@dataclass(frozen=True)
class MemoryPlan:
    policy: str
    target: Target
    tensor: int
    pipeline: int
    ranks: list[RankPlan]

    def to_json(self) -> str:
        return json.dumps(
            {
                "policy": self.policy,
                "target": asdict(self.target),
                "tensor": self.tensor,
                "pipeline": self.pipeline,
                "ranks": [r.summary() for r in self.ranks],
            },
            indent=2,
        )

    def table(self) -> str:
        """The plan as a text table, a row per rank (sizes in GiB, or MiB for small models)."""
        t = self.target
        big = max(r.total_bytes for r in self.ranks) >= GIB
        unit, unit_name = (GIB, "GiB") if big else (1 << 20, "MiB")
        lines = [
            f"policy {self.policy}, {t.device} {t.dtype}, tensor {self.tensor} x pipeline "
            f"{self.pipeline}"
            + (
                f", device memory {t.device_memory_bytes / GIB:.2f} GiB"
                if t.device_memory_bytes
                else ""
            ),
            f"{'rank':>4} {'stage':>5} {'layers':>9} {'attn/layer':>10} {'ffn/layer':>10} "
            f"{'fixed':>7} {'resident':>9} {'slots':>7} {'device':>7} {'budget':>7} "
            f"{'streamed':>9} {'host':>7} {'disk':>7} {'KV blocks':>9} {'KV tokens':>10} "
            f"{'seqs':>5}   (sizes in {unit_name})",
        ]

        def gib(n: int) -> str:
            return f"{n / unit:.3f}" if big else f"{n / unit:.1f}"

        for r in self.ranks:
            budget = "-" if r.budget_bytes is None else gib(r.budget_bytes)
            lines.append(
                f"{r.rank:>4} {r.stage:>5} {f'{r.layers[0]}-{r.layers[1] - 1}':>9} "
                f"{gib(r.piece_bytes['attention']):>10} {gib(r.piece_bytes['ffn']):>10} "
                f"{gib(sum(r.fixed_bytes.values())):>7} {gib(r.resident_bytes):>9} "
                f"{gib(r.slot_bytes):>7} {gib(r.device_bytes):>7} {budget:>7} "
                f"{gib(r.streamed_bytes):>9} {gib(r.host_bytes):>7} {gib(r.disk_bytes):>7} "
                f"{r.kv.get('blocks', '-')!s:>9} {r.kv.get('tokens', '-')!s:>10} "
                f"{r.kv.get('sequences', '-')!s:>5}"
            )
        blocks = [r.kv["blocks"] for r in self.ranks if "blocks" in r.kv]
        if blocks and len(set(blocks)) > 1:
            lines.append(
                f"replica KV cache: {min(blocks)} blocks on every rank (the smallest rank's; "
                "block ids are shared across the replica)"
            )
        streamed = {len(r.streamed) for r in self.ranks}
        lines.append(
            "pieces streamed per rank: "
            + ", ".join(str(n) for n in sorted(streamed))
            + " (each layer is two pieces: attention and ffn)"
        )
        return "\n".join(lines)


def with_checkpoint_quantization(config: EngineConfig, data: Mapping[str, Any]) -> EngineConfig:
    """``config`` as the loader will run it on the checkpoint ``data`` (its config.json):
    a compressed-tensors W8A16 checkpoint brings its own group size when the configuration
    sets none (the loader refuses a different one)."""
    block = data.get("quantization_config") or data.get("compression_config")
    if not isinstance(block, Mapping) or config.quantization.group_size is not None:
        return config
    groups = block.get("config_groups") or {}
    if len(groups) != 1:
        return config  # the loader names what is wrong with it
    weights = next(iter(groups.values())).get("weights") or {}
    size = weights.get("group_size") if weights.get("strategy") == "group" else None
    if size is None:
        return config
    quantization = config.quantization.model_copy(update={"group_size": int(size)})
    return config.model_copy(update={"quantization": quantization})


def stage_layer_counts(config: EngineConfig, shape: ModelShape) -> list[int]:
    """Layers per pipeline stage (``core.replica.stage_layer_counts``'s rule)."""
    par = config.parallel
    if par.stage_layers is not None:
        return list(par.stage_layers)
    h = shape.hidden_size
    layer = h * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    layer += shape.num_heads * shape.head_dim * h
    experts = shape.experts
    if experts is None:
        layer += 3 * h * shape.intermediate_size
    else:  # the work of a token: its experts and the shared one
        layer += 3 * h * (experts.experts_per_token * experts.expert_size)
        layer += 3 * h * experts.shared_expert_size
    return split_layers(shape.num_layers, par.pipeline, 1.0, 0.0, h * shape.vocab_size / layer)


def rank_linears(shape: ModelShape, tensor: int) -> dict[PieceKind, list[Linear]]:
    """The projections of one layer as a tensor rank holds them."""
    d = shape.head_dim
    heads = shape.num_heads // tensor
    kv_heads = shape.num_kv_heads // tensor if shape.num_kv_heads >= tensor else 1
    q, kv = heads * d, kv_heads * d
    inter = shape.intermediate_size // tensor
    h = shape.hidden_size
    experts = shape.experts
    if experts is None:
        ffn = [Linear(2 * inter, h, shape.mlp_bias), Linear(h, inter, shape.mlp_bias)]
    else:
        # A sparse layer (the plan's pieces are alike; a dense layer of a mixed model is
        # smaller): the router, this rank's share of the experts, the shared expert's slice.
        e, shared = experts.expert_size, experts.shared_expert_size // tensor
        ffn = [Linear(experts.num_experts, h, False, quantizable=False)]
        for _ in range(experts.num_experts // tensor):
            ffn += [Linear(2 * e, h, False), Linear(h, e, False)]
        if shared:
            ffn += [Linear(2 * shared, h, False), Linear(h, shared, False)]
            ffn += [Linear(1, h, False, quantizable=False)]
    return {
        "attention": [Linear(q + 2 * kv, h, shape.qkv_bias), Linear(h, q, shape.o_bias)],
        "ffn": ffn,
    }


def piece_bytes(
    shape: ModelShape, config: EngineConfig, target: Target, tensor: int = 1
) -> dict[str, int]:
    """Bytes one layer's attention and FFN pieces take as held (each tensor aligned)."""
    d = _DTYPE_BYTES[target.dtype]
    int8 = config.quantization.weights == "w8a16"
    group = config.quantization.group_size
    tiled = int8 and target.device == "cpu" and target.cpu_tiles_int8
    out: dict[str, int] = {}
    for kind, linears in rank_linears(shape, tensor).items():
        out[kind] = sum(
            aligned(n)
            for lin in linears
            for n in lin.tensors(d, group if int8 else None, tiled, int8)
            if n
        )
    return out


def fixed_bytes(
    shape: ModelShape,
    config: EngineConfig,
    target: Target,
    tensor: int,
    first: bool,
    last: bool,
    num_layers: int,
) -> dict[str, int]:
    """The always-resident weights of a rank: embedding, LM head (and its int8 or packed
    copy), norms."""
    d = _DTYPE_BYTES[target.dtype]
    h = shape.hidden_size
    rows = -(-shape.vocab_size // tensor)
    table = rows * h * d
    norms = 2 * h + (2 * shape.head_dim if shape.qk_norm else 0)
    out = {"embedding": table if first else 0, "head": 0, "norms": num_layers * norms * d}
    if last:
        out["norms"] += h * d
        shared = shape.tie_word_embeddings and first
        out["head"] = 0 if shared or shape.head_stored_int8 else table
        if config.quantization.weights == "w8a16":
            group = config.quantization.group_size
            groups = 1 if group is None else h // group
            if target.device == "cpu" and target.cpu_tiles_int8:
                padded = -(-rows // INT8_TILE) * INT8_TILE
                out["head"] += padded * h + groups * padded * 4
            else:
                out["head"] += rows * h + rows * groups * d
        elif shared and target.device == "cpu" and target.cpu_packs_float:
            out["head"] += table  # the head's packed copy beside the embedding's table
    return out


def build_plan(config: EngineConfig, shape: ModelShape, target: Target) -> MemoryPlan:
    """Every rank's plan; ``PlanError`` (with the numbers) where a budget cannot hold it."""
    par = config.parallel
    counts = stage_layer_counts(config, shape)
    ranks = []
    for stage in range(par.pipeline):
        start = sum(counts[:stage])
        end = start + counts[stage]
        for tp_rank in range(par.tensor):
            ranks.append(
                plan_rank(
                    config,
                    shape,
                    target,
                    stage * par.tensor + tp_rank,
                    stage,
                    tp_rank,
                    (start, end),
                    first=stage == 0,
                    last=stage == par.pipeline - 1,
                )
            )
    return MemoryPlan(config.offload.policy, target, par.tensor, par.pipeline, ranks)


def plan_rank(
    config: EngineConfig,
    shape: ModelShape,
    target: Target,
    rank: int,
    stage: int,
    tp_rank: int,
    layers: tuple[int, int],
    first: bool,
    last: bool,
) -> RankPlan:
    """One rank's plan (the engine calls this for its own rank)."""
    offload = config.offload
    tensor = config.parallel.tensor
    start, end = layers
    n = end - start
    pieces = piece_bytes(shape, config, target, tensor)
    fixed = fixed_bytes(shape, config, target, tensor, first, last, n)
    every = [(i, k) for i in range(start, end) for k in PIECE_KINDS]
    budget = None if offload.policy == "none" else int(offload.device_memory_limit_gb * GIB)  # type: ignore[operator]
    if budget is None or sum(fixed.values()) + sum(pieces[k] for _, k in every) <= budget:
        resident, streamed = every, []
    else:
        resident = _choose_resident(
            fixed,
            pieces,
            start,
            end,
            offload.priority_layers,
            offload.prefetch_layers,
            budget,
            rank,
        )
        streamed = [p for p in every if p not in set(resident)]
    slots = _slots(streamed, offload.prefetch_layers)
    host_pieces = _host_pieces(streamed, pieces, slots, target, offload.cpu_memory_pool_gb, rank)
    plan = RankPlan(
        rank, stage, tp_rank, layers, fixed, pieces, resident, streamed, slots, host_pieces, budget
    )
    kv = kv_capacity(config, shape, target, plan)
    return RankPlan(**{**plan.__dict__, "kv": kv})


def _slots(streamed: list[tuple[int, PieceKind]], prefetch: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, kind in streamed:
        counts[kind] = counts.get(kind, 0) + 1
    return {kind: min(prefetch + 1, n) for kind, n in counts.items()}


def spread(count: int, start: int, end: int) -> list[int]:
    """``count`` layers of [start, end) spread evenly (so the streamed ones between them
    are too)."""
    n = end - start
    if count <= 0:
        return []
    return sorted({start + math.floor((k + 0.5) * n / count) for k in range(count)})


def _choose_resident(
    fixed: dict[str, int],
    pieces: dict[str, int],
    start: int,
    end: int,
    priority: list[PieceKind],
    prefetch: int,
    budget: int,
    rank: int,
) -> list[tuple[int, PieceKind]]:
    layers = list(range(start, end))

    def cost(resident: list[tuple[int, PieceKind]]) -> int:
        held = set(resident)
        streamed = [(i, k) for i in layers for k in PIECE_KINDS if (i, k) not in held]
        slots = _slots(streamed, prefetch)
        return (
            sum(fixed.values())
            + sum(pieces[k] for _, k in resident)
            + sum(n * pieces[k] for k, n in slots.items())
        )

    resident: list[tuple[int, PieceKind]] = []
    if cost(resident) > budget:
        least = cost(resident)
        slot_text = ", ".join(
            f"{min(prefetch + 1, len(layers))} {k} slots of {size_text(pieces[k])}"
            for k in PIECE_KINDS
        )
        raise PlanError(
            f"offload.deviceMemoryLimitGb: {size_text(budget)} cannot hold rank {rank}'s "
            f"fixed weights ({size_text(sum(fixed.values()))}: embedding, head, norms) and "
            f"its streaming slots ({slot_text}): {size_text(least)} at least; raise it to "
            f"{least / GIB:.6g} or more, or lower offload.prefetchLayers"
        )
    for kind in priority:  # a whole priority kind resident, if it fits
        trial = resident + [(i, kind) for i in layers]
        if cost(trial) <= budget:
            resident = trial
    # then as many whole layers as fit, spread over the stage
    best = resident
    for count in range(1, len(layers) + 1):
        whole = {(i, k) for i in spread(count, start, end) for k in PIECE_KINDS}
        trial = sorted(set(resident) | whole)
        if cost(trial) > budget:
            break
        best = trial
    return sorted(best)


def _host_pieces(
    streamed: list[tuple[int, PieceKind]],
    pieces: dict[str, int],
    slots: dict[str, int],
    target: Target,
    pool_gb: float | None,
    rank: int,
) -> int:
    """How many streamed pieces (in order) the host pool holds; the rest go to disk. On CPU
    the host is the device's own memory, so the pool is empty unless one is set; elsewhere
    it holds them all unless ``cpuMemoryPoolGb`` says less (it must then hold the staging
    buffers the disk reads go through)."""
    if not streamed:
        return 0
    if pool_gb is None:
        return 0 if target.device == "cpu" else len(streamed)
    pool = int(pool_gb * GIB)
    staging = 0 if target.device == "cpu" else sum(n * pieces[k] for k, n in slots.items())
    held, count = staging, 0
    for _, kind in streamed:
        if held + pieces[kind] > pool:
            break
        held += pieces[kind]
        count += 1
    if count < len(streamed) and staging > pool:
        raise PlanError(
            f"offload.cpuMemoryPoolGb: {pool_gb} GiB cannot hold rank {rank}'s staging buffers "
            f"for reads from disk ({size_text(staging)}); raise it to at least "
            f"{staging / GIB:.6g}, or leave it unset to hold every streamed weight in host "
            "memory"
        )
    return count


def kv_capacity(
    config: EngineConfig, shape: ModelShape, target: Target, plan: RankPlan
) -> dict[str, int]:
    """The KV cache the rank's memory holds after its weights: blocks, tokens, full-length
    sequences (empty where the device's memory is not known and numBlocks is not set)."""
    kv_cfg = config.kv_cache
    d = _DTYPE_BYTES[target.dtype]
    tensor = config.parallel.tensor
    kv_heads = max(1, shape.num_kv_heads // tensor)
    start, end = plan.layers
    kinds = kv_cfg.layer_dtypes(shape.num_layers)[start:end]
    per_token = sum(kv_bytes_per_token(k, d, kv_heads, shape.head_dim) for k in kinds)
    per_block = max(1, per_token) * kv_cfg.block_size
    max_len = config.model.max_model_len or shape.max_position_embeddings
    if kv_cfg.num_blocks is not None:
        blocks = kv_cfg.num_blocks
    elif target.device_memory_bytes is not None or target.device == "cpu":
        sched = config.scheduler
        if target.device_memory_bytes is None:  # CPU: the engine's cap, beside the weights
            free = CPU_KV_CACHE_CAP
        else:
            activations = shape.activation_bytes(
                sched.max_num_batched_tokens, sched.max_num_seqs, tensor, d
            )
            free = target.device_memory_bytes - plan.device_bytes - activations
        fraction = kv_cfg.memory_fraction or DEFAULT_MEMORY_FRACTION
        blocks_per_seq = -(-(kv_cfg.max_seq_len or max_len) // kv_cfg.block_size)
        enough = sched.max_num_seqs * blocks_per_seq  # the engine's cap (kv.sizing.num_blocks)
        blocks = max(0, min(int(free * fraction) // per_block, enough))
    else:
        return {}
    tokens = blocks * kv_cfg.block_size
    return {
        "blocks": blocks,
        "tokens": tokens,
        "sequences": tokens // max(1, max_len),
        "bytes": blocks * per_block,
        "bytes_per_token": per_token,
    }
