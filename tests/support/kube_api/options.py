"""What a write request says besides its body: who writes (field manager, dry run, force)
and how to delete (DeleteOptions from the body or the query)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import errors

PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)


@dataclass(frozen=True)
class Writer:
    """Who writes and how: the field manager, ``dryRun=All``, ``force`` (apply only)."""

    manager: str
    dry_run: bool = False
    force: bool = False


SERVER = Writer("kube-apiserver")


@dataclass(frozen=True)
class DeleteOptions:
    propagation_policy: str = "Background"
    precondition_uid: str | None = None
    precondition_rv: str | None = None
    dry_run: bool = False

    @classmethod
    def parse(cls, body: Any, query: Mapping[str, str]) -> DeleteOptions:
        if body is not None and not isinstance(body, Mapping):
            raise errors.not_an_object("DeleteOptions", body)
        options = body if isinstance(body, Mapping) else {}
        policy = query.get("propagationPolicy") or options.get("propagationPolicy")
        orphan = query.get("orphanDependents") or options.get("orphanDependents")
        if policy is None:
            policy = "Orphan" if str(orphan).lower() == "true" else "Background"
        if policy not in ("Background", "Foreground", "Orphan"):
            raise errors.bad_request(f"invalid propagationPolicy: {policy!r}")
        preconditions = options.get("preconditions") or {}
        dry_run = query.get("dryRun") == "All" or "All" in (options.get("dryRun") or [])
        return cls(policy, preconditions.get("uid"), preconditions.get("resourceVersion"), dry_run)
