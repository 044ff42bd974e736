"""``brook-engine serve`` as a replica of several ranks: a TP=2 server answers the official
OpenAI client with the single-process engine's tokens; a replica spread over two "pods"
(two server processes, placed by the operator's environment variables) serves from the
first; a rank that dies mid-generation, or never arrives, makes the server fail its
readiness and exit non-zero within a bounded time."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from brook_engine import LLM, SamplingParams

from ..support.engine_server import API_KEY, ServerProcess, start_server
from ..support.ports import free_port

EXACT_KV = {
    "layerPolicies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamicPrecision": {"enabled": False},
}
EXIT_BOUND_SECONDS = 45  # a dead rank must end the server within this


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = task / "children"
        if children.exists():
            out += [int(p) for p in children.read_text().split()]
    return out


def _worker_pid(server: ServerProcess) -> int:
    """The server's worker process of rank 1 (multiprocessing also starts a resource
    tracker; the worker is the child whose command line names the spawn entry)."""
    for pid in _children(server.proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in cmdline or b"spawn_main" in cmdline:
            return pid
    pytest.fail(f"no worker process under the server: {_children(server.proc.pid)}")


def _wait_exit(server: ServerProcess, bound: float) -> tuple[int, list[int]]:
    """(exit status, /ready statuses seen meanwhile; 0 = refused) — fails past ``bound``."""
    seen: list[int] = []
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return server.proc.returncode, seen
        try:
            with urllib.request.urlopen(server.url + "/ready", timeout=2) as response:
                seen.append(response.status)
        except urllib.error.HTTPError as exc:
            seen.append(exc.code)
        except OSError:
            seen.append(0)
        time.sleep(0.1)
    server.proc.kill()
    pytest.fail(f"the server still ran {bound:.0f} s after a rank died:\n{server.log()[-3000:]}")


def _long_stream(server: ServerProcess, outcome: list[Any]) -> threading.Thread:
    """A streamed completion that takes a while; records how it ended."""

    def run() -> None:
        try:
            stream = _client(server).completions.create(
                model="tiny",
                prompt="The quick brown fox",
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            count = 0
            for _ in stream:
                count += 1
                if count == 5:
                    outcome.append("streaming")
            outcome.append(("finished", count))
        except Exception as exc:  # the connection drops or an error event arrives
            outcome.append(("error", type(exc).__name__))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while "streaming" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "streaming" in outcome, outcome
    return thread


def _stopped_being_ready(seen: list[int]) -> None:
    """Readiness may pass until the failure is noticed, then never again."""
    first_failure = next((i for i, code in enumerate(seen) if code != 200), len(seen))
    assert all(code != 200 for code in seen[first_failure:]), seen


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_tp2_server_answers_the_openai_client_like_one_process(
    make_tiny_model: Callable[..., Path], tmp_path: Path, servers: list[ServerProcess]
) -> None:
    model = make_tiny_model("llama", num_hidden_layers=4)
    server = start_server(
        model, tmp_path, parallel={"tensor": 2}, kvCache={"numBlocks": 256, **EXACT_KV}
    )
    servers.append(server)
    prompt = "The capital of France is"
    reply = _client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    chat = _client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content is not None

    with LLM(str(model), dtype="float32", device="cpu", progress=False, kv_cache=EXACT_KV) as one:
        expected = one.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
    assert reply.choices[0].text == expected.outputs[0].text

    metrics = server.metrics()
    assert metrics['brook_engine_comm_seconds_total{kind="all_reduce"}'] > 0
    assert 0.0 <= metrics["brook_engine_comm_compute_overlap_ratio"] <= 1.0
    info = next(k for k in metrics if k.startswith("brook_engine_model_info"))
    assert 'tensor_parallel="2"' in info
    assert server.stop() == 0  # a clean drain stops the worker too
    assert "Traceback" not in server.log()


def test_a_worker_killed_mid_generation_fails_readiness_and_exits_non_zero(
    make_tiny_model: Callable[..., Path], tmp_path: Path, servers: list[ServerProcess]
) -> None:
    model = make_tiny_model("llama", num_hidden_layers=4)
    server = start_server(model, tmp_path, parallel={"pipeline": 2}, kvCache={"numBlocks": 256})
    servers.append(server)
    outcome: list[Any] = []
    stream = _long_stream(server, outcome)
    os.kill(_worker_pid(server), signal.SIGKILL)
    status, ready = _wait_exit(server, EXIT_BOUND_SECONDS)
    stream.join(30)
    assert status != 0
    _stopped_being_ready(ready)
    assert outcome[-1][0] == "error" or outcome[-1][1] < 400, outcome  # cut short, not hung
    assert "the replica failed: the worker of rank 1 exited" in server.log()


def _pod_env(pod_rank: int, port: int) -> dict[str, str]:
    return {
        "BROOK_WORLD_SIZE": "2",
        "BROOK_NUM_PODS": "2",
        "BROOK_DEVICES_PER_POD": "1",
        "BROOK_POD_RANK": str(pod_rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def test_two_pods_form_one_replica_and_a_lost_pod_ends_it(
    make_tiny_model: Callable[..., Path], tmp_path: Path, servers: list[ServerProcess]
) -> None:
    model = make_tiny_model("llama", num_hidden_layers=4)
    port = free_port()
    sections: dict[str, Any] = {"parallel": {"pipeline": 2}, "kvCache": {"numBlocks": 256}}
    (tmp_path / "pod1").mkdir()
    (tmp_path / "pod0").mkdir()
    worker = start_server(model, tmp_path / "pod1", env=_pod_env(1, port), wait=False, **sections)
    servers.append(worker)
    leader = start_server(model, tmp_path / "pod0", env=_pod_env(0, port), **sections)
    servers.append(leader)
    reply = _client(leader).completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert "worker pod 1 of the replica" in worker.log()

    outcome: list[Any] = []
    stream = _long_stream(leader, outcome)
    worker.proc.kill()  # the whole pod is gone
    status, ready = _wait_exit(leader, EXIT_BOUND_SECONDS)
    stream.join(30)
    assert status != 0
    _stopped_being_ready(ready)
    assert "replica failed" in leader.log()


def test_a_rank_that_never_arrives_fails_the_start(
    make_tiny_model: Callable[..., Path], tmp_path: Path, servers: list[ServerProcess]
) -> None:
    model = make_tiny_model("llama", num_hidden_layers=4)
    leader = start_server(
        model,
        tmp_path,
        env=_pod_env(0, free_port()),
        wait=False,
        parallel={"pipeline": 2, "timeoutSeconds": 5},
    )
    servers.append(leader)
    status, ready = _wait_exit(leader, 60)
    assert status != 0
    assert 200 not in ready
    assert "could not join the replica" in leader.log()
