"""The mixture-of-experts FFN: each family's top-k router, load-aware rerouting, the experts
computed grouped by expert, expert parallelism across the tensor ranks, and the load figures.

**Routing** is the family's own: softmax over the router's logits in float32, the top-k
experts, their weights renormalized to sum to 1 where the family does (Mixtral always;
Qwen2/3-MoE when ``norm_topk_prob``), kept in float32 (Mixtral) or cast to the model dtype
(Qwen) as transformers does.

**Load-aware rerouting** (``moe.reroute``): within a step, an expert may take at most
``capacity = max(ceil(mean), floor(loadThreshold x mean))`` of the step's token slots, the
mean being ``tokens x topK / experts``. Every token first gets one expert, its best choice
with room (a token whose chosen expert is full goes to its next choice that has room, never
outside its top-k; one whose choices are all full keeps its first); then its other choices
are added, best first, while their experts have room. The kept weights are renormalized as the
family does (to 1 where it normalizes; else scaled to the top-k's own sum, so the output keeps
its magnitude). Sorting and counting only: the same batch routes the same way every time.

**Experts** are ``MLP``s (float or W8A16, packed on CPU like every other projection).
A step's (token, expert) pairs are sorted by expert once, then each expert multiplies the
rows of its tokens in one product: work grows with the tokens an expert serves, never a loop
over tokens. With ``parallel.tensor`` > 1 each rank holds ``experts / tensor`` whole experts
(expert parallelism); attention's all-reduce has left every rank the whole batch, so each
computes its own experts' share and the partial sums meet in the all-reduce the dense MLP
would have used. An imbalanced router makes the rank with the busy experts the step's
straggler; rerouting caps that.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from brook_engine.layers.linear import Linear
from brook_engine.layers.tensor_parallel import Shard, TensorComm


@dataclass(frozen=True)
class Routing:
    """How a model's router picks experts (the family's rule and ``moe`` settings)."""

    num_experts: int
    top_k: int
    normalize: bool  # renormalize the top-k weights to sum to 1
    weights_in_model_dtype: bool  # Qwen casts the top-k weights to the model dtype
    reroute: bool = False
    threshold: float = 1.25


@dataclass
class Routed:
    """A step's routing: ``experts`` and ``weights`` [tokens, top_k] (choices in order of
    preference); ``kept`` [tokens, top_k] the slots that run (None: all)."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor | None = None
    capacity: int | None = None


def capacity(tokens: int, routing: Routing) -> int:
    """Slots one expert may take in a step of ``tokens`` tokens when rerouting."""
    mean = tokens * routing.top_k / routing.num_experts
    return max(math.ceil(mean), math.floor(routing.threshold * mean))


def load_aware_keep(experts: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Which of the slots ``experts`` [tokens, top_k] run when no expert takes more than
    ``cap``. First every token gets one expert: its best choice with room (round r offers
    the r-th choice of the tokens still without one, in batch order); a token whose choices
    are all full keeps its first. Then the remaining choices, best first, while there is
    room. Counting and stable sorts only: deterministic."""
    tokens, k = experts.shape
    if tokens * k <= SMALL_STEP and experts.device.type == "cpu":
        return _keep_in_python(experts, num_experts, cap)
    keep = torch.zeros(tokens, k, dtype=torch.bool, device=experts.device)
    load = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)

    def admit(rows: torch.Tensor, choice: int) -> None:
        if rows.numel() == 0:
            return
        wanted = experts[rows, choice]
        order = torch.argsort(wanted, stable=True)  # by expert, batch order within one
        counts = torch.bincount(wanted, minlength=num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(wanted)
        position[order] = torch.arange(wanted.numel(), device=wanted.device)
        position -= starts[wanted]
        fits = load[wanted] + position < cap
        keep[rows[fits], choice] = True
        load.add_(torch.bincount(wanted[fits], minlength=num_experts))

    for choice in range(k):  # one expert per token
        admit((~keep.any(dim=1)).nonzero().squeeze(1), choice)
    orphans = ~keep.any(dim=1)
    keep[orphans, 0] = True
    load.add_(torch.bincount(experts[orphans, 0], minlength=num_experts))
    for choice in range(k):  # the other choices, while there is room
        admit((~keep[:, choice]).nonzero().squeeze(1), choice)
    return keep


#: Token slots up to which ``load_aware_keep`` walks them in Python: a decode step's few
#: slots take ~40 us so, against ~200 us of small tensor operations
SMALL_STEP = 512


def _keep_in_python(experts: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """``load_aware_keep``'s rule, slot by slot (the same result: each round admits its
    candidates in batch order while their expert has room)."""
    choices: list[list[int]] = experts.tolist()
    k = experts.shape[1]
    load = [0] * num_experts
    keep = [[False] * k for _ in choices]
    placed = [False] * len(choices)
    for c in range(k):
        for t, row in enumerate(choices):
            if not placed[t] and load[row[c]] < cap:
                load[row[c]] += 1
                keep[t][c] = placed[t] = True
    for t, row in enumerate(choices):
        if not placed[t]:
            load[row[0]] += 1
            keep[t][0] = True
    for c in range(k):
        for t, row in enumerate(choices):
            if not keep[t][c] and load[row[c]] < cap:
                load[row[c]] += 1
                keep[t][c] = True
    return torch.tensor(keep, dtype=torch.bool).view(-1, k)


def route(logits: torch.Tensor, routing: Routing) -> Routed:
    """The family's top-k routing of router ``logits`` [tokens, experts], rerouted when
    ``routing.reroute`` (see the module's docstring)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, routing.top_k, dim=-1)
    kept: torch.Tensor | None = None
    cap: int | None = None
    if routing.reroute and routing.top_k > 1:
        cap = capacity(logits.shape[0], routing)
        kept = load_aware_keep(experts, routing.num_experts, cap)
        held = weights * kept
        kept_sum = held.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(held.dtype).tiny)
        if routing.normalize:
            weights = held / kept_sum
        else:
            weights = held * (weights.sum(dim=-1, keepdim=True) / kept_sum)
    elif routing.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return Routed(experts, weights, kept, cap)


@dataclass(frozen=True)
class ExpertLoadFigures:
    """Expert balance over the recent steps (slot-weighted means of each layer's step):
    ``load_cv`` the coefficient of variation of tokens per expert, ``utilization`` the mean
    expert's load over the busiest one's (1: even; the share of the step's expert time the
    average expert works), ``rank_utilization`` the same over expert-parallel ranks; running
    totals of the slots routed and rerouted, and of the tokens each expert served (all
    layers)."""

    load_cv: float = 0.0
    load_std: float = 0.0  # tokens per expert
    utilization: float = 1.0
    rank_utilization: float = 1.0
    routed_total: int = 0
    rerouted_total: int = 0
    expert_tokens_total: tuple[int, ...] = ()
    # with rerouting: the utilization no assignment could pass that keeps every token on at
    # least one of its top-k and no expert past the capacity (``utilization_bound``)
    utilization_bound: float | None = None


def utilization_bound(demand: list[int], tokens: int, cap: int) -> float:
    """The best utilization (mean load / largest) of any assignment that serves each of
    ``tokens`` tokens by at least one of its top-k experts and no expert beyond ``cap``:
    expert e can serve at most ``demand[e]`` slots (the tokens ranking it in their top-k),
    so with the largest load m the slots are at most ``served(m) = sum(min(d, m))``, at
    least ``tokens``; ``served(m) / m`` only falls as m grows, so the bound is at the
    smallest m that can still serve every token."""
    ordered = sorted(demand)
    experts = len(ordered)
    prefix = [0]
    for d in ordered:
        prefix.append(prefix[-1] + d)

    def served(m: int) -> int:
        below = bisect.bisect_right(ordered, m)
        return prefix[below] + (experts - below) * m

    low, high = max(1, -(-tokens // experts)), max(1, cap)
    if low >= high or served(high) < tokens:
        m = high
    else:
        while low < high:  # the smallest m serving every token
            mid = (low + high) // 2
            if served(mid) >= tokens:
                high = mid
            else:
                low = mid + 1
        m = low
    return served(m) / (experts * m)


@dataclass
class ExpertLoad:
    """Tokens per expert per layer, as the router sent them (each rank routes the whole
    batch, so every tensor rank holds the same figures)."""

    num_experts: int
    ranks: int = 1
    window: int = 256  # layer-steps the balance figures average over
    routed_total: int = 0
    rerouted_total: int = 0
    per_layer: dict[int, list[int]] = field(default_factory=dict)
    _recent: deque[tuple[int, float, float, float, float]] = field(default_factory=deque)
    _bounds: deque[tuple[int, float]] = field(default_factory=deque)

    def record(
        self,
        layer: int,
        counts: list[int],
        rerouted: int,
        demand: list[int] | None = None,
        cap: int | None = None,
        tokens: int = 0,
    ) -> None:
        """One layer's step: slots per expert (after rerouting) and the slots moved; with
        rerouting, the slots each expert was asked for (``demand``), its capacity and the
        step's tokens."""
        slots = sum(counts)
        if slots == 0:
            return
        if demand is not None and cap:
            self._bounds.append((slots, utilization_bound(demand, tokens, cap)))
            while len(self._bounds) > self.window:
                self._bounds.popleft()
        self.routed_total += slots
        self.rerouted_total += rerouted
        totals = self.per_layer.setdefault(layer, [0] * self.num_experts)
        for e, n in enumerate(counts):
            totals[e] += n
        mean = slots / self.num_experts
        std = math.sqrt(sum((n - mean) ** 2 for n in counts) / self.num_experts)
        per_rank = self.num_experts // self.ranks
        rank_loads = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(self.ranks)]
        self._recent.append(
            (slots, std / mean, mean / max(counts), slots / self.ranks / max(rank_loads), std)
        )
        while len(self._recent) > self.window:
            self._recent.popleft()

    def figures(self) -> ExpertLoadFigures:
        recent = list(self._recent)
        weight = sum(r[0] for r in recent)
        experts = [
            sum(layer[e] for layer in self.per_layer.values()) for e in range(self.num_experts)
        ]
        if not weight:
            return ExpertLoadFigures(expert_tokens_total=tuple(experts))
        bounds = list(self._bounds)
        bound_weight = sum(b[0] for b in bounds)
        return ExpertLoadFigures(
            load_cv=sum(r[0] * r[1] for r in recent) / weight,
            load_std=sum(r[0] * r[4] for r in recent) / weight,
            utilization=sum(r[0] * r[2] for r in recent) / weight,
            rank_utilization=sum(r[0] * r[3] for r in recent) / weight,
            routed_total=self.routed_total,
            rerouted_total=self.rerouted_total,
            expert_tokens_total=tuple(experts),
            utilization_bound=(
                sum(b[0] * b[1] for b in bounds) / bound_weight if bound_weight else None
            ),
        )

    def reset(self) -> None:
        self.routed_total = self.rerouted_total = 0
        self.per_layer.clear()
        self._recent.clear()
        self._bounds.clear()


class SparseMoE(nn.Module):
    """A layer's expert block: ``gate`` (the router, in the model dtype even under W8A16),
    this rank's ``experts``, and Qwen2-MoE's ``shared_expert`` with its sigmoid gate."""

    def __init__(
        self,
        hidden_size: int,
        expert_size: int,
        shared_expert_size: int,
        routing: Routing,
        layer: int,
        dtype: torch.dtype,
        shard: Shard,
        comm: TensorComm | None,
        make_mlp: Callable[[int, TensorComm | None], nn.Module],
    ) -> None:
        """``comm``: the tensor ranks' all-reduce (None on one rank); ``make_mlp(width,
        comm)``: an MLP of this rank's ``width`` (``models.llama``'s, float or W8A16), its
        output all-reduced over ``comm`` when given."""
        super().__init__()
        self.routing, self.layer = routing, layer
        self.gate = Linear(hidden_size, routing.num_experts, bias=False, dtype=dtype)
        self.first_expert, end = shard.split(routing.num_experts)
        local = end - self.first_expert
        self.experts = nn.ModuleList(make_mlp(expert_size, None) for _ in range(local))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_expert_size:
            self.shared_expert = make_mlp(shared_expert_size // shard.tp_size, comm)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False, dtype=dtype)
        self.comm = comm
        self.load: ExpertLoad | None = None  # set by the model: where the router's counts go

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The block's output for ``x`` [tokens, hidden]; this rank's partial sum when
        ``reduce`` is False (or there is one rank)."""
        routed = route(self.gate(x), self.routing)
        out = self.run_experts(x, routed)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, reduce=False)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out if self.comm is None or not reduce else self.comm.all_reduce(out)

    def run_experts(self, x: torch.Tensor, routed: Routed) -> torch.Tensor:
        """Σ weight × expert(x) over each token's kept slots, for this rank's experts."""
        tokens, k = routed.experts.shape
        experts = routed.experts.reshape(-1)
        weights = routed.weights.reshape(-1)
        rows = torch.arange(tokens, device=x.device).repeat_interleave(k)
        rerouted = 0
        demand: list[int] | None = None
        if routed.kept is not None:
            if self.load is not None:
                demand = torch.bincount(experts, minlength=self.routing.num_experts).tolist()
            kept = routed.kept.reshape(-1)
            rerouted = int(kept.numel() - int(kept.sum()))
            experts, weights, rows = experts[kept], weights[kept], rows[kept]
        counts = torch.bincount(experts, minlength=self.routing.num_experts).tolist()
        if self.load is not None:
            self.load.record(self.layer, counts, rerouted, demand, routed.capacity, tokens)
        first = self.first_expert
        order = torch.argsort(experts, stable=True)  # by expert: each one's rows together
        start = sum(counts[:first])
        out = torch.zeros_like(x)
        for j, expert in enumerate(self.experts):
            n = counts[first + j]
            if n == 0:
                continue
            picked = order[start : start + n]
            start += n
            index = rows[picked]
            y = expert(x.index_select(0, index), reduce=False)
            w = weights[picked, None]
            y = (y.float() * w).to(x.dtype) if w.dtype != y.dtype else y * w
            out.index_add_(0, index, y)
        return out
