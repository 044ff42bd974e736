"""The API key: read from its file or environment variable, compared in constant time, never
logged. A key file is looked at again (at most once a second) and re-read when it changed,
so a rotated Kubernetes Secret takes effect without a restart; while the new file is not
readable (missing or empty in the middle of a swap) the previous key stays in force."""

from __future__ import annotations

import hmac
import logging
import os
import time
from pathlib import Path

from starlette.requests import Request

from brook_engine.config import ConfigError
from brook_engine.config.server import ApiKeyConfig
from brook_engine.server.errors import APIError

#: Seconds between two looks at the key file.
RECHECK_SECONDS = 1.0

log = logging.getLogger(__name__)


def read_api_key(config: ApiKeyConfig | None) -> str | None:
    """The key from its file or environment variable; ``ConfigError`` if it is not there.
    The key is never logged."""
    if config is None:
        return None
    if config.env is not None:
        key = os.environ.get(config.env, "").strip()
        where = f"environment variable {config.env}"
    else:
        assert config.file is not None
        try:
            key = Path(config.file).read_text("utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"server.apiKey.file: cannot read {config.file}: {exc.strerror}"
            ) from None
        where = f"file {config.file}"
    if not key:
        raise ConfigError(f"server.apiKey: the {where} is empty; put the key there")
    return key


class ApiKey:
    """Checks ``Authorization: Bearer KEY`` against the configured key (no key: all pass)."""

    def __init__(self, config: ApiKeyConfig | None) -> None:
        self.config = config
        self._file = Path(config.file) if config is not None and config.file else None
        self._version = self._file_version()  # before reading: a change meanwhile is seen
        self._key = read_api_key(config)
        self._next_look = time.monotonic() + RECHECK_SECONDS

    @property
    def is_set(self) -> bool:
        return self._key is not None

    def authorize(self, request: Request) -> None:
        """Raise 401 unless the request carries the key."""
        key = self._current()
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key; send it as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _current(self) -> str | None:
        if self._file is None or time.monotonic() < self._next_look:
            return self._key
        self._next_look = time.monotonic() + RECHECK_SECONDS
        version = self._file_version()
        if version == self._version:
            return self._key
        self._version = version
        try:
            key = read_api_key(self.config)
        except ConfigError as exc:
            log.warning("%s; keeping the previous API key", exc)
            return self._key
        if key != self._key:
            self._key = key
            log.info("the API key file %s changed; the new key is in force", self._file)
        return self._key

    def _file_version(self) -> tuple[int, int, int] | None:
        """What changes when the file is rewritten or swapped (a Secret's symlink moves)."""
        if self._file is None:
            return None
        try:
            stat = self._file.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_ino, stat.st_size
