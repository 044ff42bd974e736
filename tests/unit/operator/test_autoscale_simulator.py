"""The autoscaler simulator: traces, profiles, the replica model, fleets under a policy, the
scores, the shipped traces and the ``brook autoscale simulate`` command (tiny traces only)."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import math
import random
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from brook_operator.api.autoscaling import AutoscalingSpec
from brook_operator.autoscaler.policy import Policy
from brook_operator.autoscaler.simulate import (
    Autoscaled,
    Profile,
    Request,
    RunResult,
    SimulationError,
    compare,
    load_profile,
    make_traces,
    read_trace,
    scale_rate,
    shipped_profiles,
    shipped_traces,
    simulate,
    static_peak,
    write_trace,
)
from brook_operator.autoscaler.simulate.baselines import attainment, autoscaled
from brook_operator.autoscaler.simulate.oracle import Oracle, oracle
from brook_operator.autoscaler.simulate.profile import StepSeconds
from brook_operator.autoscaler.simulate.replica import Job, Outcome, Replica
from brook_operator.autoscaler.simulate.report import reversals, summary
from brook_operator.autoscaler.simulate.router import Router, has_room
from brook_operator.autoscaler.simulate.run import _Fleet
from brook_operator.autoscaler.simulate.trace import (
    TRACES_DIR,
    parse_trace,
    resolve_trace,
    trace_text,
)
from brook_operator.cli import main


def _profile(**changes: Any) -> Profile:
    """A small, fast replica: ~6 requests/s of 200 in / 20 out at full batch."""
    fields: dict[str, Any] = {
        "name": "tiny",
        "description": "test",
        "source": ["test"],
        "step_seconds": StepSeconds(base=0.02, per_sequence=0.004, per_prefill_token=0.0001),
        "max_num_seqs": 8,
        "max_batched_tokens": 256,
        "kv_cache_tokens": 4096,
        "cold_start_seconds": 10,
        "ttft_slo_seconds": 1.0,
        "max_replicas": 8,
    }
    fields.update(changes)
    return Profile(**fields)


def _poisson(
    rate: float, start: float, end: float, seed: int = 1, size: int = 200
) -> list[Request]:
    rng, t, out = random.Random(seed), start, list[Request]()
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append(Request(round(t, 3), size, 20))


def _trace(*parts: tuple[float, float, float]) -> list[Request]:
    """Poisson phases (rate, start, end), merged in arrival order."""
    requests = [r for i, p in enumerate(parts) for r in _poisson(*p, seed=i + 1)]
    return sorted(requests, key=lambda r: r.arrival_s)


# -- traces --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (
            ["arrival_s,input_tokens,output_tokens", "0.5,10,5", "1.0,ten,5"],
            "line 3, column input_tokens",
        ),
        (["arrival_s,input_tokens,output_tokens", "0.5,10"], "line 2: 2 column(s)"),
        (["arrival_s,input_tokens,output_tokens", "0.5,10,0"], "line 2, column output_tokens"),
        (["arrival_s,input_tokens,output_tokens", "2,10,5", "1,10,5"], "line 3, column arrival_s"),
        (["arrival_s,input_tokens,output_tokens", "x,10,5"], "line 2, column arrival_s"),
        (["arrival,input,output", "0,10,5"], "line 1: header"),
        (["arrival_s,input_tokens,output_tokens"], "no requests"),
    ],
)
def test_bad_trace_rows_name_line_and_column(rows: list[str], expected: str) -> None:
    with pytest.raises(
        SimulationError, match="trace.*" + expected.replace("(", r"\(").replace(")", r"\)")
    ):
        parse_trace(rows, "trace.csv")


def test_trace_round_trips_through_csv_and_gzip(tmp_path: Path) -> None:
    requests = [Request(0.0, 10, 5), Request(1.25, 300, 40)]
    for name in ("t.csv", "t.csv.gz"):
        write_trace(requests, tmp_path / name)
        assert read_trace(tmp_path / name) == requests
    with pytest.raises(SimulationError, match=r"a \.csv or \.csv\.gz file"):
        read_trace(tmp_path / "t.json")


def test_rate_scale_keeps_the_shape() -> None:
    requests = _trace((2.0, 0, 100), (8.0, 100, 200))
    doubled = scale_rate(requests, 2.0)
    assert len(doubled) == 2 * len(requests)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(doubled))
    late = sum(1 for r in doubled if r.arrival_s >= 100)
    assert late / len(doubled) == pytest.approx(0.8, abs=0.05)
    assert 0.4 < len(scale_rate(requests, 0.5)) / len(requests) < 0.6


# -- profiles ------------------------------------------------------------------------------


def test_shipped_profiles_load_and_interpolate_overlap() -> None:
    assert set(shipped_profiles()) >= {"smollm2-135m-cpu", "npu-72b-tp4pp2"}
    cpu = load_profile("smollm2-135m-cpu")
    assert cpu.overlap_ratio(7) == 1.0  # no communication
    npu = load_profile("npu-72b-tp4pp2")
    assert npu.overlap_ratio(0) == pytest.approx(0.4)  # clamped
    assert npu.overlap_ratio(24) == pytest.approx((0.62 + 0.85) / 2)
    assert npu.overlap_ratio(1000) == 1.0
    assert any("brook-engine bench" in line for line in cpu.source)
    # the measured start, with and without a warm compile cache
    assert any("--workload cold-start" in line for line in cpu.source)
    assert cpu.cold_start_uncached_seconds is not None
    assert cpu.cold_start_uncached_seconds > cpu.cold_start_seconds


def test_bad_profile_names_the_field(tmp_path: Path) -> None:
    data = json.loads((TRACES_DIR.parent / "profiles" / "smollm2-135m-cpu.json").read_text())
    data["step_seconds"]["base"] = -1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SimulationError, match=r"step_seconds\.base"):
        load_profile(str(path))
    with pytest.raises(SimulationError, match="no shipped profile"):
        load_profile("no-such-profile")


# -- one replica ---------------------------------------------------------------------------


def test_a_lone_request_takes_one_prefill_step_and_output_decode_steps() -> None:
    profile = _profile()
    result = simulate([Request(0.0, 200, 20)], profile, 1)
    assert result.ttft[0] == pytest.approx(0.02 + 200 * 0.0001)
    assert result.finished[0] == pytest.approx(result.ttft[0] + 19 * (0.02 + 0.004))


def test_kv_pressure_preempts_and_every_request_still_completes() -> None:
    profile = _profile(kv_cache_tokens=1200, max_num_seqs=8)
    requests = [Request(i * 0.01, 200, 300) for i in range(12)]
    result = simulate(requests, profile, 1)
    assert result.preemptions > 0
    assert result.completed == len(requests)
    assert all(not math.isnan(t) for t in result.finished)


def test_a_request_larger_than_the_cache_is_refused() -> None:
    with pytest.raises(SimulationError, match="line 2: 4000 \\+ 200 tokens exceed"):
        simulate([Request(0, 4000, 200)], _profile(), 1)


# -- fleets --------------------------------------------------------------------------------


def test_a_big_enough_static_fleet_meets_the_slo_and_a_small_one_does_not() -> None:
    profile = _profile()
    requests = _trace((15.0, 0, 120))
    small, big = simulate(requests, profile, 1), simulate(requests, profile, 4)
    assert attainment(big, 1.0) >= 0.99
    assert attainment(small, 1.0) < 0.5
    assert small.completed == big.completed == len(requests)
    peak = static_peak(requests, profile, 1.0, 8)
    assert peak.meets_slo
    assert 1 < peak.replicas <= 4
    assert peak.tried[peak.replicas] and not peak.tried.get(peak.replicas - 1, False)


def test_replica_hours_of_a_static_fleet_are_replicas_times_hours() -> None:
    requests = _trace((2.0, 0, 1800))
    result = simulate(requests, _profile(), 3)
    hours = result.duration_s / 3600
    assert result.duration_s == pytest.approx(1800, abs=5)
    assert result.replica_seconds / 3600 == pytest.approx(3 * hours)
    row = summary(result, 1.0, result.replica_seconds / 3600, 300)
    assert row["mean_replicas"] == pytest.approx(3.0)
    assert row["replica_hours_vs_static_peak"] == 1.0
    assert row["completed"] == row["requests"] == len(requests)


def _spec(**fields: Any) -> AutoscalingSpec:
    base = {
        "maxReplicas": 8,
        "intervalSeconds": 5,
        "scaleDownStabilizationSeconds": 60,
        "startupGraceSeconds": 30,
        "targetWaitingRequests": 2,
    }
    return AutoscalingSpec.model_validate({**base, **fields})


def test_a_load_step_scales_out_and_the_fleet_scales_in_after_the_window() -> None:
    profile = _profile(kv_cache_tokens=1536)  # KV fills before the batch does
    requests = _trace((3.0, 0, 120), (20.0, 120, 300), (3.0, 300, 600))
    result = simulate(requests, profile, 1, autoscaled("brook", _spec()))
    ups = [e for e in result.scale_events if e[2] > e[1]]
    downs = [e for e in result.scale_events if e[2] < e[1]]
    assert any(120 <= t < 150 and after >= 3 for t, _, after in ups)  # the step, seen fast
    assert downs
    # Every scale-in comes a whole window (60 s) after the scale-out before it.
    assert all(d[0] - max(u[0] for u in ups if u[0] < d[0]) >= 60 for d in downs if d[0] > 120)
    during = [n for t, n in result.timeline if 150 <= t < 300]
    assert max(during) >= 4 and result.timeline[-1][1] <= 2  # back down once the load is gone
    assert result.completed == len(requests)


def test_scale_in_drains_the_replica_holding_the_least_kv() -> None:
    profile = _profile()
    fleet = _Fleet(profile, Outcome(0, 1.0))
    for _ in range(3):
        fleet.add(0.0, ready_at=0.0)
    a, b, c = fleet.replicas
    a.prompt_held, b.prompt_held, c.prompt_held = 900.0, 100.0, 500.0
    fleet.drain(1, now=1.0)
    assert [r.draining for r in fleet.replicas] == [False, True, False]
    assert fleet.remove_drained(2.0)  # it was empty of requests: gone
    assert fleet.replicas == [a, c]
    fleet.add(5.0)  # still starting at 6.0: removed before any ready one
    fleet.drain(1, now=6.0)
    assert [r.draining for r in fleet.replicas] == [False, False, True]


def test_a_draining_replica_finishes_its_requests_before_it_goes() -> None:
    profile = _profile()
    requests = _trace((20.0, 0, 60), (0.5, 60, 400))
    spec = _spec(minReplicas=1, scaleDownStabilizationSeconds=0, startupGraceSeconds=0)
    result = simulate(requests, profile, 4, autoscaled("brook", spec))
    assert any(e[2] < e[1] for e in result.scale_events)
    assert result.completed == len(requests)


def test_reversals_count_a_change_of_mind_within_the_window() -> None:
    events = [(0.0, 2, 4), (100.0, 4, 3), (500.0, 3, 5), (900.0, 5, 6), (950.0, 6, 2)]
    # up→down after 100 s: yes; down→up after 400 s: no; up→up: no; up→down after 50 s: yes.
    assert reversals(events, 300) == 2
    assert reversals(events, 30) == 0
    assert reversals([], 300) == 0


def test_queue_only_reads_the_queue_alone() -> None:
    queue = autoscaled("queue-only", _spec())
    assert queue.policy.signals == frozenset({"queue"})
    assert queue.interval_seconds == 30
    assert autoscaled("kv-only", _spec()).policy.signals == frozenset({"kv"})
    brook = autoscaled("brook", _spec())
    assert brook == Autoscaled(Policy.from_spec(_spec()), 5)


def test_compare_scores_every_policy_against_static_peak() -> None:
    profile = _profile()
    requests = _trace((3.0, 0, 300), (12.0, 300, 600), (3.0, 600, 900))
    out = compare(requests, profile, _spec(), slo_seconds=1.0)
    assert set(out.rows) == {
        "brook",
        "brook-history",
        "no-overlap",
        "no-arrival",
        "kv-only",
        "queue-only",
        "static-peak",
        "static-mean",
        "oracle-reactive",
        "oracle-clairvoyant",
    }
    peak = out.rows["static-peak"]
    assert peak["replica_hours_vs_static_peak"] == 1.0
    assert peak["slo_attainment"] >= 0.99
    assert out.rows["static-mean"]["replicas"] <= peak["replicas"]
    for row in out.rows.values():
        assert row["completed"] == row["requests"] == len(requests)


# -- oracles -------------------------------------------------------------------------------


def _oracle(name: str, requests: list[Request], **changes: Any) -> Oracle:
    fields: dict[str, Any] = {
        "tokens_per_replica": 100.0,
        "cold_start_seconds": 30.0,
        "headroom": 1.0,
        "min_replicas": 1,
        "max_replicas": 8,
    }
    fields.update(changes)
    return oracle(name, requests, **fields)


def test_oracles_size_from_the_true_demand_of_their_windows() -> None:
    # 1 request/s of 100 tokens until t=120, then 5/s: 100 tok/s, then 500 tok/s.
    requests = [Request(t * 1.0, 80, 20) for t in range(120)]
    requests += [Request(120 + i * 0.2, 80, 20) for i in range(600)]
    reactive = _oracle("oracle-reactive", requests)
    clairvoyant = _oracle("oracle-clairvoyant", requests)
    assert reactive.demand(0, 60) == pytest.approx(100.0)
    assert reactive.demand(120, 180) == pytest.approx(500.0)
    assert reactive.demand(50, 50) == 0.0
    # Reactive: the last minute; before a full minute, the opening one.
    assert reactive.size(15)[0] == 1
    assert reactive.size(119)[0] == 1
    assert reactive.size(180)[0] == 5
    assert reactive.size(150)[0] == 3  # half a minute of each rate: 300 tok/s
    # Clairvoyant: also the minute that starts one cold start (30 s) ahead.
    assert clairvoyant.size(90)[0] == 5
    assert "in 30s" in clairvoyant.size(90)[1]
    assert clairvoyant.size(30)[0] == 1  # [60, 120) ahead: still 100 tok/s
    # Headroom multiplies; the bounds clip.
    assert _oracle("oracle-reactive", requests, headroom=1.5).size(180)[0] == 8
    assert _oracle("oracle-reactive", requests, max_replicas=4).size(180)[0] == 4
    assert _oracle("oracle-reactive", requests, min_replicas=2).size(30)[0] == 2


def test_oracle_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="not an oracle"):
        _oracle("brook", [Request(0.0, 10, 10)])
    with pytest.raises(ValueError, match="positive"):
        _oracle("oracle-reactive", [Request(0.0, 10, 10)], headroom=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        Autoscaled(None, 15)
    with pytest.raises(ValueError, match="exactly one"):
        Autoscaled(Policy.from_spec(_spec()), 15, _oracle("oracle-reactive", [Request(0.0, 1, 1)]))


def test_foresight_serves_a_step_that_a_perfect_reactive_scaler_misses() -> None:
    # A 4x step with a cold start far longer than the SLO: the reactive oracle measures the
    # step exactly, one decision late, and its new replicas serve a cold start later; the
    # clairvoyant one has them ready when the step comes.
    profile = _profile(cold_start_seconds=60)
    requests = _trace((3.0, 0, 300), (12.0, 300, 600), (3.0, 600, 900))
    out = compare(
        requests, profile, _spec(), ["oracle-reactive", "oracle-clairvoyant"], slo_seconds=1.0
    )
    reactive, clairvoyant = out.rows["oracle-reactive"], out.rows["oracle-clairvoyant"]
    assert reactive["headroom"] == clairvoyant["headroom"] == 1.0
    assert clairvoyant["slo_attainment"] >= 0.99
    assert reactive["slo_attainment"] < clairvoyant["slo_attainment"] - 0.02
    reactive_run = out.results["oracle-reactive"]
    missed_at = [a for a, t in zip(reactive_run.arrivals, reactive_run.ttft, strict=True) if t > 1]
    assert missed_at and all(300 <= a < 600 for a in missed_at)  # the step's, only
    # It sized for the step exactly, one decision after it began.
    assert reactive_run.scale_events[0][0] == 325.0
    for row in (reactive, clairvoyant):
        assert row["completed"] == row["requests"] == len(requests)


# -- shipped traces ------------------------------------------------------------------------

MULTI_DAY = {"daily-surge"}


def name_of(path: Path) -> str:
    return path.name.removesuffix(".csv.gz")


def test_regenerating_the_shipped_traces_gives_identical_files(tmp_path: Path) -> None:
    assert shipped_traces() == sorted(make_traces.TRACES)
    for path in make_traces.write_all(tmp_path):
        shipped = TRACES_DIR / path.name
        # The CSV text is the contract; the gzip bytes match too with the same zlib.
        assert gzip.decompress(path.read_bytes()) == gzip.decompress(shipped.read_bytes())
        assert path.read_bytes() == shipped.read_bytes()
        # Three days of arrivals are 200k rows; an hour is a few thousand.
        limit = 2_000_000 if name_of(path) in MULTI_DAY else 300_000
        assert shipped.stat().st_size < limit


def test_shipped_traces_are_an_hour_of_plausible_requests() -> None:
    for name in shipped_traces():
        requests = read_trace(TRACES_DIR / f"{name}.csv.gz")
        end = 3 * 86_400 if name in MULTI_DAY else 3600
        assert end - 100 < requests[-1].arrival_s <= end
        assert trace_text(requests) == trace_text(make_traces.make(name))
    burst = read_trace(TRACES_DIR / "long-prompt-burst.csv.gz")
    long = [r for r in burst if r.input_tokens >= 1500]
    assert long and all(1500 <= r.arrival_s < 2100 for r in long if r.input_tokens > 2048)


# -- the command ---------------------------------------------------------------------------


def _tiny_files(tmp_path: Path) -> tuple[Path, Path]:
    trace = tmp_path / "tiny.csv"
    write_trace(_trace((3.0, 0, 200), (10.0, 200, 400)), trace)
    profile = tmp_path / "tiny.json"
    profile.write_text(_profile().model_dump_json())
    return trace, profile


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, profile = _tiny_files(tmp_path)
    args = ["autoscale", "simulate", "--trace", str(trace), "--profile", str(profile)]
    assert main([*args, "--json", "--policies", "brook,static-peak"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slo_ttft_s"] == 1.0 and out["profile"] == "tiny"
    assert set(out["policies"]) == {"brook", "static-peak"}
    assert out["policies"]["brook"]["completed"] == out["policies"]["brook"]["requests"]
    assert main([*args, "--policies", "static-mean", "--slo-ttft", "2"]) == 0
    assert "static-mean" in capsys.readouterr().out
    assert main([*args, "--json", "--policies", "oracle-reactive", "--oracle-headroom", "1.5"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["oracle-reactive"]["headroom"] == 1.5
    assert main([*args, "--policies", "oracle-reactive", "--oracle-headroom", "0"]) == 2
    assert "--oracle-headroom 0: use a positive multiple" in capsys.readouterr().err
    assert main([*args, "--policies", "brook", "--uncached-start"]) == 2
    assert "no cold_start_uncached_seconds" in capsys.readouterr().err
    uncached = tmp_path / "uncached.json"
    uncached.write_text(_profile(cold_start_uncached_seconds=40).model_dump_json())
    assert main([*args[:-1], str(uncached), "--policies", "brook", "--uncached-start"]) == 0


def test_a_window_scores_the_requests_arriving_in_it_each_day(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, profile = _tiny_files(tmp_path)  # 0-400 s: 3 requests/s, 10 from 200 s
    args = ["autoscale", "simulate", "--trace", str(trace), "--profile", str(profile)]
    assert main([*args, "--json", "--policies", "brook", "--window", "00:03-00:05"]) == 0
    row = json.loads(capsys.readouterr().out)["policies"]["brook"]
    arrivals = [r.arrival_s for r in read_trace(trace)]
    (day,) = row["window"]  # a trace shorter than a day has one
    assert day["day"] == 1 and day["requests"] == sum(1 for a in arrivals if 180 <= a < 300)
    assert 0 <= day["slo_attainment"] <= 1 and day["ttft_p99_s"] > 0
    assert main([*args, "--policies", "brook", "--window", "00:03-00:05"]) == 0
    assert "requests arriving 00:03-00:05, each day" in capsys.readouterr().out
    for bad in ("9-10", "10:00-09:00", "08:00-25:00"):
        assert main([*args, "--policies", "brook", "--window", bad]) == 2
        assert "--window: window" in capsys.readouterr().err


def test_measured_starts_come_from_the_cold_start_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report ``brook-engine bench --workload cold-start --json`` writes: each start's
    median to the first token, plus the pod's own start."""
    trace, profile = _tiny_files(tmp_path)
    report = tmp_path / "cold-start.json"
    starts = {
        "eager": {"ready": 9.0, "first_token": 11.6, "compile": 0.0},
        "compile, empty cache": {"ready": 50.0, "first_token": 55.2, "compile": 40.0},
        "compile, warm cache": {"ready": 7.9, "first_token": 8.3, "compile": 0.1},
    }
    report.write_text(json.dumps({"starts": starts, "rounds": {}}))
    args = ["autoscale", "simulate", "--trace", str(trace), "--profile", str(profile)]
    args += ["--policies", "brook", "--json", "--cold-start-from", str(report)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["cold_start_s"] == pytest.approx(13.3)
    assert main([*args, "--uncached-start", "--pod-start-seconds", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["cold_start_s"] == pytest.approx(55.2)
    report.write_text(json.dumps({"starts": {"eager": starts["eager"]}}))
    assert main(args) == 2
    assert "not a cold-start report" in capsys.readouterr().err
    assert main([*args[:-2], "--pod-start-seconds", "3"]) == 2
    assert "--pod-start-seconds applies with --cold-start-from" in capsys.readouterr().err


def test_cli_bad_policy_file_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, profile = _tiny_files(tmp_path)
    policy = tmp_path / "policy.yaml"
    policy.write_text("targetKvCacheUsage: 1.5\nmaxReplicas: 4\n")
    args = ["autoscale", "simulate", "--trace", str(trace), "--profile", str(profile)]
    assert main([*args, "--policy", str(policy)]) == 2
    assert "targetKvCacheUsage" in capsys.readouterr().err
    policy.write_text("minReplicas: 3\nmaxReplicas: 2\n")
    assert main([*args, "--policy", str(policy)]) == 2
    assert "minReplicas (3) exceeds maxReplicas (2)" in capsys.readouterr().err
    assert main([*args, "--policies", "brook,hpa"]) == 2
    assert "unknown policies hpa" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_tokens,output_tokens\n0,12,x\n")
    assert main(["autoscale", "simulate", "--trace", str(bad)]) == 2
    assert "line 2, column output_tokens" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, profile = _tiny_files(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = ["autoscale", "simulate", "--trace", str(trace), "--profile", str(profile)]
    assert main([*args, "--policies", "static-peak", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'brook[plot]'" in capsys.readouterr().err


def test_cli_plot_and_decisions(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace, profile = _tiny_files(tmp_path)
    png, decisions = tmp_path / "p.png", tmp_path / "d.csv"
    args = ["autoscale", "simulate", "--trace", str(trace), "--profile", str(profile)]
    assert (
        main(
            [
                *args,
                "--policies",
                "brook,static-peak",
                "--plot",
                str(png),
                "--decisions",
                str(decisions),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG"
    lines = decisions.read_text().splitlines()
    assert lines[0].startswith("policy,time_s") and lines[1].startswith("brook,15,")


def test_the_simulator_loads_nothing_heavy() -> None:
    code = (
        "import sys, brook_operator.cli, brook_operator.autoscaler.simulate\n"
        "print(sorted(m for m in ('matplotlib', 'numpy', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


# -- routers -------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["service", "least-loaded", "flow-control"])
def test_every_router_serves_every_request_once(router: str) -> None:
    """Fixed and autoscaled fleets, a surge past what the fleet holds: nothing is lost or
    served twice, whatever routes it."""
    requests = _trace((3.0, 0, 60), (25.0, 60, 120), (3.0, 120, 180))
    for fleet in (None, autoscaled("brook", _spec())):
        result = simulate(requests, _profile(), 2, fleet, router=router)
        assert result.completed == len(requests)
        assert not any(math.isnan(t) for t in result.ttft)
        assert all(f >= a for f, a in zip(result.finished, result.arrivals, strict=True))


def test_a_service_picks_at_random_and_the_run_repeats() -> None:
    requests = _trace((12.0, 0, 120))
    runs = [simulate(requests, _profile(), 3, router="service") for _ in range(2)]
    assert runs[0].ttft == runs[1].ttft  # seeded
    picked = simulate(requests, _profile(), 3, router="least-loaded")
    assert max(runs[0].ttft) > max(picked.ttft)  # blind picks queue behind busy replicas


def test_flow_control_holds_requests_until_a_replica_has_room() -> None:
    profile = _profile()
    replicas = [Replica(f"r{i}", profile, 0.0, 0.0, Outcome(40, 1.0)) for i in range(2)]
    gateway = deque(Job(i, 0.0, 200, 20) for i in range(40))
    Router("flow-control").route(gateway, replicas)
    assert [len(r.waiting) for r in replicas] == [8, 8]  # a batch slot each, no more
    assert len(gateway) == 24 and gateway[0].index == 16  # the rest wait in order
    assert not has_room(replicas[0], gateway[0])
    tight = Replica("tight", _profile(kv_cache_tokens=300), 0.0, 0.0, Outcome(1, 1.0))
    assert not has_room(tight, Job(0, 0.0, 400, 20))  # KV for the prompt, too
    Router("least-loaded").route(gateway, replicas)
    assert not gateway and [len(r.waiting) for r in replicas] == [20, 20]
    with pytest.raises(SimulationError, match="router 'random'"):
        Router("random")


def test_flow_control_moves_queued_work_but_hides_it_from_the_engines() -> None:
    """A surge on one replica while more start. Pushed requests stay queued where they
    landed; held ones go to whichever replica frees first, the new ones included, so with
    the gateway's queue read the tail is far shorter. Without it the backlog is invisible:
    the engines show full batches and empty queues, and the fleet never grows."""
    requests = _trace((2.0, 0, 30), (30.0, 30, 60), (2.0, 60, 240))
    runs = {}
    for router, reads in (("least-loaded", False), ("flow-control", False), ("flow-control", True)):
        fleet = dataclasses.replace(autoscaled("brook", _spec()), reads_gateway_queue=reads)
        runs[router, reads] = simulate(requests, _profile(), 1, fleet, router=router)

    def p99(result: RunResult) -> float:
        return sorted(result.ttft)[int(0.99 * len(result.ttft))]

    pushed, blind, held = runs.values()
    assert p99(held) < 0.5 * p99(pushed), (p99(held), p99(pushed))
    assert held.replica_seconds < pushed.replica_seconds
    assert max(n for _, n in blind.timeline) == 1 and p99(blind) > p99(pushed)


def test_reading_the_gateway_queue_is_for_flow_control() -> None:
    requests = _trace((20.0, 0, 60))
    with pytest.raises(SimulationError, match="--read-gateway-queue applies with --router flow"):
        compare(requests, _profile(), _spec(), ["brook"], reads_gateway_queue=True)
    seen = compare(
        requests, _profile(), _spec(), ["brook"], router="flow-control", reads_gateway_queue=True
    )
    assert seen.rows["brook"]["completed"] == len(requests)


# -- the arrival signal --------------------------------------------------------------------


def test_replicas_count_what_arrives_and_what_they_generate() -> None:
    """The two counters the arrival signal reads: every prompt token routed to a replica,
    and every token generated (the prefill step's first one included)."""
    outcome = Outcome(3, 1.0)
    replica = Replica("r", _profile(), 0.0, 0.0, outcome)
    for i, (prompt, output) in enumerate([(100, 5), (50, 1), (30, 12)]):
        replica.add(Job(i, 0.0, prompt, output))
    for step in range(40):
        replica.advance(step * 0.25, 0.25)
    assert outcome.completed == 3
    assert replica.prompt_tokens_received == 180
    assert replica.tokens_generated == pytest.approx(5 + 1 + 12)


def test_the_arrival_signal_meets_a_step_at_the_next_decision() -> None:
    """The shipped spike: 25 minutes of steady load teach the policy what a replica serves;
    then the load quadruples. With the arrival signal the fleet grows at the first decision
    after the step, to what the arriving tokens need, before KV usage has climbed; without
    it the fleet climbs a replica or two at a time, and the step's requests wait."""
    requests = read_trace(resolve_trace("spike"))
    profile = load_profile()
    spec = AutoscalingSpec(max_replicas=profile.max_replicas)
    step = 25 * 60.0
    runs = {
        name: simulate(requests, profile, 3, autoscaled(name, spec, profile.max_num_seqs))
        for name in ("brook", "no-arrival")
    }

    def first_up(result: RunResult) -> tuple[float, int, int]:
        return min(e for e in result.scale_events if e[0] >= step and e[2] > e[1])

    brook, before = first_up(runs["brook"]), first_up(runs["no-arrival"])
    assert brook[0] <= step + spec.interval_seconds, brook
    assert brook[2] - brook[1] == spec.max_scale_up_step, brook  # as many as one step allows
    assert before[2] - before[1] < brook[2] - brook[1], before
    decision = next(d for d in runs["brook"].decisions if d[0] == brook[0])
    assert "arrivals" in decision[4], decision
    met = {n: attainment(r, profile.ttft_slo_seconds) for n, r in runs.items()}
    assert met["brook"] >= 0.99 > met["no-arrival"], met


def test_the_predictive_term_meets_a_recurring_surge_before_it_starts() -> None:
    """Three periods (an hour each here, standing for days) with the same 10-minute surge
    at minute 30, and replicas that take a minute to start. The reactive policy misses the start of
    every surge; with the history the second and third are met, for a few more
    replica-minutes before each."""
    hour = 3600.0
    parts = []
    for h in range(3):
        base = h * hour
        parts += [(3.0, base, base + 1800), (14.0, base + 1800, base + 2400)]
        parts += [(3.0, base + 2400, base + hour)]
    requests = _trace(*parts)
    profile = _profile(cold_start_seconds=60)
    spec = _spec(
        replicaTokensPerSecond=900,  # the base load never nears the target to learn it
        history={"leadSeconds": 300, "periodSeconds": 3600, "periods": 2},
    )
    runs = {
        name: simulate(requests, profile, 1, autoscaled(name, spec.model_copy(update=change)))
        for name, change in (("brook", {"history": None}), ("brook-history", {}))
    }

    def surge_met(result: RunResult, h: int) -> float:
        start = h * hour + 1800
        idx = [i for i, r in enumerate(requests) if start <= r.arrival_s < start + 600]
        return sum(1 for i in idx if result.ttft[i] <= profile.ttft_slo_seconds) / len(idx)

    reactive, predictive = runs["brook"], runs["brook-history"]
    assert surge_met(predictive, 0) == pytest.approx(surge_met(reactive, 0))  # no history yet
    for h in (1, 2):
        assert surge_met(predictive, h) >= 0.99 > surge_met(reactive, h), h
        ahead = [e for e in predictive.scale_events if h * hour + 1500 <= e[0] < h * hour + 1800]
        assert ahead and ahead[0][2] > ahead[0][1], predictive.scale_events
    assert predictive.replica_seconds < 1.2 * reactive.replica_seconds


def test_standby_replicas_buy_a_surge_that_outruns_the_start() -> None:
    """The shipped spike with replicas that compile as they start (48.5 s): the reactive
    policy misses the surge's first minute; two standby replicas serve it, for their
    replica-hours."""
    requests = read_trace(resolve_trace("spike"))
    base = load_profile()
    profile = base.model_copy(update={"cold_start_seconds": base.cold_start_uncached_seconds})
    runs = {}
    for standby in (0, 2):
        spec = AutoscalingSpec(
            max_replicas=profile.max_replicas,
            replica_tokens_per_second=352,  # what the spike's readings teach (brook's reason)
            standby_replicas=standby,
        )
        runs[standby] = simulate(
            requests, profile, 3, autoscaled("brook", spec, profile.max_num_seqs)
        )
    met = {s: attainment(r, profile.ttft_slo_seconds) for s, r in runs.items()}
    assert met[2] >= 0.99 > met[0], met
    extra_hours = (runs[2].replica_seconds - runs[0].replica_seconds) / 3600
    assert 1.0 < extra_hours < 2.5, extra_hours  # about the two standby replicas' hour
