"""The pods ``proxy`` subresource: ``/api/v1/namespaces/{ns}/pods/{NAME[:PORT]}/proxy/{path}``
goes on to ``http://{status.podIP}:{PORT}/{path}`` and the pod's answer comes back as it is
(status, body, Content-Type), as with the real server's pod proxy (``kubectl get --raw``).
Tests start an HTTP server on 127.0.0.1 and set that as the pod's ``status.podIP``.

Where the real server differs: it refuses loopback and link-local pod IPs (400 "address not
allowed"; here they are the point), it proxies https too (here a 400), and it waits longer.
"""

from __future__ import annotations

import aiohttp
import aiohttp.web
import yarl

from . import errors
from .store import JsonObject

#: Longest a pod may take to answer.
TIMEOUT_SECONDS = 10.0
#: The request headers passed on to the pod.
_FORWARDED = ("Content-Type", "Accept")


def split_name(segment: str) -> tuple[str, str]:
    """(name, port) of ``NAME``, ``NAME:PORT`` or ``SCHEME:NAME:PORT``, as the real server's
    ``SplitSchemeNamePort`` splits them (the port may be empty)."""
    scheme, port = "", ""
    match segment.split(":"):
        case [name]:
            pass
        case [name, port]:
            pass
        case [scheme, name, port]:
            pass
        case _:
            name = ""
    if not name or scheme not in ("", "http", "https") or not (port == "" or port.isdigit()):
        raise errors.bad_request(f'invalid pod request "{segment}"')
    if scheme == "https":
        raise errors.bad_request(
            f'the emulated kube-apiserver proxies to pods over http only ("{segment}")'
        )
    return name, port


def pod_url(pod: JsonObject, port: str, raw_path: str, raw_query: str) -> yarl.URL:
    """Where the request goes: the pod's IP, the port asked for (else the first container
    port, else 80, as the real server picks), the path after ``proxy`` and the query, both
    as the client encoded them."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        # The real server's words, then why: the pod has no IP (not scheduled or started).
        raise errors.bad_request(
            f'address not allowed: pod "{pod["metadata"]["name"]}" has no IP (status.podIP)'
        )
    host = f"[{ip}]" if ":" in ip else ip
    port = port or _first_container_port(pod) or "80"
    query = f"?{raw_query}" if raw_query else ""
    return yarl.URL(f"http://{host}:{port}{raw_path}{query}", encoded=True)


def _first_container_port(pod: JsonObject) -> str:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("ports") or []:
            if entry.get("containerPort"):
                return str(entry["containerPort"])
    return ""


async def forward(raw: aiohttp.web.BaseRequest, url: yarl.URL) -> aiohttp.web.Response:
    """The pod's answer to the request; a 503 Status when the pod cannot be reached."""
    headers = {h: raw.headers[h] for h in _FORWARDED if h in raw.headers}
    body = await raw.read()  # aiohttp keeps the body the handler read first
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(raw.method, url, headers=headers, data=body or None) as answer,
        ):
            content = await answer.read()
            content_type = answer.headers.get("Content-Type")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise errors.service_unavailable(
            f"error trying to reach service: {_reason(url, exc)}"
        ) from None
    return aiohttp.web.Response(
        body=content,
        status=answer.status,
        headers={"Content-Type": content_type} if content_type else None,
    )


def _reason(url: yarl.URL, exc: BaseException) -> str:
    """Go's wording of the usual failures (clients match on it); the exception's otherwise."""
    address = f"{url.host}:{url.port}"
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
        exc.os_error, ConnectionRefusedError
    ):
        return f"dial tcp {address}: connect: connection refused"
    if isinstance(exc, TimeoutError):
        return f"dial tcp {address}: i/o timeout"
    return str(exc) or type(exc).__name__
