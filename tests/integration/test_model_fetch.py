"""``brook-engine fetch``: what an engine pod's init container runs for an hf:// model. With
the official Hub client against a stand-in of the Hub on loopback (``tests/support/hub.py``):
only the files the engine reads are downloaded; two replicas fetching into one shared folder
(``model.cache``) download it once, the second waiting on the first; a restart finds it
complete; a missing repository fails with a message naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.support import hub

REPO = "brook-test/tiny-llama"


def _fetch(url: str, output: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1"}
    command = [sys.executable, "-m", "brook_engine.cli", "fetch", f"hf://{REPO}"]
    command += ["--output", str(output), "--revision", "main", *extra]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


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
