"""The HTTP side: a kmock ``RawHandler`` that records every request, lets tests inject
reactions with kmock's DSL, and otherwise serves the emulated API from :class:`.Cluster`.

Why a ``RawHandler`` and not kmock's ``KubernetesEmulator``: the emulator mutates its
objects in ``_handle`` before any reaction with merge-only semantics, and kmock's request
parser cannot parse ``/api/v1/namespaces`` (the 500 on listing namespaces), so neither can
be fixed by overriding its fallbacks. This handler builds kmock ``Request`` objects itself
(correctly parsed, so kmock's criteria -- ``kmock.resource(...)``, ``kmock.method.PATCH``,
``namespace``, ``name`` -- match them), gives any matching reaction the first word, and
emulates the API only when no reaction answers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import traceback
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from . import discovery, errors, protobuf, proxy, routing, tables
from .apply import manager_from_user_agent
from .cluster import Cluster
from .faults import Fault
from .options import DeleteOptions, Writer
from .records import RecordedRequest, k8s_verb
from .resources import ResourceSpec
from .routing import Target
from .store import JsonObject, Watcher

logger = logging.getLogger(__name__)

_JSON = "application/json"


def _json_response(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(body).encode(), status=status, content_type=_JSON)


def _error_response(error: errors.ApiError) -> aiohttp.web.Response:
    return _json_response(error.status(), error.code)


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _parse_body(raw: bytes, content_type: str) -> Any:
    if not raw.strip():
        return None
    media = _media_type(content_type)
    if media == "application/vnd.kubernetes.protobuf":
        return protobuf.decode(raw)
    if "protobuf" in media or "cbor" in media:
        raise errors.ApiError(
            415,
            "UnsupportedMediaType",
            f"the emulated kube-apiserver accepts JSON and YAML, not {media}",
        )
    text = raw.decode("utf-8")
    try:
        return json.loads(text)
    except ValueError:
        if "yaml" in _media_type(content_type):
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise errors.bad_request(f"error decoding YAML: {exc}") from exc
        raise errors.bad_request("error decoding the request body: invalid JSON") from None


def _rbac_namespace(target: Target) -> str | None:
    """RequestInfo's namespace: a namespace's own name for ``/api/v1/namespaces/{name}``."""
    if target.is_resource and target.group == "" and target.plural == "namespaces":
        return target.name
    return target.namespace


def _continue_token(rv: int, last: JsonObject) -> str:
    meta = last["metadata"]
    key = {"rv": rv, "start": [meta.get("namespace") or "", meta["name"]]}
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


def _decode_continue(token: str) -> tuple[str, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        namespace, name = data["start"]
        return str(namespace), str(name)
    except (ValueError, KeyError, TypeError):
        raise errors.bad_request("invalid continue token") from None


@attrs.define(kw_only=True)
class KubeApiHandler(kmock.RawHandler):
    """A kmock handler serving the emulated Kubernetes API (see the package docstring)."""

    cluster: Cluster = attrs.field(factory=Cluster)
    address: str = "127.0.0.1:0"
    #: Seconds between BOOKMARK events on watches that allow them (None: only the
    #: initial-events-end bookmark of ``sendInitialEvents``).
    bookmark_interval: float | None = None
    records: list[RecordedRequest] = attrs.field(factory=list)
    #: Unexpected exceptions (bugs) while serving: the fixture fails the test on them.
    internal_errors: list[BaseException] = attrs.field(factory=list)
    #: Injected faults (:mod:`.faults`), checked before kmock's reactions and the emulation.
    faults: list[Fault] = attrs.field(factory=list)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        raw_body = await raw_request.read()
        target = routing.parse(raw_request.path)
        query = dict(raw_request.query)
        content_type = raw_request.headers.get("Content-Type", "")
        record = RecordedRequest(
            method=raw_request.method,
            path=raw_request.path,
            query=query,
            user_agent=raw_request.headers.get("User-Agent", ""),
            content_type=content_type,
            body=None,
            verb=k8s_verb(raw_request.method, target, query),
            api_group=target.group if target.is_resource else None,
            resource=(
                f"{target.plural}/{target.subresource}" if target.subresource else target.plural
            )
            if target.is_resource
            else None,
            namespace=_rbac_namespace(target),
            name=target.name,
        )
        self.records.append(record)
        fault = next((f for f in self.faults if f.matches(record)), None)
        if fault is not None:
            fault.hits += 1
            answer = await self._fault(raw_request, fault)
            if answer is not None:
                record.status = answer.status
                return answer
        try:
            # A proxy request's body is the pod's business, in whatever format.
            body = None if target.subresource == "proxy" else _parse_body(raw_body, content_type)
            record.body = body
            request = self._kmock_request(raw_request, raw_body, body, target, query)
            self._requests.append(request)
            response = await self._react(request)
            if response is None:
                response = await self._serve(raw_request, target, query, body, record)
        except errors.ApiError as exc:
            response = _error_response(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("kube_api: %s %s failed", raw_request.method, raw_request.path_qs)
            self.internal_errors.append(exc)
            response = _error_response(
                errors.ApiError(
                    500,
                    "InternalError",
                    f"Internal error occurred: {exc!r}",
                    {"causes": [{"message": traceback.format_exc()}]},
                )
            )
        if not record.status:
            record.status = response.status
        return response

    async def _fault(
        self, raw_request: aiohttp.web.BaseRequest, fault: Fault
    ) -> aiohttp.web.StreamResponse | None:
        """The injected answer (None: serve the request after the fault's delay)."""
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.hang is not None:
            await asyncio.sleep(fault.hang)
            if raw_request.transport is not None:
                raw_request.transport.abort()  # no answer, ever: the connection drops
            raise ConnectionResetError("injected fault: connection dropped")
        if fault.status is None:
            return None
        response = _error_response(fault.error())
        if fault.retry_after:
            response.headers["Retry-After"] = str(fault.retry_after)
        return response

    async def _react(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """The answer of the first matching kmock reaction, or None to emulate. An exception
        a reaction raises is the answer: an ``ApiError`` as its Status, others as a 500."""
        try:
            return await super()._handle(request)
        except NotImplementedError:
            return None
        except (errors.ApiError, asyncio.CancelledError):
            raise
        except Exception as exc:
            return _error_response(errors.ApiError(500, "InternalError", repr(exc)))

    def _kmock_request(
        self,
        raw_request: aiohttp.web.BaseRequest,
        raw_body: bytes,
        body: Any,
        target: routing.Target,
        query: dict[str, str],
    ) -> kmock.Request:
        verb = k8s_verb(raw_request.method, target, query)
        action = {
            "list": kmock.action.LIST,
            "watch": kmock.action.WATCH,
            "get": kmock.action.FETCH,
            "create": kmock.action.CREATE,
            "update": kmock.action.UPDATE,
            "patch": kmock.action.UPDATE,
            "delete": kmock.action.DELETE,
        }.get(verb or "")
        resource = (
            kmock.resource(target.group, target.version, target.plural)
            if target.is_resource
            else None
        )
        return kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=query,
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=raw_body,
            text=raw_body.decode("utf-8", errors="replace"),
            data=body,
            action=action,
            resource=resource,
            namespace=target.namespace,
            name=target.name,
            subresource=target.subresource,
        )

    # -- dispatch ----------------------------------------------------------------------------

    async def _serve(
        self,
        raw: aiohttp.web.BaseRequest,
        target: routing.Target,
        query: dict[str, str],
        body: Any,
        record: RecordedRequest,
    ) -> aiohttp.web.StreamResponse:
        if target.is_resource:
            return await self._serve_resource(raw, target, query, body, record)
        if raw.method != "GET":
            raise errors.method_not_allowed(raw.method)
        registry = self.cluster.registry
        document: Any = None
        if target.kind == "root":
            paths = ["/api", "/api/v1", "/apis", "/openapi/v3", "/version", "/healthz"]
            for group in registry.groups():
                paths.append(f"/apis/{group}")
                paths.extend(f"/apis/{group}/{v}" for v in registry.versions(group))
            document = {"paths": sorted(paths)}
        elif target.kind == "version":
            document = discovery.SERVER_VERSION
        elif target.kind == "health":
            return aiohttp.web.Response(text="ok")
        elif target.kind == "api":
            document = discovery.api_versions(self.address)
        elif target.kind == "apis":
            document = discovery.api_group_list(registry)
        elif target.kind == "group":
            document = discovery.api_group(registry, str(target.group))
        elif target.kind == "group-version":
            document = discovery.api_resource_list(registry, str(target.group), str(target.version))
        elif target.kind == "openapi-v3":
            document = discovery.openapi_root(registry)
        elif target.kind == "openapi-v3-gv":
            document = discovery.openapi_group_version(
                registry, str(target.group), str(target.version)
            )
        if document is None:
            raise errors.no_route()
        return _json_response(document)

    async def _serve_resource(
        self,
        raw: aiohttp.web.BaseRequest,
        target: routing.Target,
        query: dict[str, str],
        body: Any,
        record: RecordedRequest,
    ) -> aiohttp.web.StreamResponse:
        cluster = self.cluster
        spec = cluster.spec(str(target.group), str(target.version), str(target.plural))
        if target.namespace is not None and not spec.namespaced:
            raise errors.no_route()
        if target.subresource == "proxy":
            return await self._proxy(raw, spec, target)
        namespace, name, sub = target.namespace, target.name, target.subresource
        method = raw.method
        writer = Writer(
            manager=query.get("fieldManager")
            or manager_from_user_agent(raw.headers.get("User-Agent", "")),
            dry_run=query.get("dryRun") == "All",
            force=query.get("force") == "true",
        )
        as_table = tables.wants_table(raw.headers.get("Accept", ""))
        watching = query.get("watch") in ("true", "1")
        media = _media_type(raw.headers.get("Content-Type", ""))
        if method == "PATCH" and media == "application/apply-patch+yaml":
            if not query.get("fieldManager"):
                raise errors.bad_request("fieldManager is required for apply requests")
        elif query.get("force"):
            raise errors.bad_request("force must only be set for apply requests")

        if name is None:
            if method == "GET" and watching:
                return await self._watch(raw, spec, namespace, query, as_table, record)
            if method == "GET":
                return _json_response(self._list(spec, namespace, query, as_table))
            if method == "POST":
                return _json_response(cluster.create(spec, namespace, body, writer), 201)
            if method == "DELETE":
                options = DeleteOptions.parse(body, query)
                return _json_response(
                    cluster.delete_collection(
                        spec,
                        namespace,
                        query.get("labelSelector", ""),
                        query.get("fieldSelector", ""),
                        options,
                    )
                )
            raise errors.method_not_allowed(method)

        if sub is None:
            if method == "GET" and watching:
                selector = ",".join(
                    s for s in (query.get("fieldSelector", ""), f"metadata.name={name}") if s
                )
                return await self._watch(
                    raw, spec, namespace, {**query, "fieldSelector": selector}, as_table, record
                )
            if method == "GET":
                obj = cluster.get(spec, namespace, name)
                if as_table:
                    return _json_response(
                        tables.table(
                            spec,
                            [obj],
                            resource_version=obj["metadata"]["resourceVersion"],
                            include_object=query.get("includeObject", "Metadata"),
                        )
                    )
                return _json_response(obj)
            if method == "PUT":
                return _json_response(cluster.update(spec, namespace, name, body, writer))
            if method == "PATCH":
                obj, created = cluster.patch(spec, namespace, name, media, body, writer)
                record.created = created
                return _json_response(obj, 201 if created else 200)
            if method == "DELETE":
                options = DeleteOptions.parse(body, query)
                result, code = cluster.delete(spec, namespace, name, options)
                return _json_response(result, code)
            raise errors.method_not_allowed(method)

        if sub == "status" and spec.status:
            if method == "GET":
                return _json_response(cluster.get(spec, namespace, name))
            if method == "PUT":
                return _json_response(
                    cluster.update(spec, namespace, name, body, writer, subresource="status")
                )
            if method == "PATCH":
                obj, _ = cluster.patch(
                    spec, namespace, name, media, body, writer, subresource="status"
                )
                return _json_response(obj)
            raise errors.method_not_allowed(method)
        if sub == "scale" and spec.scale is not None:
            if method == "GET":
                return _json_response(cluster.get_scale(spec, namespace, name))
            if method == "PUT":
                return _json_response(cluster.update_scale(spec, namespace, name, body, writer))
            if method == "PATCH":
                return _json_response(
                    cluster.patch_scale(spec, namespace, name, media, body, writer)
                )
            raise errors.method_not_allowed(method)
        raise errors.no_route()

    async def _proxy(
        self, raw: aiohttp.web.BaseRequest, spec: ResourceSpec, target: routing.Target
    ) -> aiohttp.web.StreamResponse:
        """The pod's own answer (:mod:`.proxy`); services/proxy and nodes/proxy are not
        emulated."""
        if spec.group_resource != ("", "pods") or target.name is None:
            raise errors.no_route()
        name, port = proxy.split_name(target.name)
        pod = self.cluster.get(spec, target.namespace, name)
        # Path and query go on as the client encoded them (``%20`` stays ``%20``).
        raw_path = routing.parse(raw.rel_url.raw_path).proxy_path or "/"
        url = proxy.pod_url(pod, port, raw_path, raw.rel_url.raw_query_string)
        return await proxy.forward(raw, url)

    # -- list & watch ------------------------------------------------------------------------

    def _list(
        self, spec: ResourceSpec, namespace: str | None, query: Mapping[str, str], as_table: bool
    ) -> JsonObject:
        items, rv = self.cluster.list_objects(
            spec, namespace, query.get("labelSelector", ""), query.get("fieldSelector", "")
        )
        token = query.get("continue")
        if token:
            start = _decode_continue(token)
            items = [
                i
                for i in items
                if (i["metadata"].get("namespace") or "", i["metadata"]["name"]) > start
            ]
        limit = int(query.get("limit") or 0)
        next_token = ""
        remaining = 0
        if limit and len(items) > limit:
            remaining = len(items) - limit
            items = items[:limit]
            next_token = _continue_token(rv, items[-1])
        if as_table:
            return tables.table(
                spec,
                items,
                resource_version=str(rv),
                include_object=query.get("includeObject", "Metadata"),
                continue_token=next_token,
            )
        metadata: JsonObject = {"resourceVersion": str(rv)}
        if next_token:
            metadata["continue"] = next_token
            metadata["remainingItemCount"] = remaining
        return {
            "kind": spec.list_kind,
            "apiVersion": spec.api_version,
            "metadata": metadata,
            "items": [{**i, "apiVersion": spec.api_version, "kind": spec.kind} for i in items],
        }

    async def _watch(
        self,
        raw: aiohttp.web.BaseRequest,
        spec: ResourceSpec,
        namespace: str | None,
        query: Mapping[str, str],
        as_table: bool,
        record: RecordedRequest,
    ) -> aiohttp.web.StreamResponse:
        store = self.cluster.store
        label, field = query.get("labelSelector", ""), query.get("fieldSelector", "")
        watcher = self.cluster.watcher(spec, namespace, label, field)
        rv_param = query.get("resourceVersion", "")
        send_initial = query.get("sendInitialEvents") == "true"
        bookmarks = query.get("allowWatchBookmarks") == "true"
        # 0 (or absent) means the server's default: here, no timeout.
        timeout = float(query.get("timeoutSeconds") or 0) or None
        events: list[tuple[str, JsonObject]] = []
        expired: errors.ApiError | None = None
        # Snapshot and registration happen without awaiting: no event can fall in between.
        if rv_param in ("", "0") or send_initial:
            current, _ = self.cluster.list_objects(spec, namespace, label, field)
            events = [("ADDED", obj) for obj in current]
        else:
            try:
                since = int(rv_param)
            except ValueError:
                raise errors.bad_request(f"invalid resourceVersion: {rv_param!r}") from None
            try:
                history = store.history_since(since)
            except errors.ApiError as exc:
                expired = exc
                history = []
            events = [t for t in (watcher.translate(e) for e in history) if t is not None]
        start_rv = store.rv
        if expired is None:
            store.watchers.add(watcher)

        response = aiohttp.web.StreamResponse(
            status=200, headers={"Content-Type": _JSON, "Cache-Control": "no-cache"}
        )
        response.enable_chunked_encoding()
        await response.prepare(raw)
        record.status = 200
        try:
            if expired is not None:
                await self._send(response, spec, "ERROR", expired.status(), as_table)
                return response
            for event_type, obj in events:
                await self._send(response, spec, event_type, obj, as_table)
            if send_initial and bookmarks:
                await self._bookmark(response, spec, start_rv, initial_end=True)
            await self._stream(response, spec, watcher, timeout, bookmarks, as_table)
        except ConnectionError:
            pass
        finally:
            store.watchers.discard(watcher)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    async def _stream(
        self,
        response: aiohttp.web.StreamResponse,
        spec: ResourceSpec,
        watcher: Watcher,
        timeout: float | None,
        bookmarks: bool,
        as_table: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout is not None else None
        while True:
            waits = [w for w in (self.bookmark_interval if bookmarks else None,) if w]
            if deadline is not None:
                waits.append(deadline - loop.time())
            wait = min(waits) if waits else None
            if wait is not None and wait <= 0:
                return
            try:
                item = await asyncio.wait_for(watcher.queue.get(), timeout=wait)
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    return
                await self._bookmark(response, spec, self.cluster.store.rv)
                continue
            if item is None:
                return
            event_type, obj = item
            await self._send(response, spec, event_type, obj, as_table)

    async def _send(
        self,
        response: aiohttp.web.StreamResponse,
        spec: ResourceSpec,
        event_type: str,
        obj: JsonObject,
        as_table: bool,
    ) -> None:
        if event_type == "ERROR":
            payload = obj
        elif as_table:
            payload = tables.table(spec, [obj], resource_version=obj["metadata"]["resourceVersion"])
        else:
            payload = self.cluster.render(spec, obj)
        line = json.dumps({"type": event_type, "object": payload}) + "\n"
        await response.write(line.encode())

    async def _bookmark(
        self,
        response: aiohttp.web.StreamResponse,
        spec: ResourceSpec,
        rv: int,
        *,
        initial_end: bool = False,
    ) -> None:
        metadata: JsonObject = {"resourceVersion": str(rv)}
        if initial_end:
            metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
        bookmark = {"kind": spec.kind, "apiVersion": spec.api_version, "metadata": metadata}
        line = json.dumps({"type": "BOOKMARK", "object": bookmark}) + "\n"
        await response.write(line.encode())
