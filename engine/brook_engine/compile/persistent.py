"""The persistent compile cache (``shapes.cacheDir``): the compiler's artifacts kept across
processes, so a new replica loads its graphs instead of compiling them.

Each engine uses one folder under ``cacheDir``, named by a digest of what its graphs depend
on (the layer's sizes, dtype and device, Brook's and PyTorch's versions, the CPU's vector
flags) and holding a manifest of those facts. Inductor's own caches (FX graphs, AOT
autograd, generated C++/Triton kernels) live inside it. A folder whose manifest is missing,
unreadable or names other facts is stale: it is emptied with a warning, never trusted.
Folders of other models or versions are left alone (a volume can serve several).
Without ``cacheDir`` the engine compiles into a private temporary folder that goes with the
process, so nothing persists and nothing foreign is read.

The folder must be writable by the engine's user only: compiled artifacts are code.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from brook_engine.host import cpu_features

log = logging.getLogger(__name__)

MANIFEST = "brook-compile-cache.json"
_ENV = "TORCHINDUCTOR_CACHE_DIR"
_private: Path | None = None


def cache_facts(graph_facts: dict[str, Any]) -> dict[str, Any]:
    """What compiled graphs depend on beyond the graph itself."""
    facts: dict[str, Any] = {
        "brook": _brook_version(),
        "graph_code": _graph_code_digest(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "graph": graph_facts,
    }
    if graph_facts.get("device") == "cpu":
        facts["cpu_flags"] = sorted(cpu_features())
        facts["cpu_isa"] = os.environ.get("BROOK_CPU_ISA", "")
    return facts


def _brook_version() -> str:
    try:
        return importlib.metadata.version("brook")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _graph_code_digest() -> str:
    """A digest of the code a layer graph is traced from: a change to it is a new cache."""
    here = Path(__file__).parent
    layers = here.parent / "layers"
    digest = hashlib.sha256()
    for path in (here / "layer_graph.py", here / "ops.py", layers / "cpu_fused.py",
                 layers / "rotary.py"):  # fmt: skip
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(facts: dict[str, Any]) -> str:
    text = json.dumps(facts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def use_cache_dir(cache_dir: str | Path | None, graph_facts: dict[str, Any]) -> Path:
    """Point the compiler's caches at this engine's folder of ``cache_dir`` (made and
    checked) or, without one, at a private folder removed at exit; returns the folder."""
    if cache_dir is None:
        folder = _private_dir()
    else:
        facts = cache_facts(graph_facts)
        folder = Path(cache_dir) / cache_key(facts)
        _check_folder(folder, facts)
        others = [p.name for p in Path(cache_dir).iterdir() if p.is_dir() and p != folder]
        if others:
            log.info(
                "compile cache %s: %d folder(s) of other models or versions left alone",
                cache_dir,
                len(others),
            )
    os.environ[_ENV] = str(folder / "inductor")
    return folder


def _check_folder(folder: Path, facts: dict[str, Any]) -> None:
    manifest = folder / MANIFEST
    if folder.exists():
        try:
            found = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            found, reason = None, f"its manifest is unreadable ({exc.__class__.__name__})"
        else:
            reason = "its manifest names other versions or sizes"
        if found == facts:
            return
        log.warning("compile cache %s ignored and emptied: %s", folder, reason)
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(facts, indent=2, sort_keys=True), encoding="utf-8")


def _private_dir() -> Path:
    global _private
    if _private is None:
        _private = Path(tempfile.mkdtemp(prefix="brook-compile-"))
        atexit.register(shutil.rmtree, _private, ignore_errors=True)
    return _private
