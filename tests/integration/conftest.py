"""Real engine servers on 127.0.0.1, started as child processes the way a pod starts them
(``support.engine_server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from brook_engine import LLM
from support.engine_server import API_KEY, ServerProcess, start_server

__all__ = ["API_KEY", "ServerProcess"]


@pytest.fixture(scope="session")
def server_factory() -> Any:
    """``start_server(model, folder, **sections)``: a ready server process."""
    return start_server


@pytest.fixture(scope="session")
def tiny_llama(make_tiny_model: Any) -> Path:
    return Path(make_tiny_model("llama"))


@pytest.fixture(scope="session")
def api_server(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One server for the API tests: API key on, room for 64 concurrent streams."""
    handle = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("api-server"),
        scheduler={"maxNumSeqs": 64, "maxNumBatchedTokens": 512},
    )
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    assert API_KEY not in handle.log(), "the API key reached the log"


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """Engines a test starts; their worker processes are stopped after it, pass or fail."""
    started: list[LLM] = []
    yield started
    for llm in started:
        llm.close()
