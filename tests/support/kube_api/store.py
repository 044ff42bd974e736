"""Objects, the global resourceVersion counter, the event history and live watchers.

All of it lives on the server's event loop thread; nothing here awaits, so each write and
each watch registration is atomic with respect to the others. Stored objects are never
mutated in place (every write stores a new dict), so events can share them safely.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import errors
from .resources import GroupResource
from .selectors import Predicate

JsonObject = dict[str, Any]
ObjectKey = tuple[str | None, str]

#: How many events are kept for watches that resume from a resourceVersion.
HISTORY_LIMIT = 50_000


@dataclass(frozen=True)
class Event:
    rv: int
    group_resource: GroupResource
    type: str  # ADDED, MODIFIED, DELETED
    obj: JsonObject
    old: JsonObject | None


def _namespace(obj: JsonObject) -> str | None:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return str(namespace) if namespace else None


@dataclass(eq=False)
class Watcher:
    """One watch request: what it selects, and a queue of ``(type, object)`` to stream.
    ``None`` in the queue ends the stream."""

    group_resource: GroupResource
    namespace: str | None
    predicate: Predicate
    queue: asyncio.Queue[tuple[str, JsonObject] | None] = field(default_factory=asyncio.Queue)

    def _selects(self, obj: JsonObject | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and _namespace(obj) != self.namespace:
            return False
        return self.predicate(obj)

    def translate(self, event: Event) -> tuple[str, JsonObject] | None:
        """The event this watcher sees: objects entering or leaving its selection are
        ADDED/DELETED, as the real server's watch cache reports them."""
        if event.group_resource != self.group_resource:
            return None
        now = event.type != "DELETED" and self._selects(event.obj)
        before = self._selects(event.old) if event.type != "ADDED" else False
        if event.type == "DELETED":
            return ("DELETED", event.obj) if self._selects(event.obj) else None
        if now and before:
            return ("MODIFIED", event.obj)
        if now:
            return ("ADDED", event.obj)
        if before:
            return ("DELETED", event.obj)
        return None

    def offer(self, event: Event) -> None:
        translated = self.translate(event)
        if translated is not None:
            self.queue.put_nowait(translated)

    def close(self) -> None:
        self.queue.put_nowait(None)


class Store:
    def __init__(self) -> None:
        self.rv = 0
        self._objects: dict[GroupResource, dict[ObjectKey, JsonObject]] = {}
        self._uids: dict[str, tuple[GroupResource, ObjectKey]] = {}
        self._events: list[Event] = []
        self.compacted = 0
        self.watchers: set[Watcher] = set()

    # -- reading -----------------------------------------------------------------------------

    def get(
        self, group_resource: GroupResource, namespace: str | None, name: str
    ) -> JsonObject | None:
        return self._objects.get(group_resource, {}).get((namespace, name))

    def items(
        self, group_resource: GroupResource, namespace: str | None = None
    ) -> list[JsonObject]:
        """Objects in key order (namespace, then name), as etcd lists them."""
        bucket = self._objects.get(group_resource, {})
        keys = sorted(
            (k for k in bucket if namespace is None or k[0] == namespace),
            key=lambda k: (k[0] or "", k[1]),
        )
        return [bucket[k] for k in keys]

    def everything(self) -> Iterator[tuple[GroupResource, JsonObject]]:
        for group_resource, bucket in list(self._objects.items()):
            for obj in list(bucket.values()):
                yield group_resource, obj

    def by_uid(self, uid: str) -> tuple[GroupResource, JsonObject] | None:
        where = self._uids.get(uid)
        if where is None:
            return None
        obj = self.get(where[0], *where[1])
        return (where[0], obj) if obj is not None else None

    # -- writing -----------------------------------------------------------------------------

    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, group_resource: GroupResource, obj: JsonObject, rv: int) -> None:
        meta = obj["metadata"]
        key: ObjectKey = (meta.get("namespace") or None, meta["name"])
        bucket = self._objects.setdefault(group_resource, {})
        old = bucket.get(key)
        bucket[key] = obj
        self._uids[meta["uid"]] = (group_resource, key)
        self._emit(Event(rv, group_resource, "MODIFIED" if old else "ADDED", obj, old))

    def remove(self, group_resource: GroupResource, obj: JsonObject, rv: int) -> None:
        meta = obj["metadata"]
        key: ObjectKey = (meta.get("namespace") or None, meta["name"])
        old = self._objects.get(group_resource, {}).pop(key, None)
        self._uids.pop(meta["uid"], None)
        self._emit(Event(rv, group_resource, "DELETED", obj, old))

    def _emit(self, event: Event) -> None:
        self._events.append(event)
        if len(self._events) > HISTORY_LIMIT:
            dropped = self._events[: HISTORY_LIMIT // 2]
            self._events = self._events[HISTORY_LIMIT // 2 :]
            self.compacted = dropped[-1].rv
        for watcher in list(self.watchers):
            watcher.offer(event)

    def compact(self) -> None:
        """Forget the event history: watches resuming from older versions get 410 Gone."""
        self._events.clear()
        self.compacted = self.rv

    # -- watching ----------------------------------------------------------------------------

    def history_since(self, since: int) -> list[Event]:
        if since < self.compacted:
            raise errors.gone(since, self.compacted + 1)
        return [e for e in self._events if e.rv > since]

    def close_watchers(self, group_resource: GroupResource | None = None) -> None:
        for watcher in list(self.watchers):
            if group_resource is None or watcher.group_resource == group_resource:
                watcher.close()
                self.watchers.discard(watcher)
