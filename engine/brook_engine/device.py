"""The compute backend: NPU (torch-npu, HCCL), CUDA (NCCL) or CPU (gloo).

torch_npu is imported only when the NPU is asked for (or probed by ``auto``): importing it
without Ascend's CANN toolkit fails, and it must never be a CPU install's dependency. Every
code path above this module is device-neutral, so the CPU runs the same code as the NPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from brook_engine.config import CPU_KV_CACHE_CAP, ConfigError, DeviceKind
from brook_engine.host import cpu_has_native_bf16

_side_streams: dict[torch.device, Any] = {}


class DeviceError(RuntimeError):
    """The requested device is not present or its runtime fails to load."""


#: ``model.dtype`` names and the torch dtypes they stand for.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Backend:
    kind: str  # "npu" | "cuda" | "cpu"
    device: torch.device
    dist_backend: str  # torch.distributed backend of this device

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.kind == "npu":
            torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def synchronize_stream(self) -> None:
        """Wait for the compute stream only (not for communication on other streams)."""
        if self.kind == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        elif self.kind == "npu":
            torch.npu.current_stream(self.device).synchronize()  # type: ignore[attr-defined]

    def wait_work(self, work: Any) -> None:
        """Block the calling thread until a collective's work has completed. On CPU (gloo)
        ``wait`` does that; on NCCL/HCCL it only makes the current stream wait, so the
        calling (communication) thread waits on a side stream of its own."""
        if self.kind == "cpu":
            work.wait()
            return
        module = torch.cuda if self.kind == "cuda" else torch.npu  # type: ignore[attr-defined]
        stream = _side_streams.setdefault(self.device, module.Stream(self.device))
        with module.stream(stream):
            work.wait()
        stream.synchronize()

    def model_dtype(self, name: str) -> torch.dtype:
        """The dtype ``model.dtype`` names (``auto``: ``default_dtype``)."""
        return self.default_dtype() if name == "auto" else DTYPES[name]

    def default_dtype(self) -> torch.dtype:
        """bfloat16 where the hardware computes in it natively (accelerators, CPUs with
        AVX512-BF16 or AMX); float32 on other CPUs, where bfloat16 is emulated and slow."""
        if self.kind == "cpu" and not cpu_has_native_bf16():
            return torch.float32
        return torch.bfloat16

    def kv_cache_budget(self) -> int:
        """Bytes the KV cache may be sized from (before ``kvCache.memoryFraction``). On CPU
        host memory is shared with everything else, so at most 4 GiB unless ``numBlocks``
        says otherwise (as vLLM's CPU backend does)."""
        free, _ = self.memory()
        return min(free, CPU_KV_CACHE_CAP) if self.kind == "cpu" else free

    def peak_allocated(self) -> int | None:
        """Peak bytes the device allocator handed out; None on CPU (no allocator stats)."""
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "npu":
            return int(torch.npu.max_memory_allocated(self.device))  # type: ignore[attr-defined]
        return None

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device memory the KV cache can come from."""
        if self.kind == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free), int(total)
        if self.kind == "npu":
            free, total = torch.npu.mem_get_info(self.device)  # type: ignore[attr-defined]
            return int(free), int(total)
        return _host_memory()


def _host_memory() -> tuple[int, int]:
    fields: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", fields.get("MemFree", 0)), fields.get("MemTotal", 0)


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install raises all sorts
        raise DeviceError(f"torch_npu is installed but fails to load: {exc}") from exc
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def device_kind(kind: DeviceKind) -> DeviceKind:
    """The kind ``auto`` stands for here (NPU, then CUDA, then CPU), without opening a
    device; any other kind as it is."""
    if kind != "auto":
        return kind
    if os.environ.get("BROOK_PROBE_NPU", "1") != "0" and importlib.util.find_spec("torch_npu"):
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_backend(kind: DeviceKind, local_rank: int = 0) -> Backend:
    """The backend for ``kind``; ``auto`` takes NPU, then CUDA, then CPU."""
    kind = device_kind(kind)
    if kind == "cpu":
        return Backend("cpu", torch.device("cpu"), "gloo")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("device: cuda was asked for but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return Backend("cuda", torch.device("cuda", local_rank), "nccl")
    if kind == "npu":
        if not _npu_available():
            raise DeviceError(
                "device: npu was asked for but torch_npu is not installed or sees no NPU; "
                "install brook[npu] with Ascend's CANN toolkit"
            )
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return Backend("npu", torch.device("npu", local_rank), "hccl")
    raise ConfigError(f"device: unknown kind {kind!r}")
