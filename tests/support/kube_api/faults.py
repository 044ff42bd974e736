"""Faults injected into the emulated API server: the answers and failures a real one gives
under load or trouble, for the requests a test picks (``KubeApi.inject``).

* ``status``: answer with that code and the real server's ``Status`` (429
  ``TooManyRequests`` with ``Retry-After`` when ``retry_after`` is set, 500
  ``InternalError``, 503 ``ServiceUnavailable``, 409 ``Conflict``, 403 ``Forbidden`` …).
  Nothing is changed: the request never reached the storage.
* ``hang``: read the request and answer nothing for that many seconds, then drop the
  connection -- a half-open connection, a stuck proxy, an overloaded server. Nothing is
  changed either (a hang that ends in the emulation is a slow server: ``delay``).
* ``delay``: wait that many seconds, then serve the request normally.

A fault matches requests by Kubernetes verb, resource (with the subresource:
``llminferences/status``), namespace, name and User-Agent prefix (None: any), for ``times``
requests (None: until removed). Dropped watches are ``KubeApi.drop_watches``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import errors
from .records import RecordedRequest

#: The reasons the real server gives with these codes.
_REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass
class Fault:
    verb: str | None = None
    resource: str | None = None
    namespace: str | None = None
    name: str | None = None
    user_agent: str | None = None
    status: int | None = None
    retry_after: int | None = None
    hang: float | None = None
    delay: float | None = None
    times: int | None = None
    #: Requests it has met so far.
    hits: int = 0

    def matches(self, record: RecordedRequest) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        return (
            (self.verb is None or record.verb == self.verb)
            and (self.resource is None or record.resource == self.resource)
            and (self.namespace is None or record.namespace == self.namespace)
            and (self.name is None or record.name == self.name)
            and (self.user_agent is None or record.user_agent.startswith(self.user_agent))
        )

    def error(self) -> errors.ApiError:
        code = self.status or 500
        reason = _REASONS.get(code, "InternalError")
        message = f"injected fault: {code} {reason}"
        details = {"retryAfterSeconds": self.retry_after} if self.retry_after else None
        return errors.ApiError(code, reason, message, details)
