"""The control channel's wire format (``parallel.wire``): every message the ranks of a replica
exchange round-trips exactly as JSON, and anything else — above all a pickle, which would run
the code it names — is refused with a message, never executed."""

from __future__ import annotations

import ast
import math
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine.core.replica import RankFacts, ReplicaFacts
from brook_engine.layers import sampler
from brook_engine.parallel import wire
from brook_engine.parallel.comm import Communicator, ParallelGroupError
from brook_engine.parallel.plan import SampleResult, SeqChunk, StepPlan, StepResults
from brook_engine.parallel.topology import Topology
from brook_engine.sampling_params import SamplingParams

ENGINE = Path(__file__).resolve().parents[3] / "engine" / "brook_engine"

RAN: list[str] = []


def _run(note: str) -> None:
    RAN.append(note)


class Exploit:
    """What a hostile peer sends: unpickling it calls ``_run``."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_run, ("unpickled",))


def _plan() -> StepPlan:
    every_field = SamplingParams(
        max_tokens=300,
        min_tokens=2,
        temperature=0.7,
        top_p=0.93,
        top_k=40,
        seed=2**63 - 1,
        stop=("\n\n", "END", "\u00e9\u4e2d"),
        stop_token_ids=(2, 32000),
        ignore_eos=True,
        logprobs=5,
        skip_special_tokens=False,
        cache_salt="tenant-\u00e9-\U0001f600",
    )
    return StepPlan(
        "step",
        [
            SeqChunk("req-1", [1, 2, 3, 4], 0, [7, 8], True, every_field),
            SeqChunk("req-2", list(range(512)), 512, list(range(64)), False, None),
            SeqChunk("req-\ud800", [9], 17, [3], True, SamplingParams()),  # a lone surrogate
        ],
        micro_batches=4,
        released=["old-1", "old-2"],
        report=True,
        blocking_sends=True,
    )


@pytest.mark.parametrize(
    "plan",
    [_plan(), StepPlan("heartbeat", released=["x"]), StepPlan("stop"), StepPlan("step")],
    ids=["step", "heartbeat", "stop", "empty-step"],
)
def test_step_plans_round_trip_exactly(plan: StepPlan) -> None:
    back = wire.decode(wire.encode(plan), StepPlan)
    assert back == plan
    assert all(type(c.token_ids) is list for c in back.chunks)
    params = back.chunks[0].params if back.chunks else None
    if params is not None:
        assert type(params.stop) is tuple and params.seed == 2**63 - 1


def test_sampled_results_round_trip_exactly_with_int_keys_and_infinities() -> None:
    rng = random.Random(0)
    results: StepResults = [
        SampleResult([rng.randrange(50_000)], [(rng.uniform(-30, 0), {})]),
        None,
        SampleResult([5], [None]),
        SampleResult(
            [17],
            [(-1e-300, {17: -1e-300, 0: -math.inf, 49_999: rng.uniform(-30, 0), 3: -0.0})],
        ),
    ]
    back = wire.decode(wire.encode(results), StepResults)
    assert back == results
    alternatives = back[3].logprobs[0][1]
    assert list(alternatives) == [17, 0, 49_999, 3]  # int keys, in the sampler's order
    assert all(type(k) is int for k in alternatives)
    assert math.copysign(1, alternatives[3]) == -1
    nan = wire.decode(wire.encode([SampleResult([1], [(math.nan, {})])]), StepResults)
    assert math.isnan(nan[0].logprobs[0][0])


def test_the_wire_result_is_the_samplers_result() -> None:
    """What the last stage's sampler returns is the wire's type, and comes back whole."""
    assert sampler.SampleResult is SampleResult
    logits = torch.randn(4, 11)
    logits[3, 2] = math.nan
    params = [SamplingParams(temperature=0), SamplingParams(logprobs=3), SamplingParams()] * 2
    drawn = vars(sampler.sample(logits, params[:4], [None] * 4))
    sent: list[Any] = [
        sampler.SampleResult(*([values[row]] if values else [] for values in drawn.values()))
        for row in range(4)
    ]
    back = wire.decode(wire.encode([*sent, None]), StepResults)
    assert [vars(r) for r in back[:4]] == [vars(r) for r in sent] and back[4] is None
    assert [r.error(0) for r in back[:4]] == [r.error(0) for r in sent]
    assert back[3].error(0) is not None


def test_start_up_messages_round_trip() -> None:
    facts = RankFacts(1, 3, ReplicaFacts(["auto", "int8", "fp8_e4m3"], [None, 0.25, 1e-7], 96, 7))
    assert wire.decode(wire.encode(facts), RankFacts) == facts
    uncalibrated = RankFacts(0, 0, ReplicaFacts(["bf16"], None, 8, 0))
    assert wire.decode(wire.encode(uncalibrated), RankFacts) == uncalibrated
    for ids in ([1, 2, 3], [], None):
        assert wire.decode(wire.encode(ids), list[int] | None) == ids


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_is_refused_and_never_run(protocol: int) -> None:
    payload = pickle.dumps(Exploit(), protocol=protocol)
    for kind in (StepPlan, StepResults, RankFacts, list[int] | None):
        with pytest.raises(wire.WireError, match="not a JSON message"):
            wire.decode(payload, kind)
    assert RAN == []


def test_a_pickle_sent_the_old_way_ends_the_replica_without_running() -> None:
    """The old channel: a length, then pickle bytes. The receiving rank refuses it with
    ``ParallelGroupError`` (which ends the replica) and runs nothing."""
    payload = pickle.dumps(StepPlan("step", [], report=Exploit()))  # type: ignore[arg-type]
    incoming = [
        torch.tensor([len(payload)]),
        torch.frombuffer(bytearray(payload), dtype=torch.uint8),
    ]

    comm = Communicator.__new__(Communicator)
    comm.topology = Topology(1, 2, 1)

    def receive(tensor: torch.Tensor, *_: Any) -> None:
        tensor.copy_(incoming.pop(0))

    comm._recv = receive  # type: ignore[method-assign, assignment]
    comm.plan_group = None
    refused = "plan receive failed: plan from rank 0: not a JSON message"
    with pytest.raises(ParallelGroupError, match=refused):
        comm.recv_plan()
    assert RAN == [] and not incoming


def _step(**changes: Any) -> bytes:
    plan: dict[str, Any] = {
        "kind": "step",
        "chunks": [
            {
                "request_id": "r",
                "token_ids": [1, 2],
                "start": 0,
                "block_table": [0],
                "samples": True,
                "params": None,
            }
        ],
        "micro_batches": 1,
        "released": [],
        "report": False,
        "blocking_sends": False,
        "blocks": 0,
    }
    for path, value in changes.items():
        node = plan
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is _DROP:
            del node[leaf]
        else:
            node[leaf] = value
    return wire.encode(plan)


_DROP = object()


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (_step(extra=1), "StepPlan has no field extra"),
        (_step(report=_DROP), "StepPlan misses report"),
        (
            _step(kind="exec"),
            r"message: kind: expected one of \['step', 'heartbeat', 'stop', 'offload_out', "
            r"'offload_back'\]",
        ),
        (_step(micro_batches="2"), "message: micro_batches: expected int, got '2'"),
        (_step(micro_batches=2.0), "expected int, got 2.0"),
        (_step(micro_batches=True), "expected int, got True"),
        (_step(report=1), "message: report: expected bool, got 1"),
        (_step(released="abc"), "message: released: expected a list"),
        (
            _step(**{"chunks.0.token_ids": [1, None]}),
            r"message: chunks\[0\].token_ids\[1\]: expected int",
        ),
        (_step(**{"chunks.0.params": {"max_tokens": 1}}), "SamplingParams misses min_tokens"),
        (
            _step(**{"chunks.0.params": {**SamplingParams().model_dump(), "evil": 1}}),
            "SamplingParams has no field evil",
        ),
        (
            _step(**{"chunks.0.params": {**SamplingParams().model_dump(), "min_tokens": 99}}),
            r"params: .*min_tokens \(99\) exceeds max_tokens",
        ),
        (
            _step(**{"chunks.0.params": {**SamplingParams().model_dump(), "top_k": -1}}),
            "top_k: Input should be greater than or equal to 0",
        ),
        (_step(chunks={"0": {}}), "message: chunks: expected a list"),
        (b'{"kind":"stop","kind":"step"}', "names a key twice"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON message"),
        (b"\xff\xfe{}", "not a JSON message"),
        (b"", "not a JSON message"),
        (b"null", "expected a StepPlan object, got None"),
    ],
)
def test_malformed_plans_are_refused_naming_the_field(message: bytes, error: str) -> None:
    with pytest.raises(wire.WireError, match=error):
        wire.decode(message, StepPlan)


@pytest.mark.parametrize("key", ["01", "-0", "+1", " 1", "1_0", "1.0", "x", "", "1" * 25])
def test_int_keys_must_be_plain_decimals(key: str) -> None:
    message = b'[{"token_ids":[1],"logprobs":[[-1.0,{"%s":-2.0}]],"errors":[]}]' % key.encode()
    where = r"message: \[0\].logprobs\[0\]\[1\]"
    with pytest.raises(wire.WireError, match=rf"{where}: key .* is not an int"):
        wire.decode(message, StepResults)


def test_sizes_are_bounded_before_anything_is_allocated() -> None:
    for length in (0, -1, wire.MAX_MESSAGE_BYTES + 1, 2**62):
        with pytest.raises(wire.WireError, match="announces"):
            wire.buffer(wire.size_tensor(length), "plan")
    assert wire.buffer(wire.size_tensor(5), "plan").shape == (5,)
    with pytest.raises(wire.WireError, match="more than"):
        wire.decode(b" " * (wire.MAX_MESSAGE_BYTES + 1), StepPlan)


def test_only_plain_data_can_be_sent() -> None:
    with pytest.raises(TypeError, match="a Tensor cannot go over the control channel"):
        wire.encode(StepPlan("step", [SeqChunk("r", torch.tensor([1]), 0, [], False, None)]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a Generator cannot go"):
        wire.encode([SampleResult([1], [None], [None]), torch.Generator()])
    size, payload = wire.to_tensors(_plan())
    assert int(size.item()) == payload.numel() and payload.dtype == torch.uint8
    assert wire.decode_tensor(payload, StepPlan, "plan") == _plan()


def test_no_engine_module_unpickles_or_sends_objects_through_torch_distributed() -> None:
    """torch.distributed's ``*_object`` calls pickle; so does ``pickle`` itself."""
    pickles = {"pickle", "_pickle", "dill", "cloudpickle"}
    object_calls = ("_object", "_object_list")
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(ENGINE)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                module = getattr(node, "module", None) or ""
                names = [module, *(alias.name for alias in node.names)]
                if any(n.split(".")[0] in pickles for n in names if n):
                    found.append(f"{where} imports pickle")
                if module.startswith("torch.distributed") and any(
                    alias.name.endswith(object_calls) for alias in node.names
                ):
                    found.append(f"{where} imports a torch.distributed *_object call")
            if isinstance(node, ast.Attribute) and node.attr.endswith(object_calls):
                owner = ast.unparse(node.value)
                if owner in {"dist", "torch.distributed", "distributed"}:
                    found.append(f"{where} calls {owner}.{node.attr}")
    assert found == []
