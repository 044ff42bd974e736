"""A rank's KV calibration kept in ``shapes.cacheDir``, so a replica that starts again with
the same weights, calibration text and policy reuses the outcome instead of measuring every
layer again (the largest share of a warm start on CPU).

The key holds everything the outcome depends on: a fingerprint of the weights (each file's
size and header, and 64 KiB of its data every 16 MiB: two checkpoints that differ anywhere
differ there, at a cost of milliseconds instead of reading them whole), the calibration
tokens, this rank's layers and heads (tensor rank, pipeline stage), the policy and the
dynamic-precision settings, the model length the positions are drawn from, the dtype, the
device type, Brook's and torch's versions. A file that does not load is measured again and
replaced."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import xxhash

from brook_engine.kv.cache import Int8Params
from brook_engine.kv.calibration import Calibration

log = logging.getLogger(__name__)

#: The folder of ``shapes.cacheDir`` the outcomes are kept in.
STORE_FOLDER = "kv-calibration"
_SAMPLE = 64 << 10
_STRIDE = 16 << 20


def weights_fingerprint(folder: Path) -> str:
    """The model folder's weights and configuration, sampled (see the module docstring)."""
    digest = xxhash.xxh3_128()
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as file:
            header = int.from_bytes(file.read(8), "little")
            digest.update(file.read(min(header, 64 << 20)))
            for offset in range(8 + header, size, _STRIDE):
                file.seek(offset)
                digest.update(file.read(_SAMPLE))
            file.seek(max(0, size - _SAMPLE))
            digest.update(file.read(_SAMPLE))
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class CalibrationStore:
    path: Path
    facts: dict[str, Any]

    @classmethod
    def at(cls, cache_dir: str | Path, facts: dict[str, Any]) -> CalibrationStore:
        key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]
        return cls(Path(cache_dir) / STORE_FOLDER / f"{key}.pt", facts)

    def load(self, device: torch.device) -> Calibration | None:
        if not self.path.is_file():
            return None
        try:
            data = torch.load(self.path, map_location="cpu", weights_only=True)
            if data.get("facts") != self.facts:
                raise ValueError("the facts it was kept for differ")
            int8 = [
                None if d is None else Int8Params(**{k: t.to(device) for k, t in d.items()})
                for d in data["int8"]
            ]
            return Calibration(
                policy=list(data["policy"]),
                chosen=list(data["chosen"]),
                errors=list(data["errors"]),
                shifts=[None if s is None else s.to(device) for s in data["shifts"]],
                int8=int8,
                num_tokens=int(data["num_tokens"]),
            )
        except Exception as exc:  # anything unreadable is measured again and replaced
            log.warning("KV calibration in %s not reused (%s): measuring again", self.path, exc)
            return None

    def save(self, calibration: Calibration) -> None:
        data = {
            "facts": self.facts,
            "policy": list(calibration.policy),
            "chosen": list(calibration.chosen),
            "errors": list(calibration.errors),
            "shifts": [None if s is None else s.detach().cpu() for s in calibration.shifts],
            "int8": [
                None
                if p is None
                else {f.name: getattr(p, f.name).detach().cpu() for f in dataclasses.fields(p)}
                for p in calibration.int8
            ],
            "num_tokens": calibration.num_tokens,
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(data, partial)
            os.replace(partial, self.path)  # whole or absent, with other ranks writing theirs
        except OSError as exc:
            log.warning("KV calibration not kept in %s: %s", self.path, exc)


def store_facts(**facts: Any) -> dict[str, Any]:
    """The facts a store is keyed on, with Brook's and torch's versions and a digest of the
    calibration's code (a change to it measures again, a version bump or not)."""
    try:
        brook = importlib.metadata.version("brook")
    except importlib.metadata.PackageNotFoundError:
        brook = "unknown"
    here = Path(__file__).parent
    code = hashlib.sha256()
    for name in ("calibration.py", "cache.py", "calibration_store.py"):
        code.update((here / name).read_bytes())
    return {**facts, "brook": brook, "torch": str(torch.__version__), "code": code.hexdigest()[:16]}
