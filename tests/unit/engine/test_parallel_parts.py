"""The pure parts of tensor/pipeline parallelism: rank layout, layer and micro-batch
splits, the overlap arithmetic and its adaptation, the operator's environment, the shard
slices, and a sharded load of real safetensors that reassembles into the unsharded model."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine.config import ConfigError, EngineConfig, ModelFacts, parse_engine_config
from brook_engine.core.ranks import DEFAULT_PORT, GroupSpec
from brook_engine.layers.tensor_parallel import Shard
from brook_engine.models.arch import ModelArch
from brook_engine.models.llama import CausalLM
from brook_engine.models.loader import load_weights
from brook_engine.parallel.overlap import KINDS, RECENT_STEPS, Adaptation, Counters, OverlapMonitor
from brook_engine.parallel.plan import SeqChunk, split_micro_batches
from brook_engine.parallel.topology import Topology, split_layers, stage_bounds
from support.checkpoints import copy_with

# -- Topology ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "tp_rank", "stage", "first", "last", "next_rank", "prev_rank"),
    [
        (0, 0, 0, True, False, 2, None),
        (1, 1, 0, True, False, 3, None),
        (2, 0, 1, False, True, None, 0),
        (3, 1, 1, False, True, None, 1),
    ],
)
def test_topology_tp2_pp2(
    rank: int,
    tp_rank: int,
    stage: int,
    first: bool,
    last: bool,
    next_rank: int | None,
    prev_rank: int | None,
) -> None:
    topo = Topology(tensor=2, pipeline=2, rank=rank)
    assert topo.world_size == 4
    assert (topo.tp_rank, topo.stage) == (tp_rank, stage)
    assert (topo.is_first_stage, topo.is_last_stage) == (first, last)
    assert (topo.next_rank, topo.prev_rank) == (next_rank, prev_rank)
    assert topo.sampler_rank == 2
    assert topo.is_sampler == (rank == 2)
    assert topo.is_driver == (rank == 0)
    assert topo.stage_ranks(0) == [0, 1]
    assert topo.stage_ranks(1) == [2, 3]
    assert rank in topo.stage_ranks(stage)


def test_single_topology_is_one_rank_doing_everything() -> None:
    topo = Topology.single()
    assert topo.world_size == 1
    assert topo.is_first_stage and topo.is_last_stage and topo.is_driver and topo.is_sampler
    assert (topo.next_rank, topo.prev_rank) == (None, None)


@pytest.mark.parametrize("rank", [-1, 4, 7])
def test_topology_rejects_rank_outside_world(rank: int) -> None:
    with pytest.raises(ValueError, match="outside the world of 4"):
        Topology(tensor=2, pipeline=2, rank=rank)


# -- split_layers / stage_bounds ------------------------------------------------------------


def _stage_costs(counts: list[int], first_extra: float, last_extra: float) -> list[float]:
    costs = [float(c) for c in counts]
    costs[0] += first_extra
    costs[-1] += last_extra
    return costs


def _best_max_cost(layers: int, stages: int, first_extra: float, last_extra: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        counts = [bounds[i + 1] - bounds[i] for i in range(stages)]
        best = min(best, max(_stage_costs(counts, first_extra, last_extra)))
    return best


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [(30, 2, [15, 15]), (32, 4, [8, 8, 8, 8]), (5, 5, [1, 1, 1, 1, 1]), (7, 1, [7])],
)
def test_split_layers_equal_costs_split_evenly(
    layers: int, stages: int, expected: list[int]
) -> None:
    assert split_layers(layers, stages) == expected


def test_heavy_last_stage_gets_fewer_layers() -> None:
    counts = split_layers(30, 2, 1.0, 0.0, 4.0)
    assert sum(counts) == 30
    assert counts[-1] < counts[0]
    assert counts == [17, 13]  # 17 vs 13 + 4: no other split has a lower maximum


def test_split_layers_minimises_costliest_stage_against_brute_force() -> None:
    for layers in range(1, 9):
        for stages in range(1, min(layers, 4) + 1):
            for first_extra, last_extra in [(0, 0), (0, 0.3), (0, 2.5), (1.5, 0), (3, 7), (0.5, 2)]:
                counts = split_layers(layers, stages, 1.0, first_extra, last_extra)
                case = (layers, stages, first_extra, last_extra, counts)
                assert len(counts) == stages, case
                assert sum(counts) == layers, case
                assert min(counts) >= 1, case
                got = max(_stage_costs(counts, first_extra, last_extra))
                assert got == pytest.approx(
                    _best_max_cost(layers, stages, first_extra, last_extra)
                ), case


@pytest.mark.parametrize(("layers", "stages"), [(3, 4), (0, 1), (4, 0)])
def test_split_layers_rejects_impossible_splits(layers: int, stages: int) -> None:
    with pytest.raises(ValueError, match="cannot split"):
        split_layers(layers, stages)


def test_stage_bounds_are_contiguous_half_open_ranges() -> None:
    counts = [3, 2, 4]
    assert [stage_bounds(counts, s) for s in range(3)] == [(0, 3), (3, 5), (5, 9)]


# -- split_micro_batches -------------------------------------------------------------------


def _chunk(i: int, tokens: int) -> SeqChunk:
    return SeqChunk(f"r{i}", list(range(tokens)), 0, [i], False, None)


def test_equal_chunks_split_evenly() -> None:
    chunks = [_chunk(i, 5) for i in range(8)]
    groups = split_micro_batches(chunks, 4)
    assert [len(g) for g in groups] == [2, 2, 2, 2]
    assert [c for g in groups for c in g] == chunks


@pytest.mark.parametrize("count", [0, 1])
def test_one_group_when_asked_for_at_most_one(count: int) -> None:
    chunks = [_chunk(i, 3) for i in range(4)]
    assert split_micro_batches(chunks, count) == [chunks]


def test_more_groups_than_chunks_gives_one_chunk_per_group() -> None:
    chunks = [_chunk(i, 1 + i) for i in range(3)]
    assert split_micro_batches(chunks, 8) == [[c] for c in chunks]


def test_split_micro_batches_properties_on_random_inputs() -> None:
    rng = random.Random(1234)
    for _ in range(500):
        chunks = [_chunk(i, rng.randint(1, 64)) for i in range(rng.randint(1, 16))]
        count = rng.randint(1, 10)
        groups = split_micro_batches(chunks, count)
        case = ([len(c.token_ids) for c in chunks], count)
        assert 1 <= len(groups) <= min(count, len(chunks)), case
        assert all(groups), case
        assert [c for g in groups for c in g] == chunks, case


def test_split_micro_batches_balances_tokens() -> None:
    # A long prefill chunk followed by decode tokens: the prefill stands alone.
    chunks = [_chunk(0, 40), *(_chunk(i, 1) for i in range(1, 41))]
    groups = split_micro_batches(chunks, 2)
    assert [sum(len(c.token_ids) for c in g) for g in groups] == [40, 40]


# -- overlap arithmetic --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("compute", "async_ops", "exposed", "overlap"),
    [
        ([(0.0, 10.0)], [(2.0, 4.0)], 0.0, 1.0),  # inside compute: hidden
        ([(0.0, 10.0)], [(10.0, 14.0)], 4.0, 0.0),  # after compute: fully exposed
        ([(0.0, 10.0)], [(8.0, 12.0)], 2.0, 0.5),  # half overlapped
        ([(0.0, 4.0), (6.0, 10.0)], [(2.0, 8.0)], 2.0, 4 / 6),  # the gap is exposed
        ([(0.0, 10.0)], [(2.0, 4.0), (9.0, 11.0)], 1.0, 0.75),
    ],
)
def test_async_exposure(
    compute: list[tuple[float, float]],
    async_ops: list[tuple[float, float]],
    exposed: float,
    overlap: float,
) -> None:
    monitor = OverlapMonitor()
    for span in compute:
        monitor.compute(*span)
    for span in async_ops:
        monitor.finished_async("p2p", *span)
    monitor.end_step()
    t = monitor.totals
    assert t.comm_total == pytest.approx(sum(e - s for s, e in async_ops))
    assert t.comm_exposed == pytest.approx(exposed)
    assert t.overlap == pytest.approx(overlap)
    assert t.by_kind["p2p"] == pytest.approx(t.comm_total)


def test_blocking_op_is_exposed_and_not_compute() -> None:
    monitor = OverlapMonitor()
    monitor.compute(0.0, 10.0)
    monitor.blocking("all_reduce", 2.0, 4.0)
    monitor.end_step()
    t = monitor.totals
    assert t.compute == pytest.approx(8.0)
    assert t.comm_total == pytest.approx(2.0)
    assert t.comm_exposed == pytest.approx(2.0)
    assert t.by_kind["all_reduce"] == pytest.approx(2.0)
    assert t.overlap == 0.0


def test_async_op_is_not_hidden_by_time_blocked_in_a_collective() -> None:
    monitor = OverlapMonitor()
    monitor.compute(0.0, 10.0)
    monitor.blocking("all_reduce", 2.0, 4.0)
    monitor.finished_async("p2p", 1.0, 5.0)  # [2, 4) of it is under the all-reduce
    monitor.end_step()
    t = monitor.totals
    assert t.comm_total == pytest.approx(6.0)
    assert t.comm_exposed == pytest.approx(2.0 + 2.0)


def test_overlapping_compute_intervals_count_once() -> None:
    monitor = OverlapMonitor()
    monitor.compute(0.0, 5.0)
    monitor.compute(3.0, 8.0)
    monitor.end_step()
    assert monitor.totals.compute == pytest.approx(8.0)


def test_no_communication_is_full_overlap() -> None:
    monitor = OverlapMonitor()
    monitor.compute(0.0, 3.0)
    monitor.end_step(wall=3.0)
    assert monitor.totals.comm_total == 0.0
    assert monitor.totals.overlap == 1.0


def test_control_time_is_tracked_but_out_of_the_ratio() -> None:
    monitor = OverlapMonitor()
    monitor.compute(0.0, 10.0)
    monitor.control(0.25)
    monitor.control(0.5)
    monitor.end_step()
    t = monitor.totals
    assert t.by_kind["control"] == pytest.approx(0.75)
    assert t.comm_total == 0.0
    assert t.overlap == 1.0


def test_steps_accumulate_and_state_resets_between_steps() -> None:
    monitor = OverlapMonitor()
    monitor.compute(0.0, 10.0)
    monitor.blocking("all_gather", 1.0, 2.0)
    monitor.control(1.0)
    monitor.end_step(wall=10.0)
    monitor.compute(20.0, 22.0)
    monitor.end_step(wall=2.0)
    t = monitor.totals
    assert t.steps == 2.0
    assert t.step_wall == pytest.approx(12.0)
    assert t.compute == pytest.approx(9.0 + 2.0)
    assert t.comm_total == pytest.approx(1.0)
    assert t.by_kind["control"] == pytest.approx(1.0)


def test_a_send_that_completes_in_a_later_step_is_hidden_by_that_steps_compute() -> None:
    """With steps in flight, step 1's send completes while step 2 computes: the part under
    step 2's compute is hidden; compute older than the monitor's memory is not used."""
    monitor = OverlapMonitor()
    monitor.compute(0.0, 10.0)
    monitor.end_step()
    monitor.compute(12.0, 20.0)
    monitor.finished_async("p2p", 10.0, 16.0)  # issued after step 1's compute
    monitor.end_step()
    t = monitor.totals
    assert t.comm_total == pytest.approx(6.0)
    assert t.comm_exposed == pytest.approx(2.0)  # [10, 12): nobody computed
    assert t.compute == pytest.approx(18.0)  # each step's compute counted once
    for step in range(RECENT_STEPS):
        monitor.compute(100.0 + step, 100.5 + step)
        monitor.end_step()
    monitor.finished_async("p2p", 0.0, 10.0)  # overlaps only forgotten compute
    monitor.end_step()
    assert monitor.totals.comm_exposed == pytest.approx(2.0 + 10.0)


def test_stage_compute_goes_to_the_monitors_own_stage() -> None:
    monitor = OverlapMonitor(stage=2, stages=3)
    monitor.compute(0.0, 4.0)
    monitor.end_step()
    assert monitor.totals.stage_compute == pytest.approx([0.0, 0.0, 4.0])


def test_counters_vector_round_trip_and_minus() -> None:
    by_kind = {k: float(i + 1) for i, k in enumerate(KINDS)}
    a = Counters(10.0, 4.0, 20.0, 30.0, 5.0, by_kind, [7.0, 8.0, 9.0])
    assert Counters.from_vector(a.vector()) == a
    b = Counters(1.0, 1.0, 2.0, 3.0, 1.0, dict.fromkeys(KINDS, 0.5), [1.0, 2.0, 3.0])
    diff = a.minus(b)
    assert (diff.comm_total, diff.comm_exposed, diff.compute) == (9.0, 3.0, 18.0)
    assert (diff.step_wall, diff.steps) == (27.0, 4.0)
    assert diff.by_kind == {k: v - 0.5 for k, v in by_kind.items()}
    assert diff.stage_compute == [6.0, 6.0, 6.0]


@pytest.mark.parametrize(
    ("compute", "wall", "ranks", "bubble"),
    [
        (6.0, 4.0, 2, 0.25),
        (8.0, 4.0, 2, 0.0),
        (12.0, 4.0, 2, 0.0),  # clamped: more compute than ranks × wall
        (0.0, 4.0, 2, 1.0),
        (5.0, 0.0, 2, 0.0),  # no wall time recorded
    ],
)
def test_bubble(compute: float, wall: float, ranks: int, bubble: float) -> None:
    assert Counters(compute=compute, step_wall=wall).bubble(ranks) == pytest.approx(bubble)


def test_overlap_is_clamped() -> None:
    assert Counters(comm_total=1.0, comm_exposed=2.0).overlap == 0.0
    assert Counters(comm_total=1.0, comm_exposed=-1.0).overlap == 1.0


# -- Adaptation ----------------------------------------------------------------------------


def test_adaptation_doubles_after_patience_below_floor_up_to_ceiling() -> None:
    adapt = Adaptation(start=2, ceiling=8, floor=0.7, patience=2)
    assert adapt.observe(0.5, True) == 2
    assert adapt.observe(0.6, True) == 4
    assert adapt.observe(0.5, True) == 4  # the streak starts over after a change
    assert adapt.observe(0.4, True) == 8
    for _ in range(6):
        assert adapt.observe(0.0, True) == 8
    assert adapt.changes == [(4, 0.6), (8, 0.4)]


def test_adaptation_stops_at_ceiling_that_is_not_a_doubling() -> None:
    adapt = Adaptation(start=3, ceiling=8, patience=1)
    assert [adapt.observe(0.1, True) for _ in range(3)] == [6, 8, 8]


def test_adaptation_streak_broken_by_one_good_window() -> None:
    adapt = Adaptation(start=1, ceiling=4, floor=0.7, patience=2)
    assert adapt.observe(0.5, True) == 1
    assert adapt.observe(0.9, True) == 1
    assert adapt.observe(0.5, True) == 1
    assert adapt.observe(0.5, True) == 2


def test_adaptation_ignores_windows_without_communication() -> None:
    adapt = Adaptation(start=1, ceiling=4, floor=0.7, patience=2)
    for _ in range(5):
        assert adapt.observe(0.0, False) == 1
    assert adapt.changes == []
    assert adapt.observe(0.5, True) == 1
    assert adapt.observe(0.9, False) == 1  # neither counts nor breaks the streak
    assert adapt.observe(0.5, True) == 2


def test_adaptation_never_decreases() -> None:
    adapt = Adaptation(start=2, ceiling=16, patience=1)
    assert adapt.observe(0.1, True) == 4
    for _ in range(10):
        assert adapt.observe(1.0, True) == 4
    assert adapt.changes == [(4, 0.1)]


def test_adaptation_fixed_when_ceiling_below_start() -> None:
    adapt = Adaptation(start=4, ceiling=2, patience=1)
    assert adapt.ceiling == 4
    assert adapt.observe(0.0, True) == 4
    assert adapt.changes == []


# -- GroupSpec -----------------------------------------------------------------------------


@pytest.fixture
def tp2_pp2() -> EngineConfig:
    return parse_engine_config(
        {"model": {"uri": "/tmp/x"}, "parallel": {"tensor": 2, "pipeline": 2}}
    )


def _env(**overrides: str) -> dict[str, str]:
    env = {
        "BROOK_WORLD_SIZE": "4",
        "BROOK_DEVICES_PER_POD": "2",
        "BROOK_POD_RANK": "1",
        "MASTER_ADDR": "leader.brook.svc",
        "MASTER_PORT": "31000",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_no_operator_environment_means_a_local_group(tp2_pp2: EngineConfig) -> None:
    spec = GroupSpec.from_environment(tp2_pp2, env={"MASTER_ADDR": "ignored"})
    assert (spec.world_size, spec.devices_per_pod, spec.pod_rank) == (4, 4, 0)
    assert spec.local_ranks == range(4)
    assert spec.rendezvous.host == "127.0.0.1"
    assert 0 < spec.rendezvous.port < 65536
    assert spec.rendezvous.timeout_seconds == tp2_pp2.parallel.timeout_seconds


def test_operator_environment_places_this_pods_ranks(tp2_pp2: EngineConfig) -> None:
    spec = GroupSpec.from_environment(tp2_pp2, env=_env())
    assert (spec.world_size, spec.devices_per_pod, spec.pod_rank) == (4, 2, 1)
    assert spec.first_rank == 2
    assert spec.local_ranks == range(2, 4)
    assert (spec.rendezvous.host, spec.rendezvous.port) == ("leader.brook.svc", 31000)


@pytest.mark.parametrize("port", ["<unset>", ""])
def test_missing_master_port_uses_default(tp2_pp2: EngineConfig, port: str) -> None:
    spec = GroupSpec.from_environment(tp2_pp2, env=_env(MASTER_PORT=port))
    assert spec.rendezvous.port == DEFAULT_PORT == 29500


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"BROOK_WORLD_SIZE": "8"}, "BROOK_WORLD_SIZE"),
        ({"BROOK_WORLD_SIZE": "four"}, "BROOK_WORLD_SIZE"),
        ({"BROOK_DEVICES_PER_POD": "2.0"}, "BROOK_DEVICES_PER_POD"),
        ({"BROOK_DEVICES_PER_POD": "<unset>"}, "BROOK_DEVICES_PER_POD"),
        ({"BROOK_DEVICES_PER_POD": "3"}, "BROOK_DEVICES_PER_POD"),
        ({"BROOK_DEVICES_PER_POD": "0"}, "BROOK_DEVICES_PER_POD"),
        ({"BROOK_POD_RANK": "2"}, "BROOK_POD_RANK"),
        ({"BROOK_POD_RANK": "-1"}, "BROOK_POD_RANK"),
        ({"BROOK_POD_RANK": ""}, "BROOK_POD_RANK"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
    ],
)
def test_bad_operator_environment_names_the_variable(
    tp2_pp2: EngineConfig, overrides: dict[str, str], variable: str
) -> None:
    with pytest.raises(ConfigError, match=variable):
        GroupSpec.from_environment(tp2_pp2, env=_env(**overrides))


def test_local_group_places_every_rank_here(tp2_pp2: EngineConfig) -> None:
    spec = GroupSpec.local(tp2_pp2)
    assert (spec.first_rank, spec.local_ranks) == (0, range(4))
    assert spec.rendezvous.host == "127.0.0.1"


# -- Shard ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp_size", "total", "slices"),
    [(1, 96, [(0, 96)]), (2, 96, [(0, 48), (48, 96)]), (4, 8, [(0, 2), (2, 4), (4, 6), (6, 8)])],
)
def test_shard_split(tp_size: int, total: int, slices: list[tuple[int, int]]) -> None:
    assert [Shard(r, tp_size).split(total) for r in range(tp_size)] == slices


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp_size", "expected"),
    [
        (8, 8, 2, [(0, 4), (4, 8)]),  # split evenly
        (8, 2, 2, [(0, 1), (1, 2)]),
        (4, 1, 2, [(0, 1), (0, 1)]),  # replicated: one KV head for everyone
        (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # each rank keeps its query heads' head
        (6, 2, 6, [(0, 1)] * 3 + [(1, 2)] * 3),
    ],
)
def test_shard_kv_heads(
    heads: int, kv_heads: int, tp_size: int, expected: list[tuple[int, int]]
) -> None:
    assert [Shard(r, tp_size).kv_heads(heads, kv_heads) for r in range(tp_size)] == expected


@pytest.mark.parametrize(
    ("vocab", "tp_size", "expected"),
    [
        (320, 1, [(0, 320, 320)]),
        (320, 2, [(0, 160, 160), (160, 320, 160)]),
        (321, 2, [(0, 161, 161), (161, 321, 161)]),  # the last slice has one padding row
        (10, 4, [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]),
    ],
)
def test_shard_vocab(vocab: int, tp_size: int, expected: list[tuple[int, int, int]]) -> None:
    assert [Shard(r, tp_size).vocab(vocab) for r in range(tp_size)] == expected


# -- loading a sharded model ---------------------------------------------------------------


def _load(folder: Path, shard: Shard) -> CausalLM:
    """As the model runner loads a rank's part: meta build, empty, tie, fill."""
    arch = ModelArch.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(arch, torch.float32, shard)
    model.to_empty(device="cpu")
    model.tie_embeddings()
    load_weights(model, folder, progress=False)
    return model


def _params(model: CausalLM) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.fixture
def llama(make_tiny_model: Any) -> Path:
    # 4 query heads, 2 KV heads, head_dim 16, hidden 64, MLP 96, vocab 320, untied
    return make_tiny_model("llama", num_hidden_layers=4)  # type: ignore[no-any-return]


def test_tp2_column_parallel_slices_reassemble(llama: Path) -> None:
    full = _params(_load(llama, Shard()))
    ranks = [_params(_load(llama, Shard(r, 2))) for r in range(2)]
    q, kv = 2 * 16, 16  # per rank: 2 query heads, 1 KV head
    for layer in range(4):
        name = f"model.layers.{layer}.self_attn.qkv_proj.weight"
        parts = [p[name] for p in ranks]
        assert parts[0].shape == (q + 2 * kv, 64)
        reassembled = torch.cat(
            [
                *(p[:q] for p in parts),
                *(p[q : q + kv] for p in parts),
                *(p[q + kv :] for p in parts),
            ]
        )
        torch.testing.assert_close(reassembled, full[name], rtol=0, atol=0)
        name = f"model.layers.{layer}.mlp.gate_up_proj.weight"
        parts = [p[name] for p in ranks]
        reassembled = torch.cat([*(p[:48] for p in parts), *(p[48:] for p in parts)])
        torch.testing.assert_close(reassembled, full[name], rtol=0, atol=0)


def test_tp2_row_parallel_weights_are_column_slices(llama: Path) -> None:
    full = _params(_load(llama, Shard()))
    for rank in range(2):
        part = _params(_load(llama, Shard(rank, 2)))
        for name, width in [("self_attn.o_proj", 32), ("mlp.down_proj", 48)]:
            key = f"model.layers.1.{name}.weight"
            expected = full[key][:, rank * width : (rank + 1) * width]
            torch.testing.assert_close(part[key], expected, rtol=0, atol=0)
        # Norms are replicated; the vocabulary splits by rows.
        key = "model.layers.1.input_layernorm.weight"
        torch.testing.assert_close(part[key], full[key], rtol=0, atol=0)
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            torch.testing.assert_close(
                part[key], full[key][rank * 160 : (rank + 1) * 160], rtol=0, atol=0
            )


def test_tp4_replicates_the_kv_head_of_each_ranks_queries(llama: Path) -> None:
    full = _params(_load(llama, Shard()))["model.layers.0.self_attn.qkv_proj.weight"]
    full_k, full_v = full[64:96], full[96:128]
    for rank in range(4):
        part = _params(_load(llama, Shard(rank, 4)))["model.layers.0.self_attn.qkv_proj.weight"]
        head = rank // 2
        assert part.shape == (16 + 2 * 16, 64)
        torch.testing.assert_close(part[:16], full[rank * 16 : (rank + 1) * 16], rtol=0, atol=0)
        torch.testing.assert_close(part[16:32], full_k[head * 16 : (head + 1) * 16])
        torch.testing.assert_close(part[32:], full_v[head * 16 : (head + 1) * 16])


def test_pipeline_stages_hold_their_layers_only(llama: Path) -> None:
    full = _params(_load(llama, Shard()))
    last = _load(llama, Shard(0, 1, 2, 4, first_stage=False, last_stage=True))
    assert len(last.model.layers) == 2
    assert last.model.embed_tokens is None
    assert last.model.norm is not None and last.lm_head is not None
    params = _params(last)
    assert not any(name.startswith("model.embed_tokens") for name in params)
    for local, global_ in [(0, 2), (1, 3)]:
        key = f"model.layers.{local}.self_attn.qkv_proj.weight"
        expected = full[f"model.layers.{global_}.self_attn.qkv_proj.weight"]
        torch.testing.assert_close(params[key], expected, rtol=0, atol=0)
    for key in ("model.norm.weight", "lm_head.weight"):
        torch.testing.assert_close(params[key], full[key], rtol=0, atol=0)

    first = _load(llama, Shard(0, 1, 0, 2, first_stage=True, last_stage=False))
    assert len(first.model.layers) == 2
    assert first.model.embed_tokens is not None
    assert first.model.norm is None and first.lm_head is None


def test_tied_last_stage_reads_its_head_from_the_embedding(make_tiny_model: Any) -> None:
    qwen = make_tiny_model("qwen2")  # tied embeddings: the checkpoint has no lm_head.weight
    full = _params(_load(qwen, Shard()))
    for rank in range(2):
        last = _load(qwen, Shard(rank, 2, 1, 3, first_stage=False, last_stage=True))
        assert last.model.embed_tokens is None
        assert last.lm_head is not None
        expected = full["model.embed_tokens.weight"][rank * 160 : (rank + 1) * 160]
        torch.testing.assert_close(last.lm_head.weight, expected, rtol=0, atol=0)


def test_vocab_padding_rows_are_zero(make_tiny_model: Any) -> None:
    folder = make_tiny_model("llama", num_hidden_layers=1, vocab_size=321)
    full = _params(_load(folder, Shard()))
    last = _params(_load(folder, Shard(1, 2)))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert last[key].shape[0] == 161
        torch.testing.assert_close(last[key][:160], full[key][161:], rtol=0, atol=0)
        assert torch.count_nonzero(last[key][160:]) == 0


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.k_proj.weight", (48, 64)),  # too many rows
        ("model.layers.1.mlp.down_proj.weight", (64, 95)),  # row-parallel: wrong width
        ("model.layers.2.post_attention_layernorm.weight", (65,)),
        ("model.embed_tokens.weight", (319, 64)),
    ],
)
def test_wrong_shape_is_an_error_naming_the_tensor(
    llama: Path, tmp_path: Path, name: str, shape: tuple[int, ...], tp_size: int
) -> None:
    folder = copy_with(llama, tmp_path, {name: torch.zeros(shape)})
    with pytest.raises(ConfigError, match=rf"tensor '{name}' has shape"):
        _load(folder, Shard(tp_size - 1, tp_size))


@pytest.mark.parametrize("name", ["model.layers.2.input_layernorm.weight", "model.norm.weight"])
def test_short_replicated_tensor_is_a_shape_error(llama: Path, tmp_path: Path, name: str) -> None:
    folder = copy_with(llama, tmp_path, {name: torch.zeros(63)})
    with pytest.raises(ConfigError, match=rf"tensor '{name}' has shape \(63,\)"):
        _load(folder, Shard())


def test_missing_and_unexpected_tensors_are_named(llama: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    missing.mkdir()
    copy_with(llama, missing, {"model.layers.3.mlp.up_proj.weight": None})
    with pytest.raises(ConfigError, match=r"lacks model\.layers\.3\.mlp\.gate_up_proj\.weight"):
        _load(missing, Shard())
    extra = tmp_path / "extra"
    extra.mkdir()
    copy_with(llama, extra, {"model.layers.9.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model\.layers\.9\.mlp"):
        _load(extra, Shard())


# -- configuration against the model -------------------------------------------------------

FACTS = ModelFacts(
    num_layers=4,
    num_attention_heads=4,
    num_kv_heads=2,
    max_position_embeddings=512,
    intermediate_size=96,
)


def _config(**parallel: object) -> EngineConfig:
    return parse_engine_config({"model": {"uri": "/tmp/x"}, "parallel": parallel})


def test_a_fitting_parallel_config_passes() -> None:
    _config(tensor=4, pipeline=2, stageLayers=[3, 1]).check_against_model(FACTS)


@pytest.mark.parametrize(
    ("parallel", "facts", "message"),
    [
        (
            {"pipeline": 2, "stageLayers": [1, 2]},
            FACTS,
            "parallel.stageLayers sums to 3 layers but the model has 4",
        ),
        (
            {"tensor": 4},
            ModelFacts(4, 4, 2, 512, intermediate_size=90),
            r"parallel.tensor \(4\) must divide the model's MLP width \(90\)",
        ),
        ({"tensor": 8}, FACTS, r"parallel.tensor \(8\) must divide the model's 4 attention"),
        ({"pipeline": 5}, FACTS, r"parallel.pipeline \(5\) exceeds the model's 4 layers"),
    ],
)
def test_parallel_config_that_does_not_fit_the_model(
    parallel: dict[str, object], facts: ModelFacts, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**parallel).check_against_model(facts)


def test_stage_layers_must_list_one_count_per_stage() -> None:
    with pytest.raises(ConfigError, match="stageLayers lists 3 stages"):
        _config(pipeline=2, stageLayers=[1, 1, 2])


def test_adaptation_trial_alternates_and_keeps_a_raise_that_gains() -> None:
    adapt = Adaptation(start=2, ceiling=16, floor=0.7, patience=1, margin=0.05)
    # Low overlap: a trial runs 4, 2, 2, 4 and compares the arms' mean throughput.
    assert adapt.observe(0.3, True, rate=100.0) == 4
    assert adapt.trying
    assert adapt.observe(0.5, True, rate=150.0) == 2  # the raised arm's window
    assert adapt.observe(0.2, True, rate=60.0) == 2  # the base arm's windows
    assert adapt.observe(0.5, True, rate=140.0) == 4
    # 4: (150 + 70) / 2 = 110; 2: (60 + 140) / 2 = 100 -- kept: at least 5 % better
    assert adapt.observe(0.2, True, rate=70.0) == 4
    assert not adapt.trying and not adapt.settled
    assert adapt.changes == [(4, 0.3)]


@pytest.mark.parametrize("raised", [80.0, 100.0, 104.0])
def test_adaptation_trial_without_a_clear_gain_settles_at_the_base(raised: float) -> None:
    adapt = Adaptation(start=2, ceiling=16, floor=0.7, patience=1, margin=0.05)
    assert adapt.observe(0.3, True, rate=100.0) == 4
    for rate in (raised, 100.0, 100.0):  # windows at 4, 2, 2
        adapt.observe(0.5, True, rate=rate)
    assert adapt.observe(0.5, True, rate=raised) == 2  # 4 ran below 105 % of 2's 100
    assert adapt.settled and adapt.changes == []
    assert adapt.observe(0.1, True, rate=10.0) == 2  # never tries again
    assert adapt.observe(0.1, True, rate=10.0) == 2


def test_a_trial_whose_load_mix_changes_is_dropped_and_retried_later() -> None:
    """A trial that starts in the tail of a prompt burst would credit the raise with cheap
    prompt tokens: once a window's share of prompt tokens moves by more than the
    tolerance, the trial is dropped (not settled) and the count goes back."""
    adapt = Adaptation(start=1, ceiling=8, floor=0.7, patience=1, margin=0.05)
    assert adapt.observe(0.0, True, rate=500.0, mix=0.6) == 2  # a trial starts
    assert adapt.observe(0.4, True, rate=400.0, mix=0.5) == 1  # raised arm, prompt tail
    assert adapt.observe(0.0, True, rate=100.0, mix=0.0) == 1  # decoding now: dropped
    assert not adapt.trying and not adapt.settled and adapt.dropped_trials == 1
    assert adapt.changes == []
    # On a steady mix the next trial runs to its end (and here finds no gain).
    assert adapt.observe(0.0, True, rate=100.0, mix=0.0) == 2
    for rate, mix in ((90.0, 0.02), (100.0, 0.0), (100.0, 0.05)):
        adapt.observe(0.5, True, rate=rate, mix=mix)
    assert adapt.observe(0.5, True, rate=90.0, mix=0.0) == 1
    assert adapt.settled and adapt.dropped_trials == 1


def test_counters_carry_the_prefill_share() -> None:
    monitor = OverlapMonitor()
    monitor.end_step(wall=1.0, tokens=100, prefill_tokens=75)
    again = Counters.from_vector(monitor.totals.vector())
    assert again.prefill_tokens == 75.0 and again.tokens == 100.0
    assert again.prefill_share == pytest.approx(0.75)
    assert Counters().prefill_share == 0.0
