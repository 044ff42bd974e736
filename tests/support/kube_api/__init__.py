"""An emulated kube-apiserver for integration tests, built on kmock.

It runs on 127.0.0.1 (a free port) on a background thread with its own event loop, so a
kopf operator (``kopf.testing.KopfRunner`` in the test process, or ``kopf run`` as a
subprocess), the sync ``kubernetes`` client and ``kubectl`` subprocesses can all use it at
once, through a plain-http kubeconfig without credentials.

It is an API server only: NO controllers run and NO pods are scheduled. Nothing creates
ReplicaSets or Pods for a Deployment, nothing sets a Deployment's ``readyReplicas``, no
kubelet, no scheduler, no service endpoints, no HPA, no admission webhooks, no
authentication or authorization (every request is allowed; the RBAC attributes each would
need are recorded instead). Tests play the controllers' part with :meth:`KubeApi.set_status`.
The only "controllers" built in are those the API semantics need: the garbage collector
(synchronous), namespace termination, and CRD registration. The pods ``proxy`` subresource
forwards to ``status.podIP``, which tests set (e.g. 127.0.0.1, where their server listens).

Fixtures (``tests/integration/operator/conftest.py``)
-----------------------------------------------------

``kube_api -> KubeApi``
    A fresh server per test. ``KUBECONFIG`` (and the ``kubernetes`` package's default
    kubeconfig location and default configuration) point at it for the test's duration, so
    ``kopf``'s default login, ``kubernetes.config.load_kube_config()`` and ``kubectl`` all
    find it. The test fails at teardown if the server hit an internal error (a bug here).
``brook_crd -> dict``
    ``kube_api`` with the project's ``crds/llminference.yaml`` installed; the stored CRD.

``KubeApi``
-----------

* ``url: str``, ``kubeconfig: Path``, ``cache_dir: Path`` (kubectl's discovery cache).
  ``write_kubeconfig(path, url)`` writes another kubeconfig (e.g. for a subprocess).
  ``KubeApi.running(workdir, bookmark_interval=None)`` is the context manager behind the
  fixture (for other fixtures or scopes).
* ``requests: list[RecordedRequest]`` -- every request so far: ``method``, ``path``,
  ``query``, ``user_agent``, ``content_type``, ``body``, ``verb``, ``api_group``,
  ``resource`` (with the subresource: ``"llminferences/status"``), ``namespace``, ``name``,
  ``status`` (the response code) and ``rbac``: the :class:`RbacAttributes` checks
  ``(verb, api_group, resource, namespace)`` the real server would make (an apply that
  creates needs ``patch`` and ``create``). ``clear_requests()``; ``rbac(user_agent="kopf")``
  collects the checks of one client; :func:`requests_matching` filters.
* State helpers (no HTTP, not recorded; they return copies, never the stored objects;
  resources are named as kubectl names them:
  ``"deployments"``, ``"deploy"``, ``"llmi"``, ``"leases.coordination.k8s.io"``):
  ``get(resource, name, namespace=None) -> dict | None``,
  ``list(resource, namespace=None, *, label_selector="") -> list[dict]``,
  ``create(obj, namespace=None)``, ``apply(obj, namespace=None, *, manager, force=True)``
  (server-side apply), ``load(path, namespace=None)`` (apply every YAML document),
  ``create_namespace(name)``, ``delete(resource, name, namespace=None, *,
  propagation_policy="Background")``,
  ``set_status(resource, name, status, namespace=None, *, merge=True)`` (as a controller
  writing ``/status``), ``compact()`` (resuming watches then get 410 Gone),
  ``resource_version``.
* ``kubectl(*args, input=None, check=True, timeout=60) -> CompletedProcess[str]``;
  ``client()`` -> a ``kubernetes.client.ApiClient``; ``wait_for(condition, timeout=10)``.
* Faults (:mod:`.faults`): ``inject(verb=, resource=, namespace=, name=, user_agent=,
  status=, retry_after=, hang=, delay=, times=) -> Fault`` answers the matching requests
  with an error Status (429 with ``Retry-After``, 500, 503, 409 ...), or holds them
  unanswered for ``hang`` seconds and drops the connection, before anything else answers;
  ``Fault.hits`` counts them; ``clear_faults()``. ``drop_watches(resource=None)`` ends the
  open watch streams, as an API server restart does.
* ``handler``: the kmock handler. Reactions added with kmock's DSL answer before the
  emulation (fault injection), e.g. ``api.handler[kmock.method.PATCH,
  kmock.resource("apps", "v1", "deployments")] << 500`` (``[:1] << 500`` for one request
  only; ``<< errors.conflict(...)`` or any :class:`.errors.ApiError` answers its Status).
  The emulated state is not changed by requests a reaction answered. ``clear_reactions()``
  removes them all.
* :class:`PodServer` (:mod:`.pod_server`): a pod's container port on 127.0.0.1 for the pod
  proxy to reach (``pod.port``, ``pod.answer(path, text, status=, content_type=)``,
  ``pod.requests``); create the Pod, then ``set_status("pods", name, {"podIP":
  "127.0.0.1"}, namespace)``.
* :mod:`.crds`: stand-in CRDs (``leaderworkerset_crd()``, ``volcano_podgroup_crd()``,
  ``minimal_crd(...)``) to install with ``create()`` or leave out.

What is emulated
----------------

* Discovery (legacy, unaggregated) with correct ``groupVersion``, verbs, namespaced flags,
  short names, categories and the ``status``/``scale`` subresources; ``/version``; OpenAPI
  v3 documents good enough for kubectl to validate server-side (``kubectl apply``/
  ``create`` work without ``--validate=false``). ``/openapi/v2`` is 404.
* Built-ins: namespaces, configmaps, secrets, serviceaccounts, services, pods, events,
  persistentvolumeclaims, nodes (core/v1); deployments, statefulsets, replicasets (apps/v1);
  poddisruptionbudgets (policy/v1); networkpolicies (networking.k8s.io/v1);
  customresourcedefinitions (apiextensions.k8s.io/v1); events (events.k8s.io/v1); leases
  (coordination.k8s.io/v1); horizontalpodautoscalers (autoscaling/v2); roles,
  rolebindings, clusterroles, clusterrolebindings (rbac/v1). Namespaces default,
  kube-system, kube-public and kube-node-lease exist.
* CRDs: creating/applying one registers its served versions (names, short names,
  categories, scope, status and scale subresources, printer columns, schema) at once and
  sets its Established/NamesAccepted conditions; deleting it removes them and its objects.
* Objects: uid, resourceVersion (one global counter), generation (1; +1 when anything but
  metadata -- and status, where a status subresource exists -- changes; +1 when deletion
  starts), creationTimestamp, managedFields; namespace from the URL; 201 on create; Status
  errors (404 NotFound, 409 AlreadyExists/Conflict, 422 Invalid, 400, 403, 405, 410, 415);
  optimistic concurrency (stale resourceVersion → 409); PUT replaces (custom resources
  require a resourceVersion); no-op writes keep the resourceVersion and send no event; the
  four patch types (see :mod:`.patches`, :mod:`.apply`); ``dryRun=All``; status/spec
  separation; the scale subresource (autoscaling/v1 Scale) from the CRD paths;
  structural pruning and defaulting of custom resources (:mod:`.schema`); a few built-in
  defaults (workload replicas 1, Service type and clusterIP, Namespace phase).
* Lists: label selectors, field selectors (:mod:`.selectors`), ``limit``/``continue``,
  cluster-wide lists; Tables for kubectl (:mod:`.tables`).
* Watches: ADDED/MODIFIED/DELETED from a resourceVersion (410 Gone once compacted),
  synthetic ADDED without one, selectors (objects entering/leaving them are ADDED/DELETED),
  ``timeoutSeconds``, ``sendInitialEvents`` and BOOKMARKs when allowed.
* Deletion: finalizers and ``deletionTimestamp`` (202 while held, no new finalizers),
  preconditions, garbage collection by ownerReferences (Background, Foreground, Orphan),
  namespace termination deleting the namespace's objects.
* Pod proxy (:mod:`.proxy`): ``/api/v1/namespaces/{ns}/pods/{name[:port]}/proxy/{path}``
  (``kubectl get --raw``) forwards method, query, body, Content-Type and Accept to
  ``http://{status.podIP}:{port}/{path}`` and answers with the pod's status, body and
  Content-Type; 400 "address not allowed" without a pod IP, 503 "error trying to reach
  service: ..." when nothing answers (10 s); RBAC ``get``/``create`` on ``pods/proxy``.

What is not (or only approximately)
-----------------------------------

No validation (schemas, CEL, required fields, built-in types); no conversion between
versions (only ``apiVersion`` is rewritten); strategic merge patch and server-side apply
are approximations (lists merge by a fixed table of field names; applied lists are atomic,
except custom resources' ``x-kubernetes-list-type: map`` lists, merged item by item);
paginated lists are not a consistent snapshot; the garbage collector acts synchronously
within the deleting request (real ones act a moment later); deleting a CRD drops its
objects at once, finalizers or not; no aggregated discovery, no protobuf (except what
``kubectl create namespace|configmap|secret|serviceaccount`` sends, see :mod:`.protobuf`;
other typed ``kubectl create <kind>`` commands get a 415) and no CBOR, no
``/openapi/v2``, no ``kubectl explain`` for built-ins, no exec/logs/port-forward, no
services/nodes proxy, no https to pods and loopback pod IPs allowed (for tests), no
admission, no resource quotas, no leader election semantics beyond plain Lease objects.
"""

from .crds import leaderworkerset_crd, minimal_crd, volcano_podgroup_crd
from .kubeconfig import write as write_kubeconfig
from .pod_server import PROMETHEUS_TEXT, PodServer
from .records import RbacAttributes, RecordedRequest
from .server import KubeApi, KubeApiServer, requests_matching

__all__ = [
    "PROMETHEUS_TEXT",
    "KubeApi",
    "KubeApiServer",
    "PodServer",
    "RbacAttributes",
    "RecordedRequest",
    "leaderworkerset_crd",
    "minimal_crd",
    "requests_matching",
    "volcano_podgroup_crd",
    "write_kubeconfig",
]
