"""``brook up -f MANIFEST``: an ``LLMInference`` run on this machine, with no cluster.

The engine configuration is the one the operator mounts into the pods (``to_engine_config``,
the same function), with only what differs outside a pod replaced: the model's folder on this
machine, the address the server listens on (loopback by default, where a pod listens on all
interfaces), the API key's source (a file or environment variable here, a Secret there) and,
when asked, the device (an NPU manifest tried on a laptop's CPU). ``brook-engine serve`` then
runs it as the pod's entry point would: every tensor × pipeline rank a local process, the
OpenAI API on the port, a graceful drain on SIGTERM or Ctrl-C. While it runs, a small file in
``local_server_dir()`` names it and its URL, for ``brook monitor --local``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType

from brook_engine.config import (
    MODEL_FILES,
    ApiKeyConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    dump_engine_config,
    split_model_uri,
)
from brook_operator.api import LLMInference, to_engine_config


@dataclass(frozen=True)
class LocalOptions:
    """What ``brook up`` changes of the pod's configuration (None: keep the manifest's)."""

    model: Path | None = None  # the model's folder here, where the manifest's URI is remote
    host: str = "127.0.0.1"
    port: int | None = None
    device: str | None = None
    api_key_file: str | None = None
    api_key_env: str | None = None


def cluster_only_notes(llmi: LLMInference, replicas_flag: int | None) -> list[str]:
    """What of ``llmi``'s spec a cluster applies and ``brook up`` does not, one line each,
    so that nothing the manifest asks for is dropped without a word."""
    spec = llmi.spec
    notes = []
    if spec.replicas and spec.replicas > 1 and replicas_flag is None:
        notes.append(f"spec.replicas is {spec.replicas}; `brook up` runs one replica here")
    if spec.replicas == 0 or spec.suspend:
        field, value = ("spec.suspend", "true") if spec.suspend else ("spec.replicas", "0")
        notes.append(
            f"{field}: {field} is {value}, so a cluster runs no replica; `brook up` runs one"
        )
    if spec.image is not None:
        notes.append(f"spec.image {spec.image} is the pods'; `brook up` runs this machine's engine")
    if spec.resources != type(spec.resources)():
        notes.append(
            "spec.resources (CPU and memory requests and limits) applies to the pods; "
            "`brook up` runs without limits"
        )
    if spec.scheduling != type(spec.scheduling)():
        notes.append("spec.scheduling (node selection, tolerations, gangs) is the cluster's")
    if spec.autoscaling is not None:
        notes.append("spec.autoscaling sizes a cluster's replicas; `brook up` runs one")
    if spec.router is not None:
        notes.append(
            "spec.router renders an InferencePool and HTTPRoute in a cluster; `brook up` "
            "serves directly, without a gateway"
        )
    if spec.model.cache is not None:
        notes.append(
            "spec.model.cache is a cluster volume; `brook up` uses --model FOLDER, or "
            "downloads an hf:// model into the Hugging Face cache"
        )
    if spec.pod is not None:
        notes.append(
            "spec.pod (environment, volumes, sidecars…) is added to the cluster's pods; "
            "`brook up` runs the engine as a process of this shell"
        )
    return notes


def fetch_model(llmi: LLMInference, options: LocalOptions) -> LocalOptions:
    """``options`` with the model's folder: an ``hf://`` model without ``--model`` is
    downloaded into the Hugging Face cache first (as the pod's init container downloads it;
    with progress bars; a second run finds it there). ``HF_TOKEN`` or ``hf auth login`` gives
    the token a pod reads from ``spec.model.credentialsSecretRef``; ``HF_ENDPOINT`` a mirror."""
    if options.model is not None:
        return options
    scheme, repo = split_model_uri(llmi.spec.model.uri)
    if scheme != "hf":
        return options
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            "spec.model.uri is an hf:// model: downloading it needs the engine's packages "
            "(pip install 'brook[engine]'), or give --model FOLDER"
        ) from None
    print(f"downloading {llmi.spec.model.uri} into the Hugging Face cache", file=sys.stderr)
    try:
        folder = snapshot_download(
            repo,
            revision=llmi.spec.model.revision,
            allow_patterns=list(llmi.spec.model.include or MODEL_FILES),
            ignore_patterns=list(llmi.spec.model.exclude) or None,
        )
    except Exception as exc:  # the hub client's errors have no common base but Exception
        hint = " (set HF_TOKEN for a gated or private model)" if "401" in str(exc) else ""
        raise ConfigError(
            f"spec.model.uri {llmi.spec.model.uri!r}: the download failed: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{hint}; "
            "or download it yourself and give --model FOLDER"
        ) from None
    return replace(options, model=Path(folder))


def local_engine_config(llmi: LLMInference, options: LocalOptions) -> EngineConfig:
    """The pod's ``EngineConfig`` of ``llmi`` for this machine (see the module docstring);
    a ``ConfigError`` naming the field and the flag that fixes it."""
    config = to_engine_config(llmi.spec)
    model = config.model
    if options.model is not None:
        folder = options.model.expanduser().resolve()
        model = ModelConfig.model_validate(
            {**model.model_dump(by_alias=False), "uri": f"file://{folder}"}
        )
    else:
        scheme, _ = split_model_uri(model.uri)
        if scheme != "file":
            raise ConfigError(
                f"spec.model.uri is {model.uri!r}: `brook up` runs a model from a folder on "
                "this machine (or downloads an hf:// one); download it and give --model FOLDER"
            )
    server = config.server.model_copy(update={"host": options.host})
    if options.port is not None:
        server = server.model_copy(update={"port": options.port})
    if options.api_key_file or options.api_key_env:
        key = ApiKeyConfig(file=options.api_key_file, env=options.api_key_env)
        server = server.model_copy(update={"api_key": key})
    elif llmi.spec.server.api_key_secret_ref is not None:
        raise ConfigError(
            "spec.server.apiKeySecretRef: the manifest requires an API key, which a pod reads "
            "from its Secret; give --api-key-file FILE or --api-key-env VARIABLE"
        )
    update: dict[str, object] = {"model": model, "server": server}
    if options.device is not None:
        update["device"] = options.device
    local = config.model_copy(update=update)
    # validate the whole as the engine will read it (the device, the model's folder)
    return EngineConfig.model_validate(local.model_dump(by_alias=False))


@dataclass(frozen=True)
class LocalServer:
    """A server ``brook up`` runs: what ``brook monitor --local`` needs to find it."""

    name: str
    url: str
    pid: int
    model: str
    started: float


def local_server_dir() -> Path:
    """Where running servers are listed: ``BROOK_LOCAL_DIR``, else the user's runtime
    folder (``XDG_RUNTIME_DIR``), else ``~/.cache``; a ``brook/up`` folder in it."""
    if override := os.environ.get("BROOK_LOCAL_DIR"):
        return Path(override)
    base = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".cache")
    return Path(base) / "brook" / "up"


def _alive(pid: int) -> bool | None:
    """True: running; False: gone; None: another user's process (not a server of ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return True


def _private(path: Path) -> bool:
    """Ours, and writable by no one else: another user cannot list a server of theirs."""
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _entry(path: Path) -> LocalServer | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        server = LocalServer(**data)
    except (OSError, ValueError, TypeError):
        return None  # half-written or foreign: not ours to judge
    typed = (
        isinstance(server.name, str)
        and isinstance(server.url, str)
        and isinstance(server.pid, int)
        and isinstance(server.model, str)
        and isinstance(server.started, int | float)
    )
    if not typed or not server.url.startswith("http://"):
        return None
    return server


def local_servers() -> list[LocalServer]:
    """The servers ``brook up`` runs now, oldest first (files of ended ones are removed).
    Only files this user owns, in a folder no one else may write, are read."""
    folder = local_server_dir()
    if not folder.is_dir() or not _private(folder):
        return []
    servers = []
    for path in sorted(folder.glob("*.json")):
        if not _private(path) or (server := _entry(path)) is None:
            continue
        alive = _alive(server.pid)
        if alive:
            servers.append(server)
        elif alive is False:
            path.unlink(missing_ok=True)
    return sorted(servers, key=lambda s: s.started)


def _listed(config: EngineConfig, name: str, pid: int) -> Path:
    server = config.server
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
    host = f"[{host}]" if ":" in host else host
    entry = LocalServer(
        name=name,
        url=f"http://{host}:{server.port}",
        pid=pid,
        model=config.model.served_name or config.model.uri,
        started=time.time(),
    )
    folder = local_server_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{pid}.json"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(json.dumps(asdict(entry)))
    return path


def run_local(
    config: EngineConfig, replicas: int | None, name: str = "local", stream_log: bool = True
) -> int:
    """Run ``config`` with ``brook-engine serve`` until it exits; SIGINT and SIGTERM reach it
    as SIGTERM (a graceful drain). Returns its exit status."""
    if replicas is not None and replicas != 1:
        raise ConfigError(
            f"--replicas {replicas}: `brook up` runs one replica; replicas on one machine "
            "would share its devices and cores and only split them (spec.replicas is for the "
            "cluster: `brook deploy` or kubectl apply)"
        )
    with tempfile.TemporaryDirectory(prefix="brook-up-") as folder:
        path = Path(folder) / "engine.yaml"
        path.write_text(dump_engine_config(config), encoding="utf-8")
        command = [sys.executable, "-m", "brook_engine.cli", "serve", "--config", str(path)]
        child = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        listed: Path | None = None
        try:
            listed = _listed(config, name, child.pid)
        except OSError as exc:  # serving matters more than being listed
            print(
                f"warning: `brook monitor --local` will not find this server: {exc}",
                file=sys.stderr,
            )

        def forward(signum: int, frame: FrameType | None) -> None:
            del signum, frame
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)  # the engine drains, then exits

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return child.wait()
        finally:
            if listed is not None:
                listed.unlink(missing_ok=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
