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
from brook_engine.bench.command import served_config
from brook_engine.cli import _add_engine_flags, _engine_options, build_parser, main
from brook_engine.config import load_engine_config


def _args(model: str, *flags: str) -> argparse.Namespace:
    """The bench's arguments as its command line parses them (the flags after the model)."""
    base = ["bench", "--model", model, "--mode", "serve", "--dtype", "float32"]
    base += ["--max-model-len", "128", "--concurrency", "2", "--input-len", "8"]
    return build_parser().parse_args([*base, "--output-len", "4", "--num-requests", "4", *flags])


def _brook(args: argparse.Namespace, folder: Path, port: int) -> list[str]:
    return served_compare._brook_command(served_config(args, _engine_options(args)), folder, port)


def test_brooks_server_runs_every_engine_flag_of_the_bench(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    flags = ["--kv-dtype", "fp16", "--max-num-batched-tokens", "64", "--block-size", "8"]
    args = _args(str(make_tiny_model("llama")), *flags)
    port = served_compare._free_port()
    cmd = _brook(args, tmp_path, port)
    config = load_engine_config(Path(cmd[cmd.index("--config") + 1]))
    assert config.scheduler.max_num_batched_tokens == 64  # each one reaches the server
    assert config.scheduler.max_num_seqs == 2  # --concurrency, --max-num-seqs not given
    assert config.kv_cache.block_size == 8 and config.model.dtype == "float32"
    assert [p.dtype for p in config.kv_cache.layer_policies] == ["fp16"]
    assert (
        served_config(
            _args(args.model, "--max-num-seqs", "5"), {"max_num_seqs": 5}
        ).scheduler.max_num_seqs
        == 5
    )
    log = tmp_path / "server.log"
    with served_compare._running("brook", cmd, {}, port, log):
        url = f"http://127.0.0.1:{port}/v1/models"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert served_compare.SERVED_NAME in response.read().decode()
    with pytest.raises(OSError):  # stopped with the context
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_the_flags_vllm_does_not_get_are_named() -> None:
    args = _args("m", "--kv-dtype", "int8", "--moe-reroute", "--max-num-batched-tokens", "64")
    assert served_compare.brook_only_flags(args) == ["--kv-dtype int8", "--moe-reroute"]
    assert served_compare.brook_only_flags(_args("m")) == []
    # Every engine flag is either passed to vLLM's server too or named as Brook's alone.
    engine = argparse.ArgumentParser()
    _add_engine_flags(engine, model_required=False)
    flags = {a.dest for a in engine._actions if a.option_strings} - {"help", "model"}
    shared = {"dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens"}
    assert flags == shared | set(served_compare._BROOK_ONLY)


def test_vllm_gets_the_scheduler_flags_brook_gets(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    cmd, _ = served_compare._vllm_server(python, _args("m", "--max-num-batched-tokens", "512"), 1)
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "512"
    assert "--max-num-seqs" not in cmd  # vLLM's own default, as Brook's is --concurrency
    cmd, _ = served_compare._vllm_server(python, _args("m"), 1)
    assert "--max-num-batched-tokens" not in cmd  # each engine's default


def test_brook_is_ready_only_when_its_engine_is(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    # /v1/models answers while the weights load; the client starts only once completions
    # are served (they got 503 before: every request of a round failed).
    args = _args(str(make_tiny_model("llama")))
    port = served_compare._free_port()
    cmd = _brook(args, tmp_path, port)
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
    assert main([*base, "--compare", "vllm", "--input-len", "8:16"]) == 2
    assert "--input-len 8:16: the serving client takes one length" in capsys.readouterr().err
