"""``brook-engine fetch``: what an engine pod's init container runs for an hf:// model. With
the official Hub client against a stand-in of the Hub on loopback (``tests/support/hub.py``):
only the files the engine reads are downloaded; two replicas fetching into one shared folder
(``model.cache``) download it once, the second waiting on the first; a restart finds it
complete; a missing repository fails with a message naming it. With ``--progress-port`` a fetch
serves its progress (what the operator reads into status), a waiting replica the other's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import hub
from tests.support.ports import free_port

REPO = "brook-test/tiny-llama"
MIB = 1024 * 1024


def _fetch(url: str, output: Path, *extra: str) -> subprocess.Popen[str]:
    return hub.fetch(url, REPO, output, *extra)


def test_two_replicas_share_one_download(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    served = tmp_path / "served"
    shutil.copytree(make_tiny_model("llama"), served)
    (served / "model-q4.gguf").write_bytes(b"GGUF" + b"\0" * 64)  # another format's copy
    shared = tmp_path / "claim" / "brook-test--tiny-llama@main"
    with hub.serving(served, REPO) as stand_in:
        first, second = _fetch(stand_in.url, shared), _fetch(stand_in.url, shared)
        outs = [p.communicate(timeout=180) for p in (first, second)]
        assert first.returncode == 0 and second.returncode == 0, outs
        states = sorted(out.strip().rsplit("(", 1)[0] for out, _ in outs)
        assert [s.split(": ", 1)[1].strip() for s in states] == [
            "already complete",
            "downloaded",
        ], outs
        downloads = [p for p in stand_in.paths if p.startswith("GET ") and "/resolve/" in p]
        names = sorted(p.rsplit("/", 1)[1] for p in downloads)
        assert names == sorted({n for n in names}), "a file was downloaded twice"
        assert "model.safetensors" in names and "config.json" in names
        assert not any(n.endswith(".gguf") for n in names)  # not what the engine reads
        marker = json.loads((shared / ".brook-fetched.json").read_text())
        assert marker["commit"] == hub.COMMIT and marker["repo"] == REPO
        # a restart: complete already, nothing asked of the Hub
        asked = len(stand_in.paths)
        again = _fetch(stand_in.url, shared)
        out, err = again.communicate(timeout=120)
        assert again.returncode == 0 and "already complete" in out, err
        assert len(stand_in.paths) == asked
        # other patterns are another file set: the folder is completed for them
        other = _fetch(stand_in.url, shared, "--include=*.json", "--include=*.gguf")
        out, err = other.communicate(timeout=120)
        assert other.returncode == 0 and "downloaded" in out, err
        assert (shared / "model-q4.gguf").exists()
        assert json.loads((shared / ".brook-fetched.json").read_text())["include"] == [
            "*.json",
            "*.gguf",
        ]
    assert (shared / "config.json").is_file()


def test_a_missing_repository_fails_naming_it(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text("{}")
    with hub.serving(served, "brook-test/other") as stand_in:
        proc = _fetch(stand_in.url, tmp_path / "out")
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"error: hf://{REPO}:" in err.strip().splitlines()[-1]  # the termination message
    assert not (tmp_path / "out" / ".brook-fetched.json").exists()


def _progress(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/download", timeout=2) as answer:
            document: dict[str, Any] = json.loads(answer.read())
            return document
    except (urllib.error.URLError, OSError):
        return None  # not listening yet, or done


def _watch(
    port: int, proc: subprocess.Popen[str], done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        answer = _progress(port)
        if answer is not None:
            seen.append(answer)
            if done(answer):
                return answer
        time.sleep(0.1)
    ended = proc.communicate(timeout=120) if proc.poll() is not None else "still running"
    raise AssertionError(f"never seen; last answers {seen[-3:]}; {ended}")


def test_a_download_serves_its_progress_and_a_waiting_replica_the_others(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    served = tmp_path / "served"
    shutil.copytree(make_tiny_model("llama"), served)
    (served / "model-q4.gguf").write_bytes(b"GGUF" + b"\0" * 64)  # not taken: not counted
    # The Hub client writes in 10 MiB pieces: a 30 MiB shard, sent in about 12 s, shows
    # progress at 10 and 20 MiB before it ends.
    (served / "model-00002-of-00002.safetensors").write_bytes(os.urandom(30 * MIB))
    taken = [p for p in served.iterdir() if p.suffix != ".gguf"]
    total = sum(p.stat().st_size for p in taken)
    shared = tmp_path / "claim" / "brook-test--tiny-llama@main"
    with hub.serving(served, REPO, rate=total / 12) as stand_in:
        port_a, port_b = free_port(), free_port()
        first = _fetch(stand_in.url, shared, f"--progress-port={port_a}")
        midway = _watch(
            port_a,
            first,
            lambda a: a["state"] == "downloading" and 10 * MIB <= a["bytesDone"] < total,
        )
        assert midway["model"] == f"hf://{REPO}"
        assert midway["bytesTotal"] == total and midway["filesTotal"] == len(taken)
        # a second replica into the shared folder waits, and reports the first one's bytes
        second = _fetch(stand_in.url, shared, f"--progress-port={port_b}")
        waiting = _watch(
            port_b,
            second,
            lambda a: a["state"] == "waiting" and a["bytesTotal"] == total,
        )
        assert waiting["bytesDone"] >= midway["bytesDone"]
        later = _watch(port_a, first, lambda a: a["bytesDone"] > midway["bytesDone"])
        assert later["bytesPerSecond"] is not None and later["bytesPerSecond"] > 0
        for proc in (first, second):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
        assert _progress(port_a) is None  # served only while the download runs
        assert (shared / "model-00002-of-00002.safetensors").stat().st_size == 30 * MIB
        # a restart with the folder complete: no listing asked of the Hub (the sampler's
        # first count runs at once, while the state is still "starting")
        asked = len(stand_in.paths)
        again = _fetch(stand_in.url, shared, f"--progress-port={port_a}")
        out, err = again.communicate(timeout=120)
        assert again.returncode == 0 and "already complete" in out, err
        assert len(stand_in.paths) == asked


def test_a_taken_progress_port_does_not_stop_the_download(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    import socket

    with socket.socket() as busy, hub.serving(make_tiny_model("llama"), REPO) as stand_in:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _fetch(stand_in.url, tmp_path / "out", f"--progress-port={port}")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "downloaded" in out, err
    assert f"progress not served on port {port}" in err
