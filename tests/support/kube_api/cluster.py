"""The API semantics: what create, update, patch, apply, delete and the subresources do to
stored objects, with the metadata rules, finalizers, garbage collection, namespace
termination and CRD registration of the real server. HTTP is elsewhere (:mod:`.handler`).

Every method runs on the server's loop thread and never awaits.
"""

from __future__ import annotations

import copy
import ipaddress
import uuid
from collections.abc import Mapping
from typing import Any

from . import apply, defaults, errors, objects, patches, schema, selectors
from .apply import ManagerEntry
from .options import PATCH_TYPES, DeleteOptions, Writer
from .resources import (
    CRD_GROUP_RESOURCE,
    NAMESPACES,
    GroupResource,
    Registry,
    ResourceSpec,
    check_crd,
    specs_from_crd,
)
from .store import JsonObject, Store, Watcher

#: Resources whose objects have no metadata.generation on the real server.
NO_GENERATION: frozenset[GroupResource] = frozenset(
    {
        ("", "configmaps"),
        ("", "secrets"),
        ("", "events"),
        ("", "serviceaccounts"),
        ("", "namespaces"),
        ("events.k8s.io", "events"),
        ("coordination.k8s.io", "leases"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
        ("rbac.authorization.k8s.io", "clusterroles"),
        ("rbac.authorization.k8s.io", "clusterrolebindings"),
    }
)
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
SERVER = Writer("kube-apiserver")
_SERVER_METADATA = (
    "uid",
    "creationTimestamp",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
)


def _strip_for_generation(obj: Mapping[str, Any], spec: ResourceSpec) -> dict[str, Any]:
    ignored = {"metadata", "status"} if spec.status else {"metadata"}
    return {k: v for k, v in obj.items() if k not in ignored}


class Cluster:
    def __init__(self) -> None:
        self.registry = Registry()
        self.store = Store()
        self.managed: dict[str, list[ManagerEntry]] = {}
        self._next_ip = 10
        for name in INITIAL_NAMESPACES:
            self.create(
                self.spec("", "v1", "namespaces"), None, {"metadata": {"name": name}}, SERVER
            )

    def _allocate_ip(self) -> str:
        """The next Service clusterIP (10.96.0.0/12, as a default cluster)."""
        self._next_ip += 1
        return str(ipaddress.ip_address("10.96.0.0") + self._next_ip)

    # -- lookups -----------------------------------------------------------------------------

    def spec(self, group: str, version: str, plural: str) -> ResourceSpec:
        found = self.registry.get(group, version, plural)
        if found is None:
            raise errors.no_route()
        return found

    def render(self, spec: ResourceSpec, obj: JsonObject) -> JsonObject:
        """An object as this served version shows it (only ``apiVersion`` differs)."""
        if obj.get("apiVersion") == spec.api_version:
            return obj
        return {**obj, "apiVersion": spec.api_version}

    def _existing(self, spec: ResourceSpec, namespace: str | None, name: str) -> JsonObject:
        obj = self.store.get(spec.group_resource, namespace if spec.namespaced else None, name)
        if obj is None:
            raise errors.not_found(spec.group, spec.plural, name)
        return obj

    def get(self, spec: ResourceSpec, namespace: str | None, name: str) -> JsonObject:
        return self.render(spec, self._existing(spec, namespace, name))

    def list_objects(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        label_selector: str = "",
        field_selector: str = "",
    ) -> tuple[list[JsonObject], int]:
        predicate = selectors.matcher(label_selector, field_selector, spec.group, spec.plural)
        items = self.store.items(spec.group_resource, namespace if spec.namespaced else None)
        return [self.render(spec, o) for o in items if predicate(o)], self.store.rv

    def watcher(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        label_selector: str,
        field_selector: str,
    ) -> Watcher:
        predicate = selectors.matcher(label_selector, field_selector, spec.group, spec.plural)
        return Watcher(spec.group_resource, namespace if spec.namespaced else None, predicate)

    # -- create ------------------------------------------------------------------------------

    def create(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        body: Any,
        writer: Writer,
        *,
        applied: bool = False,
    ) -> JsonObject:
        """POST (or server-side apply of a missing object, with ``applied``)."""
        if not isinstance(body, Mapping):
            raise errors.not_an_object("the body of the request", body)
        obj = copy.deepcopy(dict(body))
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        name = meta.get("name") or (
            objects.generated_name(meta["generateName"]) if meta.get("generateName") else None
        )
        if not name:
            raise errors.invalid(
                spec.group,
                spec.plural,
                "",
                "metadata.name: Required value: name or generateName is required",
            )
        meta["name"] = name
        if spec.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            namespace = namespace or meta.get("namespace")
            if not namespace:
                raise errors.bad_request("a namespace is required for a namespaced resource")
            self._check_namespace_open(spec, namespace, name)
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
            namespace = None
        if meta.get("resourceVersion"):
            raise errors.ApiError(
                500,
                "InternalError",
                "Internal error occurred: resourceVersion should not be set on objects to be "
                "created",
            )
        if self.store.get(spec.group_resource, namespace, name) is not None:
            raise errors.already_exists(spec.group, spec.plural, name)
        for key in _SERVER_METADATA:
            meta.pop(key, None)
        obj["apiVersion"] = spec.storage_api_version
        obj["kind"] = spec.kind
        if spec.status:
            obj.pop("status", None)
        obj = schema.prune_and_default(obj, spec.schema)
        meta = obj["metadata"]
        defaults.builtin_defaults(spec, obj, None, self._allocate_ip)
        if spec.group_resource == CRD_GROUP_RESOURCE:
            check_crd(obj)
            obj["status"] = defaults.crd_status(obj)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = objects.timestamp()
        if spec.group_resource not in NO_GENERATION:
            meta["generation"] = 1
        if applied:
            owned = apply.leaf_values(
                apply.strip_nulls(body),
                False if spec.status else None,
                schema.list_maps(spec.schema),
            )
            entries = [
                ManagerEntry(
                    writer.manager, "Apply", "", spec.api_version, objects.timestamp(), set(owned)
                )
            ]
        else:
            entries = apply.track_update(
                [],
                {},
                obj,
                manager=writer.manager,
                subresource="",
                api_version=spec.api_version,
                status_part=None,
                list_maps=schema.list_maps(spec.schema),
            )
        return self._store(spec, obj, entries, writer, created=True)

    def _check_namespace_open(self, spec: ResourceSpec, namespace: str, name: str) -> None:
        ns = self.store.get(NAMESPACES, None, namespace)
        if ns is None:
            raise errors.not_found("", "namespaces", namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise errors.forbidden(
                spec.group,
                spec.plural,
                name,
                f"unable to create new content in namespace {namespace} because it is being "
                "terminated",
            )

    # -- update / patch ----------------------------------------------------------------------

    def update(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        body: Any,
        writer: Writer,
        *,
        subresource: str = "",
    ) -> JsonObject:
        """PUT: replace the object (or only its status through ``/status``)."""
        if not isinstance(body, Mapping):
            raise errors.not_an_object("the body of the request", body)
        old = self._existing(spec, namespace, name)
        if spec.is_custom and not (body.get("metadata") or {}).get("resourceVersion"):
            raise errors.invalid(
                spec.group,
                spec.plural,
                name,
                "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            )
        return self._write(spec, old, dict(body), writer, subresource=subresource)

    def patch(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        patch_type: str,
        patch: Any,
        writer: Writer,
        *,
        subresource: str = "",
    ) -> tuple[JsonObject, bool]:
        """PATCH in any of the four formats. Returns the object and whether it was created
        (only server-side apply creates)."""
        if patch_type not in PATCH_TYPES:
            raise errors.unsupported_media_type(patch_type)
        if patch_type == "application/strategic-merge-patch+json" and spec.is_custom:
            raise errors.ApiError(
                415,
                "UnsupportedMediaType",
                "strategic merge patch is not supported for custom resources; use "
                "application/merge-patch+json or application/apply-patch+yaml",
            )
        key_namespace = namespace if spec.namespaced else None
        old = self.store.get(spec.group_resource, key_namespace, name)
        if patch_type == "application/apply-patch+yaml":
            return self._apply(spec, namespace, name, old, patch, writer, subresource)
        if old is None:
            raise errors.not_found(spec.group, spec.plural, name)
        rendered = self.render(spec, old)
        if patch_type == "application/json-patch+json":
            candidate = patches.json_patch(rendered, patch)
        elif not isinstance(patch, Mapping):
            raise errors.not_an_object("a merge patch", patch)
        elif patch_type == "application/merge-patch+json":
            candidate = patches.merge_patch(rendered, patch)
        else:
            candidate = patches.strategic_merge_patch(rendered, patch)
        if not isinstance(candidate, dict):
            raise errors.unprocessable("the patched object is not a JSON object")
        return self._write(spec, old, candidate, writer, subresource=subresource), False

    def _apply(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        old: JsonObject | None,
        config: Any,
        writer: Writer,
        subresource: str,
    ) -> tuple[JsonObject, bool]:
        if not isinstance(config, Mapping):
            raise errors.not_an_object("an applied configuration", config)
        meta = config.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise errors.bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the "
                f"URL ({name})"
            )
        if old is None:
            if subresource:
                raise errors.not_found(spec.group, spec.plural, name)
            body = copy.deepcopy(dict(config))
            body.setdefault("metadata", {})["name"] = name
            created = self.create(spec, namespace, body, writer, applied=True)
            return self.render(spec, created), True
        status_part = self._status_part(spec, subresource)
        entries = copy.deepcopy(self.managed.get(old["metadata"]["uid"], []))
        rendered = self.render(spec, old)
        merged, entries = apply.server_side_apply(
            entries,
            rendered,
            config,
            manager=writer.manager,
            force=writer.force,
            subresource=subresource,
            api_version=spec.api_version,
            status_part=status_part,
            group=spec.group,
            plural=spec.plural,
            name=name,
            list_maps=schema.list_maps(spec.schema),
        )
        meta_rv = (config.get("metadata") or {}).get("resourceVersion")
        merged.setdefault("metadata", {})["resourceVersion"] = (
            meta_rv or old["metadata"]["resourceVersion"]
        )
        return self._write(
            spec, old, merged, writer, subresource=subresource, entries=entries
        ), False

    @staticmethod
    def _status_part(spec: ResourceSpec, subresource: str) -> bool | None:
        if subresource == "status":
            return True
        return False if spec.status else None

    def _write(
        self,
        spec: ResourceSpec,
        old: JsonObject,
        candidate: JsonObject,
        writer: Writer,
        *,
        subresource: str = "",
        entries: list[ManagerEntry] | None = None,
    ) -> JsonObject:
        """The common path of every change to an existing object."""
        old_meta = old["metadata"]
        name = old_meta["name"]
        new = copy.deepcopy(candidate)
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        if meta.get("name", name) != name:
            raise errors.bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the "
                f"URL ({name})"
            )
        if (
            spec.namespaced
            and meta.get("namespace", old_meta["namespace"]) != old_meta["namespace"]
        ):
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        rv = meta.get("resourceVersion")
        if rv and str(rv) != old_meta["resourceVersion"]:
            raise errors.stale(spec.group, spec.plural, name)
        for key in (*_SERVER_METADATA, "name", "namespace", "resourceVersion"):
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        new["apiVersion"] = spec.storage_api_version
        new["kind"] = spec.kind
        if subresource in ("status",):
            only_status = copy.deepcopy(old)
            if "status" in new:
                only_status["status"] = new["status"]
            else:
                only_status.pop("status", None)
            new = only_status
        elif spec.status:
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        new = schema.prune_and_default(new, spec.schema)
        defaults.builtin_defaults(spec, new, old, self._allocate_ip)
        meta = new["metadata"]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or ()) - set(old_meta.get("finalizers") or ())
            if added:
                raise errors.invalid(
                    spec.group,
                    spec.plural,
                    name,
                    "metadata.finalizers: Forbidden: no new finalizers can be added if the "
                    f"object is being deleted, found new finalizers {sorted(added)}",
                )
        if not meta.get("finalizers"):
            meta.pop("finalizers", None)
        if spec.group_resource == CRD_GROUP_RESOURCE and subresource != "status":
            check_crd(new)
            new["status"] = defaults.crd_status(new, old.get("status"))
        if "generation" in old_meta and _strip_for_generation(new, spec) != _strip_for_generation(
            old, spec
        ):
            meta["generation"] = old_meta["generation"] + 1
        if entries is None:
            entries = apply.track_update(
                copy.deepcopy(self.managed.get(old_meta["uid"], [])),
                old,
                new,
                manager=writer.manager,
                subresource=subresource,
                api_version=spec.api_version,
                status_part=self._status_part(spec, subresource),
                list_maps=schema.list_maps(spec.schema),
            )
        meta["managedFields"] = [e.render() for e in entries]
        if not meta["managedFields"]:
            del meta["managedFields"]
        if new == old:
            return self.render(spec, old)  # a no-op: no new resourceVersion, no event
        return self._store(spec, new, entries, writer, created=False)

    def _store(
        self,
        spec: ResourceSpec,
        obj: JsonObject,
        entries: list[ManagerEntry],
        writer: Writer,
        *,
        created: bool,
    ) -> JsonObject:
        meta = obj["metadata"]
        meta["managedFields"] = [e.render() for e in entries]
        if not meta["managedFields"]:
            del meta["managedFields"]
        if writer.dry_run:
            meta.setdefault("resourceVersion", "")
            return self.render(spec, obj)
        rv = self.store.next_rv()
        meta["resourceVersion"] = str(rv)
        self.managed[meta["uid"]] = entries
        self.store.put(spec.group_resource, obj, rv)
        if spec.group_resource == CRD_GROUP_RESOURCE and not meta.get("deletionTimestamp"):
            self._register_crd(obj)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._finalize(spec.group_resource, obj)
        return self.render(spec, obj)

    # -- status & scale ----------------------------------------------------------------------

    def set_status(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        status: Mapping[str, Any],
        *,
        merge: bool = True,
        manager: str = "kube-api-test",
    ) -> JsonObject:
        """Write ``status`` as a controller would (a merge patch of ``/status``, or a
        replacement of the whole status with ``merge=False``)."""
        old = self._existing(spec, namespace, name)
        candidate = copy.deepcopy(old)
        candidate["status"] = (
            patches.merge_patch(old.get("status") or {}, status) if merge else dict(status)
        )
        subresource = "status" if spec.status else ""
        return self._write(spec, old, candidate, Writer(manager), subresource=subresource)

    def get_scale(self, spec: ResourceSpec, namespace: str | None, name: str) -> JsonObject:
        if spec.scale is None:
            raise errors.no_route()
        obj = self._existing(spec, namespace, name)
        meta = obj["metadata"]
        replicas = objects.get_path(obj, spec.scale.spec_replicas_path)
        current = objects.get_path(obj, spec.scale.status_replicas_path)
        if spec.scale.selector_from_spec:
            selector = objects.label_selector_string(objects.get_path(obj, ".spec.selector"))
        elif spec.scale.label_selector_path:
            selector = objects.get_path(obj, spec.scale.label_selector_path) or ""
        else:
            selector = ""
        scale_meta = {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in meta
        }
        status: JsonObject = {"replicas": int(current or 0)}
        if selector:
            status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": scale_meta,
            "spec": {"replicas": int(replicas or 0)},
            "status": status,
        }

    def update_scale(
        self, spec: ResourceSpec, namespace: str | None, name: str, scale: Any, writer: Writer
    ) -> JsonObject:
        if spec.scale is None:
            raise errors.no_route()
        if not isinstance(scale, Mapping):
            raise errors.not_an_object("a Scale", scale)
        old = self._existing(spec, namespace, name)
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise errors.invalid(
                "autoscaling", "scales", name, f"spec.replicas: Invalid value: {replicas!r}"
            )
        candidate = copy.deepcopy(old)
        rv = (scale.get("metadata") or {}).get("resourceVersion")
        if rv:
            candidate["metadata"]["resourceVersion"] = rv
        objects.set_path(candidate, spec.scale.spec_replicas_path, replicas)
        self._write(spec, old, candidate, writer, subresource="scale")
        return self.get_scale(spec, namespace, name)

    def patch_scale(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        name: str,
        patch_type: str,
        patch: Any,
        writer: Writer,
    ) -> JsonObject:
        current = self.get_scale(spec, namespace, name)
        if patch_type == "application/json-patch+json":
            scale = patches.json_patch(current, patch)
        elif patch_type in PATCH_TYPES:
            scale = patches.merge_patch(current, patch)
        else:
            raise errors.unsupported_media_type(patch_type)
        return self.update_scale(spec, namespace, name, scale, writer)

    # -- deletion, finalizers, garbage collection --------------------------------------------

    def delete(
        self, spec: ResourceSpec, namespace: str | None, name: str, options: DeleteOptions
    ) -> tuple[JsonObject, int]:
        """Returns the response body and code: 200 with a Success Status when the object is
        gone, 202 with the object when finalizers (or its namespace's content) hold it."""
        obj = self._existing(spec, namespace, name)
        meta = obj["metadata"]
        if options.precondition_uid and options.precondition_uid != meta["uid"]:
            raise errors.conflict(
                spec.group,
                spec.plural,
                name,
                f"Precondition failed: UID in precondition: {options.precondition_uid}, "
                f"UID in object meta: {meta['uid']}",
            )
        if options.precondition_rv and options.precondition_rv != meta["resourceVersion"]:
            raise errors.conflict(
                spec.group,
                spec.plural,
                name,
                f"Precondition failed: ResourceVersion in precondition: "
                f"{options.precondition_rv}, ResourceVersion in object meta: "
                f"{meta['resourceVersion']}",
            )
        if options.dry_run:
            return self.render(spec, obj), 200
        if meta.get("deletionTimestamp"):
            return self.render(spec, obj), 202
        group_resource = spec.group_resource
        if options.propagation_policy == "Orphan":
            self._orphan_dependents(meta["uid"])
        finalizers = list(meta.get("finalizers") or ())
        dependents = self._dependents(meta["uid"])
        foreground = options.propagation_policy == "Foreground" and bool(dependents)
        if foreground:
            finalizers.append("foregroundDeletion")
        holds = bool(finalizers) or group_resource == NAMESPACES
        if not holds:
            self._finalize(group_resource, obj)
            return self._success(spec, obj), 200
        marked = copy.deepcopy(obj)
        marked_meta = marked["metadata"]
        marked_meta["deletionTimestamp"] = objects.timestamp()
        marked_meta["deletionGracePeriodSeconds"] = 0
        if finalizers:
            marked_meta["finalizers"] = finalizers
        if "generation" in marked_meta:
            marked_meta["generation"] += 1
        if group_resource == NAMESPACES:
            marked["status"] = {"phase": "Terminating"}
        rv = self.store.next_rv()
        marked_meta["resourceVersion"] = str(rv)
        self.store.put(group_resource, marked, rv)
        if foreground:
            for dep_resource, dependent in dependents:
                self._delete_object(dep_resource, dependent, "Foreground")
            self._maybe_release_foreground(marked_meta["uid"])
        if group_resource == NAMESPACES:
            for dep_resource, contained in list(self.store.everything()):
                if contained["metadata"].get("namespace") == name:
                    self._delete_object(dep_resource, contained, "Background")
            self._maybe_finish_namespace(name)
        current = self.store.get(group_resource, marked_meta.get("namespace"), name)
        if current is None or current["metadata"]["uid"] != marked_meta["uid"]:
            return self._success(spec, marked), 200
        return self.render(spec, current), 202

    def delete_collection(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        label_selector: str,
        field_selector: str,
        options: DeleteOptions,
    ) -> JsonObject:
        items, _ = self.list_objects(spec, namespace, label_selector, field_selector)
        deleted = []
        for item in items:
            meta = item["metadata"]
            try:
                body, _ = self.delete(spec, meta.get("namespace"), meta["name"], options)
            except errors.ApiError:
                continue
            deleted.append(item)
            del body
        return {
            "kind": spec.list_kind,
            "apiVersion": spec.api_version,
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": deleted,
        }

    def _success(self, spec: ResourceSpec, obj: JsonObject) -> JsonObject:
        details: JsonObject = {"name": obj["metadata"]["name"], "kind": spec.plural}
        if spec.group:
            details["group"] = spec.group
        details["uid"] = obj["metadata"]["uid"]
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": details,
        }

    def _delete_object(self, group_resource: GroupResource, obj: JsonObject, policy: str) -> None:
        """Delete on the server's own behalf (garbage collector, namespace controller)."""
        spec = self.registry.storage_spec(group_resource)
        if spec is None:
            return
        meta = obj["metadata"]
        current = self.store.get(group_resource, meta.get("namespace") or None, meta["name"])
        if current is None or current["metadata"]["uid"] != meta["uid"]:
            return
        self.delete(spec, meta.get("namespace"), meta["name"], DeleteOptions(policy))

    def _finalize(self, group_resource: GroupResource, obj: JsonObject) -> None:
        """Remove an object for good, then collect what depended on it."""
        meta = obj["metadata"]
        final = copy.deepcopy(obj)
        rv = self.store.next_rv()
        final["metadata"]["resourceVersion"] = str(rv)
        self.store.remove(group_resource, final, rv)
        self.managed.pop(meta["uid"], None)
        if group_resource == CRD_GROUP_RESOURCE:
            self._unregister_crd(final)
        for dep_resource, dependent in self._dependents(meta["uid"]):
            self._collect(dep_resource, dependent, meta["uid"])
        for ref in meta.get("ownerReferences") or ():
            self._maybe_release_foreground(str(ref.get("uid")))
        namespace = meta.get("namespace")
        if namespace:
            ns = self.store.get(NAMESPACES, None, namespace)
            if ns is not None and ns["metadata"].get("deletionTimestamp"):
                self._maybe_finish_namespace(namespace)

    def _dependents(self, uid: str) -> list[tuple[GroupResource, JsonObject]]:
        return [
            (group_resource, obj)
            for group_resource, obj in self.store.everything()
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())
        ]

    def _collect(
        self, group_resource: GroupResource, dependent: JsonObject, owner_uid: str
    ) -> None:
        """Background propagation: delete a dependent whose owners are all gone; only drop
        the dangling reference if it has another owner that still exists."""
        refs = dependent["metadata"].get("ownerReferences") or []
        alive = [
            r for r in refs if r.get("uid") != owner_uid and self.store.by_uid(str(r.get("uid")))
        ]
        if alive:
            self._drop_owner_reference(group_resource, dependent, owner_uid)
        else:
            self._delete_object(group_resource, dependent, "Background")

    def _drop_owner_reference(
        self, group_resource: GroupResource, obj: JsonObject, owner_uid: str
    ) -> None:
        spec = self.registry.storage_spec(group_resource)
        if spec is None:
            return
        candidate = copy.deepcopy(obj)
        refs = [
            r
            for r in candidate["metadata"].get("ownerReferences") or ()
            if r.get("uid") != owner_uid
        ]
        if refs:
            candidate["metadata"]["ownerReferences"] = refs
        else:
            candidate["metadata"].pop("ownerReferences", None)
        self._write(spec, obj, candidate, Writer("generic-garbage-collector"))

    def _orphan_dependents(self, uid: str) -> None:
        for group_resource, dependent in self._dependents(uid):
            self._drop_owner_reference(group_resource, dependent, uid)

    def _maybe_release_foreground(self, owner_uid: str) -> None:
        found = self.store.by_uid(owner_uid)
        if found is None:
            return
        group_resource, owner = found
        meta = owner["metadata"]
        if "foregroundDeletion" not in (meta.get("finalizers") or ()) or not meta.get(
            "deletionTimestamp"
        ):
            return
        if self._dependents(owner_uid):
            return
        spec = self.registry.storage_spec(group_resource)
        if spec is None:
            return
        candidate = copy.deepcopy(owner)
        candidate["metadata"]["finalizers"] = [
            f for f in meta.get("finalizers") or () if f != "foregroundDeletion"
        ]
        self._write(spec, owner, candidate, Writer("generic-garbage-collector"))

    def _maybe_finish_namespace(self, name: str) -> None:
        ns = self.store.get(NAMESPACES, None, name)
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if ns["metadata"].get("finalizers"):
            return
        for _, obj in self.store.everything():
            if obj["metadata"].get("namespace") == name:
                return
        self._finalize(NAMESPACES, ns)

    # -- CRDs --------------------------------------------------------------------------------

    def _register_crd(self, crd: JsonObject) -> None:
        name = crd["metadata"]["name"]
        previous = {s.group_resource for s in self.registry.remove_crd(name)}
        specs = specs_from_crd(crd)
        for spec in specs:
            self.registry.add(spec)
        for gone in previous - {s.group_resource for s in specs}:
            self._drop_resource(gone)

    def _unregister_crd(self, crd: JsonObject) -> None:
        for group_resource in {
            s.group_resource for s in self.registry.remove_crd(crd["metadata"]["name"])
        }:
            self._drop_resource(group_resource)

    def _drop_resource(self, group_resource: GroupResource) -> None:
        """A CRD is gone: so are its objects (finalizers or not), and its watches end."""
        for obj in self.store.items(group_resource):
            self._finalize(group_resource, obj)
        self.store.close_watchers(group_resource)
