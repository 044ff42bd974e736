"""The ``config.json`` of a resource's model, read from the Hugging Face Hub (or a mirror) for
``hf://`` sources, so the operator can plan a replica's memory before any pod is scheduled.

One small GET per model and revision (``{endpoint}/{repo}/resolve/{revision}/config.json``,
the Hub's file URL), bounded in time and size, through the proxy the environment names, as
any Hub client goes. Answers are kept: a readable config for an hour (a revision rarely
changes what ``config.json`` says about shapes), a failure for five minutes, so an
unreachable Hub costs one short wait per model now and then, never one per reconcile. Other
sources (pvc://, s3://, oci://, file://) and private repositories (the operator holds no
token) give no config: the plan is then checked by the engine at start, as before."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from brook_engine.config.model import split_model_uri

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
#: A config.json is a few KiB; a larger answer is not one.
MAX_CONFIG_BYTES = 1024 * 1024
#: How long a read config, and a failure to read one, are kept.
KEEP_SECONDS = 3600.0
RETRY_SECONDS = 300.0


def config_url(endpoint: str, uri: str, revision: str | None) -> str | None:
    """The Hub URL of ``uri``'s ``config.json`` (None for sources other than hf://)."""
    scheme, repo = split_model_uri(uri)
    if scheme != "hf":
        return None
    quoted = urllib.parse.quote(revision or "main", safe="")
    return f"{endpoint.rstrip('/')}/{repo}/resolve/{quoted}/config.json"


class ConfigUnreadable(Exception):
    """The Hub did not give a config.json (its message says why)."""


def read_config(url: str, timeout: float) -> dict[str, Any]:
    """GET ``url`` (redirects followed, environment proxies used), at most
    ``MAX_CONFIG_BYTES`` within about ``timeout``; the JSON object it holds."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = b""
            while chunk := response.read(64 * 1024):
                body += chunk
                if len(body) > MAX_CONFIG_BYTES:
                    raise ConfigUnreadable(f"{url}: larger than {MAX_CONFIG_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise ConfigUnreadable(f"{url}: not read within {timeout:g} s")
    except urllib.error.HTTPError as exc:
        raise ConfigUnreadable(f"{url}: HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:  # URLError, timeouts, resets, a bad URL
        raise ConfigUnreadable(f"{url}: {exc}") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise ConfigUnreadable(f"{url}: not JSON") from None
    if not isinstance(data, dict):
        raise ConfigUnreadable(f"{url}: not a config.json object")
    return data


@dataclass
class _Entry:
    config: dict[str, Any] | None
    until: float


@dataclass
class ModelConfigs:
    """``config.json`` of hf:// models, read once and kept (thread-safe: kopf runs
    handlers on several threads)."""

    endpoint: str = DEFAULT_ENDPOINT
    timeout: float = 3.0
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, uri: str, revision: str | None) -> dict[str, Any] | None:
        """The model's config, or None where it cannot be had (logged once per model)."""
        url = config_url(self.endpoint, uri, revision)
        if url is None:
            return None
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None and entry.until > self.clock():
                return entry.config
        try:
            config: dict[str, Any] | None = read_config(url, self.timeout)
            until = self.clock() + KEEP_SECONDS
        except ConfigUnreadable as exc:
            if entry is None or entry.config is not None:  # once per failure, not per try
                log.warning(
                    "no memory plan before scheduling for %s: %s (the engine checks it at "
                    "start; tried again in %.0f s)",
                    uri,
                    exc,
                    RETRY_SECONDS,
                )
            config, until = None, self.clock() + RETRY_SECONDS
        with self._lock:
            self._entries[url] = _Entry(config, until)
        return config
