"""A download's progress as ``brook-engine fetch`` counts it (the sampler's work, run by
hand here): the listing asked of the Hub only once a download runs and again after a
failure, bytes in place and in the Hub client's partial files, the total as a cap, a rate
that neither counts what was there before nor goes negative; and stale partial files
dropped before a download (``tests/integration/test_model_fetch.py`` runs it end to end)."""

from __future__ import annotations

import time
from pathlib import Path

from brook_engine.fetch import hub, progress
from brook_engine.fetch.progress import Progress

FILES = {"config.json": 100, "model.safetensors": 1000}


class CountingLister:
    def __init__(self, fail: int = 0) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self) -> dict[str, int]:
        self.calls += 1
        if self.calls <= self.fail:
            raise OSError("the Hub is busy (503)")
        return dict(FILES)


def _partial(folder: Path, name: str, size: int) -> Path:
    path = folder / progress.CLIENT_FOLDER / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def test_the_hub_is_asked_for_the_listing_only_once_a_download_runs(tmp_path: Path) -> None:
    lister = CountingLister()
    fetch = Progress("hf://o/m", tmp_path, lister)
    assert fetch.sample()["bytesTotal"] is None and lister.calls == 0  # starting
    fetch.set_state("complete")  # a folder already complete: nothing asked
    fetch.sample()
    assert lister.calls == 0
    fetch.set_state("waiting")
    assert fetch.sample()["bytesTotal"] == 1100
    fetch.set_state("downloading")
    fetch.sample()
    assert lister.calls == 1


def test_a_failed_listing_is_asked_again_later(tmp_path: Path) -> None:
    lister = CountingLister(fail=1)
    fetch = Progress("hf://o/m", tmp_path, lister)
    fetch.set_state("downloading")
    assert fetch.sample()["bytesTotal"] is None
    assert fetch.sample()["bytesTotal"] is None and lister.calls == 1  # not at once
    assert progress.LIST_RETRY_SECONDS > 1
    fetch._next_list = 0.0  # as if the wait were over
    assert fetch.sample()["bytesTotal"] == 1100 and lister.calls == 2


def test_bytes_in_place_and_in_partial_files_capped_by_the_total(tmp_path: Path) -> None:
    fetch = Progress("hf://o/m", tmp_path, CountingLister())
    fetch.set_state("downloading")
    (tmp_path / "config.json").write_bytes(b"{" * 100)
    (tmp_path / "stray.gguf").write_bytes(b"g" * 5000)  # not listed: not counted
    _partial(tmp_path, "abc.etag.1234abcd.incomplete", 400)
    answer = fetch.sample()
    assert answer["bytesDone"] == 500 and answer["filesDone"] == 1
    assert answer["filesTotal"] == 2 and answer["state"] == "downloading"
    _partial(tmp_path, "def.etag.5678abcd.incomplete", 5000)  # more than the total
    assert fetch.sample()["bytesDone"] == 1100
    fetch.set_state("complete")
    assert fetch.sample()["filesDone"] == 2


def test_the_rate_counts_only_what_arrives_and_is_never_negative(tmp_path: Path) -> None:
    fetch = Progress("hf://o/m", tmp_path, CountingLister())
    (tmp_path / "config.json").write_bytes(b"{" * 100)  # there before the listing
    assert fetch.sample()["bytesPerSecond"] is None  # starting: nothing listed
    fetch.set_state("downloading")
    assert fetch.sample()["bytesPerSecond"] is None  # one sample since the listing
    partial = _partial(tmp_path, "abc.etag.1234abcd.incomplete", 500)
    time.sleep(0.05)
    rate = fetch.sample()["bytesPerSecond"]
    assert isinstance(rate, float) and 0 < rate <= 500 / 0.05
    partial.unlink()  # between partial and place for a moment: a dip, not a negative rate
    time.sleep(0.01)
    assert fetch.sample()["bytesPerSecond"] == 0.0


def test_partial_files_of_a_download_cut_short_are_dropped(tmp_path: Path) -> None:
    stale = _partial(tmp_path, "sub/abc.etag.1234abcd.incomplete", 10)
    kept = _partial(tmp_path, "sub/model.safetensors.metadata", 10)
    hub._drop_partials(tmp_path)
    assert not stale.exists() and kept.exists()
    hub._drop_partials(tmp_path / "empty")  # nothing there: nothing to do
