"""The host CPU's features, read from ``/proc/cpuinfo`` (torch-free, so the memory plan and
the configuration checks can ask too)."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    features = cpu_features()
    return "avx512_bf16" in features or "amx_bf16" in features


@functools.cache
def process_started() -> float:
    """When this process started (seconds since the epoch, ``time.time()``'s clock), from
    ``/proc/self/stat``; the time this module was first imported where that is unknown.
    Read once: ``/proc/uptime`` has centisecond steps, and figures must not jitter."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (field 22)
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()
