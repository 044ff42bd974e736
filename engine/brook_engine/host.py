"""The host CPU's features, read from ``/proc/cpuinfo`` (torch-free, so the memory plan and
the configuration checks can ask too)."""

from __future__ import annotations

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
