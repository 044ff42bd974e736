"""The list of servers ``brook up`` runs, which ``brook monitor --local`` reads: only this
user's files in a folder no one else may write, well-formed, of living processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from brook_operator.local_run import local_servers


def _write(folder: Path, file: str, **fields: object) -> Path:
    entry = {"name": "tiny", "url": "http://127.0.0.1:8000", "pid": os.getpid()}
    entry |= {"model": "tiny", "started": 1.0, **fields}
    path = folder / file
    path.write_text(json.dumps(entry))
    path.chmod(0o600)
    return path


def test_living_well_formed_entries_are_listed_and_ended_ones_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "up"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("BROOK_LOCAL_DIR", str(folder))
    _write(folder, "live.json", name="live")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    gone = _write(folder, "gone.json", pid=ended.pid)
    _write(folder, "typed.json", pid="1")  # a pid that is not a number
    _write(folder, "remote.json", url="file:///etc/passwd")
    (folder / "torn.json").write_text('{"name": "ha')
    assert [s.name for s in local_servers()] == ["live"]
    assert not gone.exists()
    shared = _write(folder, "shared.json", name="shared")
    shared.chmod(0o666)  # writable by others: anyone could have put it there
    assert [s.name for s in local_servers()] == ["live"]


def test_a_folder_others_may_write_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "up"
    folder.mkdir()
    _write(folder, "live.json")
    folder.chmod(0o777)
    monkeypatch.setenv("BROOK_LOCAL_DIR", str(folder))
    assert local_servers() == []
