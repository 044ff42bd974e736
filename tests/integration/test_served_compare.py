"""``brook-engine bench --mode serve --compare vllm``: the pieces that run without vLLM's venv
(CI has none): Brook's server started from the command the comparison builds, waited for
and stopped; the median round; bad lengths refused. The vLLM side runs where its venv is
set up (docs/performance.md has the figures)."""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from brook_engine.bench import served_compare
from brook_engine.cli import main


def _args(model: str, **overrides: object) -> argparse.Namespace:
    values: dict[str, object] = dict(
        model=model,
        dtype="float32",
        kv_dtype=None,
        one_row_weights=None,
        quantization=None,
        group_size=None,
        max_model_len=128,
        concurrency=2,
        input_len="8",
        output_len="4",
        num_requests=4,
        rounds=1,
        seed=0,
        json=False,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_brooks_server_starts_from_the_command_answers_and_stops(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    args = _args(str(make_tiny_model("llama")), kv_dtype="auto")
    port = served_compare._free_port()
    cmd = served_compare._brook_command(args, port)
    assert cmd[cmd.index("--kv-dtype") + 1] == "auto" and "--quantization" not in cmd
    assert cmd[cmd.index("--max-num-seqs") + 1] == "2"
    log = tmp_path / "server.log"
    with served_compare._running("brook", cmd, {}, port, log):
        url = f"http://127.0.0.1:{port}/v1/models"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert served_compare.SERVED_NAME in response.read().decode()
    with pytest.raises(OSError):  # stopped with the context
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_brook_is_ready_only_when_its_engine_is(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    # /v1/models answers while the weights load; the client starts only once completions
    # are served (they got 503 before: every request of a round failed).
    args = _args(str(make_tiny_model("llama")))
    port = served_compare._free_port()
    cmd = served_compare._brook_command(args, port)
    with served_compare._running("brook", cmd, {}, port, tmp_path / "server.log"):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(
                {"model": served_compare.SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
            ).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200


def test_a_round_with_failed_requests_is_an_error_not_a_figure() -> None:
    result = {"completed": 0, "output_throughput": 0.0}
    with pytest.raises(served_compare.PeerError, match="4 of 4 requests failed"):
        served_compare._all_completed(result, 4)
    full = {"completed": 4, "output_throughput": 9.0}
    assert served_compare._all_completed(full, 4) is full


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    cmd = ["python3", "-c", "import sys; print('no such model'); sys.exit(3)"]
    with (
        pytest.raises(served_compare.PeerError, match="exited with 3:\nno such model"),
        served_compare._running("brook", cmd, {}, served_compare._free_port(), tmp_path / "l"),
    ):
        pass


def test_each_server_is_reported_at_its_median_round() -> None:
    rows = [
        {"output_throughput": t, "median_ttft_ms": t * 10, "median_tpot_ms": 1.0, "completed": 4}
        for t in (30.0, 10.0, 20.0)
    ]
    median = served_compare._median(rows)
    assert median["output_throughput"] == 20.0 and median["median_ttft_ms"] == 200.0
    assert median["rounds_output_tok_s"] == [30.0, 10.0, 20.0]


def test_ranges_and_other_peers_are_refused(
    make_tiny_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(make_tiny_model("llama"))
    base = ["bench", "--model", model, "--mode", "serve"]
    assert main([*base, "--compare", "hf"]) == 2
    assert "--mode serve compares with vllm only" in capsys.readouterr().err
    assert served_compare.compare_served(_args(model, input_len="8:16")) == 2
    assert "--input-len 8:16: the serving client takes one length" in capsys.readouterr().err
