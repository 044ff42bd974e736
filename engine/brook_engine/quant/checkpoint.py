"""W8A16 checkpoints in the format of the ``compressed-tensors`` library (what llm-compressor
writes and vLLM loads), read and written without it.

A quantized folder says so in ``config.json``'s ``quantization_config``
(``quant_method: compressed-tensors``). Brook reads and writes int8 weights, symmetric, one
scale per output channel (``strategy: channel``) or per output channel and group of input
channels (``strategy: group`` with ``group_size``, llm-compressor's W8A16 preset), float
activations, in two of the library's formats:

- ``pack-quantized`` (what Brook writes; llm-compressor's choice for integer weights): per
  layer ``weight_packed`` int32 [out, ceil(in / 4)] — four weights per word, each stored as
  ``q + 128`` in 8 bits, the first in the lowest byte — ``weight_scale`` [out, 1] in the
  model dtype and ``weight_shape`` int [2];
- ``int-quantized`` / ``naive-quantized``: ``weight`` int8 [out, in] and ``weight_scale``.

Layers named in ``ignore`` (the LM head, by default) keep their float ``weight``. Anything
else — asymmetric zero points, other bit widths, quantized activations — is
refused with the field that says so, never loaded as something it is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from brook_engine.config import ConfigError

QUANT_METHOD = "compressed-tensors"
READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
WRITE_FORMAT = "pack-quantized"
FORMAT_VERSION = "0.20.1"  # the compressed-tensors release whose format Brook writes
#: the tensors of a quantized layer, by suffix, and which part of its weight each is
PARTS = {
    "weight_packed": "packed",
    "weight_scale": "scale",
    "weight_shape": "shape",
    "weight_zero_point": "zero_point",
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a compressed-tensors folder holds: its format and the layers left in float."""

    format: str
    ignore: tuple[str, ...]
    group_size: int | None  # None: one scale per output channel

    @property
    def scheme(self) -> str:
        return "w8a16"


def read_quantization(folder: Path) -> CheckpointQuantization | None:
    """The folder's W8A16 description, None for a float checkpoint; a ``ConfigError``
    naming the field for a quantization Brook does not run."""
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the model loader reports a missing or broken config.json
    block = config.get("quantization_config") or config.get("compression_config")
    if block is None:
        return None
    where = f"{config_path}: quantization_config"
    method = block.get("quant_method")
    if method != QUANT_METHOD:
        raise ConfigError(
            f"{where}.quant_method is {method!r}; Brook reads W8A16 checkpoints in the "
            f"{QUANT_METHOD} format (llm-compressor) — quantize the float model with "
            "`brook-engine convert MODEL --quantize w8a16` instead"
        )
    fmt = block.get("format")
    if fmt not in READ_FORMATS:
        raise ConfigError(f"{where}.format is {fmt!r}; Brook reads {', '.join(READ_FORMATS)}")
    groups = block.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(
            f"{where}.config_groups has {len(groups)} groups; Brook reads one W8A16 group "
            "(every quantized layer alike)"
        )
    ((name, group),) = groups.items()
    group_size = _check_group(f"{where}.config_groups.{name}", group)
    status = block.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"{where}.quantization_status is {status!r}; expected 'compressed'")
    return CheckpointQuantization(fmt, tuple(block.get("ignore") or ()), group_size)


def _check_group(where: str, group: dict[str, Any]) -> int | None:
    """The group's group size (None: per channel), or a ``ConfigError``."""
    weights = group.get("weights") or {}
    expected = {"num_bits": 8, "type": "int", "symmetric": True}
    for key, value in expected.items():
        if weights.get(key) != value:
            raise ConfigError(
                f"{where}.weights.{key} is {weights.get(key)!r}; Brook's W8A16 runs "
                f"{key}={value!r} (int8, symmetric)"
            )
    strategy, size = weights.get("strategy"), weights.get("group_size")
    if strategy not in ("channel", "group"):
        raise ConfigError(
            f"{where}.weights.strategy is {strategy!r}; Brook's W8A16 runs 'channel' (a "
            "scale per output channel) or 'group' (per channel and group of input channels)"
        )
    if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % 32):
        raise ConfigError(
            f"{where}.weights.group_size is {size!r}; a group strategy needs a positive "
            "multiple of 32"
        )
    if weights.get("actorder"):
        raise ConfigError(
            f"{where}.weights.actorder is {weights.get('actorder')!r}; Brook reads groups in "
            "input-channel order (actorder null)"
        )
    if weights.get("dynamic"):
        raise ConfigError(f"{where}.weights.dynamic is true; W8A16 weights are static")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise ConfigError(
                f"{where}.{key} is set; W8A16 keeps activations in float — Brook does not "
                "run quantized activations"
            )
    return size if strategy == "group" else None


def unpack_int8(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """int8 [rows, columns] from ``weight_packed`` int32 [rows, ceil(columns / 4)]."""
    if packed.dtype != torch.int32:
        raise ConfigError(f"weight_packed must be int32, not {packed.dtype}")
    stored = packed.contiguous().view(torch.uint8)  # little-endian: the lowest byte first
    if stored.shape[1] < columns:
        raise ConfigError(
            f"weight_packed holds {stored.shape[1]} values per row; weight_shape says {columns}"
        )
    return (stored[:, :columns] ^ 0x80).view(torch.int8)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """``weight_packed`` int32 [rows, ceil(columns / 4)] of int8 ``q`` [rows, columns]."""
    rows, columns = q.shape
    padded = -(-columns // 4) * 4
    stored = torch.zeros((rows, padded), dtype=torch.uint8)  # zero bytes pad, as the library
    stored[:, :columns] = q.contiguous().view(torch.uint8) ^ 0x80
    return stored.view(torch.int32)


def quantization_config(ignore: list[str], group_size: int | None) -> dict[str, Any]:
    """The ``quantization_config`` block Brook writes (llm-compressor's W8A16, with one scale
    per output channel or per channel and group)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": WRITE_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel" if group_size is None else "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "observer": "minmax",
                    "actorder": None,
                    "block_structure": None,
                    "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
                "format": WRITE_FORMAT,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": FORMAT_VERSION,
    }
