"""The ``config.json`` of a resource's model, read from the Hugging Face Hub (or a mirror) for
``hf://`` sources, so the operator can plan a replica's memory before any pod is scheduled.

One small GET per model and revision (``{endpoint}/{repo}/resolve/{revision}/config.json``,
the Hub's file URL), bounded in time and size, through the proxy the environment names, as
any Hub client goes; redirects only within the endpoint's server, and a model URI can only
name a repository there. Answers are kept: a readable config for an hour (a revision rarely
changes what ``config.json`` says about shapes), a failure for five minutes, so an
unreachable Hub costs one short wait per model now and then, never one per reconcile; a
config read once stays in use while the Hub cannot be reached. Other
sources (pvc://, s3://, oci://, file://) and private repositories (the operator holds no
token) give no config: the plan is then checked by the engine at start, as before."""

from __future__ import annotations

import json
import logging
import re
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


#: A Hub repository id: ``NAME`` or ``ORG/NAME`` of letters, digits, ``_``, ``-`` and ``.``
#: (as the Hub allows), so a model URI can only ever name a repository on the endpoint.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_endpoint(value: str) -> str:
    """``value`` if it is ``off`` or an http(s) URL without credentials (``--hub-endpoint``);
    ValueError naming the fix otherwise."""
    if value == "off":
        return value
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL; give the Hub's or a mirror's, or off")
    if parts.username or parts.password:
        raise ValueError("the Hub endpoint must not hold credentials (they would reach logs)")
    return value


def config_url(endpoint: str, uri: str, revision: str | None) -> str | None:
    """The Hub URL of ``uri``'s ``config.json`` (None for sources other than hf://, and for
    a repository id the Hub would not accept)."""
    scheme, repo = split_model_uri(uri)
    repo = repo.rstrip("/")
    if scheme != "hf" or not _REPO_ID.fullmatch(repo) or ".." in repo:
        return None
    quoted = urllib.parse.quote(revision or "main", safe="")
    return f"{endpoint.rstrip('/')}/{repo}/resolve/{quoted}/config.json"


class ConfigUnreadable(Exception):
    """The Hub did not give a config.json (its message says why)."""


class _SameServer(urllib.request.HTTPRedirectHandler):
    """Redirects within the endpoint's own server only (the Hub answers a renamed repository
    or a cached file with a relative one)."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (old.scheme, old.netloc) != (new.scheme, new.netloc):
            raise ConfigUnreadable(f"{req.full_url}: redirected to another server ({newurl})")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameServer())


def read_config(url: str, timeout: float) -> dict[str, Any]:
    """GET ``url`` (redirects within its server followed, environment proxies used), at
    most ``MAX_CONFIG_BYTES``: ``timeout`` per network operation and, for the body, about
    ``timeout`` overall (a receive at a time); the JSON object it holds. The endpoint is the
    operator's own setting, never a resource's, so its headers get only the standard
    library's bounds."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body = b""
            while chunk := response.read1(64 * 1024):  # one receive: the deadline holds
                body += chunk
                if len(body) > MAX_CONFIG_BYTES:
                    raise ConfigUnreadable(f"{url}: larger than {MAX_CONFIG_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise ConfigUnreadable(f"{url}: not read within {timeout:g} s")
            if getattr(response, "length", None):  # bytes the server announced and never sent
                raise ConfigUnreadable(f"{url}: the answer was cut short")
    except ConfigUnreadable:
        raise
    except urllib.error.HTTPError as exc:
        raise ConfigUnreadable(f"{url}: HTTP {exc.code}") from None
    except Exception as exc:  # URLError, timeouts, resets, protocol errors: never the loop's
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
    failing: bool = False  # the last read failed


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
            until, failing = self.clock() + KEEP_SECONDS, False
        except ConfigUnreadable as exc:
            # The last config read, if any, stays in use: a Hub that is down for a while
            # must not change what the resource's pods request (that would roll them).
            config = entry.config if entry is not None else None
            until, failing = self.clock() + RETRY_SECONDS, True
            if entry is None or not entry.failing:  # once per outage, not per try
                log.warning(
                    "config.json of %s not read: %s (%s; tried again in %.0f s)",
                    uri,
                    exc,
                    "the last one read stays in use"
                    if config is not None
                    else "no memory plan before scheduling: the engine checks it at start",
                    RETRY_SECONDS,
                )
        with self._lock:
            self._entries[url] = _Entry(config, until, failing)
        return config
