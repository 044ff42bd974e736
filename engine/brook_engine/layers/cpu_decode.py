"""Decode attention on CPU by a small C kernel (``csrc/paged_decode.c``): one query per
sequence, keys and values read in place from the paged cache in whatever type they are
stored, so a step neither gathers the context into a padded copy nor widens it first.

The batched-matmul path in ``attention.py`` stays the portable one (and the reference the
kernel is tested against); on CPU the kernel replaces it when a C compiler is available. It
is built at first use with the machine's ``cc`` (``-O3 -march=native -fopenmp``, about a
second) into a cache directory keyed by the source, the compiler and the CPU, and loaded with
ctypes; the OpenMP runtime it links against is the one torch has already loaded. Where no
compiler is installed (the engine image), a copy built for a baseline CPU when the package
was installed (``python -m brook_engine.layers.cpu_decode --prebuild``) is loaded if this
CPU has what it was built for. Without either, or with ``BROOK_CPU_KERNELS=off`` (which
also keeps linear weights plain), the portable path runs and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from brook_engine.kv_cache import LayerKVCache

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# No -ffast-math: the kernel writes out the one function (exp) that needed it to vectorize.
_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
_KINDS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int8: 3,
    torch.float8_e5m2: 4,
    torch.float8_e4m3fn: 4,
}
_LUT8 = 4
# A copy built ahead for any CPU of a baseline: its flags and the CPU features it needs.
_BASELINES: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "x86_64": (("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2"})),
    "aarch64": ((), frozenset()),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_luts: dict[torch.dtype, torch.Tensor] = {}


def kernel_enabled() -> bool:
    """Whether decode attention on CPU runs the C kernel (building it on the first call)."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _build_and_open()
            finally:
                _tried = True
    return _library


def _build_and_open() -> ctypes.CDLL | None:
    if os.environ.get("BROOK_CPU_KERNELS", "").lower() == "off":
        logger.info("CPU decode attention: portable path (BROOK_CPU_KERNELS=off)")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        prebuilt = _open_prebuilt()
        if prebuilt is None:
            logger.warning(
                "CPU decode attention: no C compiler (cc) found and no prebuilt kernel for "
                "this CPU, running the portable path (slower for batched decode); install "
                "gcc or set CC to enable the kernel"
            )
        return prebuilt
    source = _SOURCE.read_bytes()
    errors: list[str] = []
    for arch in (("-march=native",), ()):  # -march=native is unknown to some compilers
        flags = (*_FLAGS, *arch)
        target = _cache_dir() / f"paged_decode-{_key(compiler, flags, source)}.so"
        if not target.exists():
            error = _compile(compiler, flags, target)
            if error is not None:
                errors.append(error)
                continue
        try:
            library = ctypes.CDLL(str(target))
        except OSError as exc:
            errors.append(str(exc))
            continue
        _declare(library)
        logger.info("CPU decode attention: C kernel %s", target.name)
        return library
    prebuilt = _open_prebuilt()
    if prebuilt is None:
        logger.warning(
            "CPU decode attention: the C kernel did not build, running the portable path: %s",
            errors[-1][-2000:] if errors else "unknown error",
        )
    return prebuilt


def prebuilt_path() -> Path:
    return _SOURCE.with_name(f"paged_decode.{platform.machine()}.so")


def _open_prebuilt() -> ctypes.CDLL | None:
    """The copy built ahead for a baseline CPU, when it is there and this CPU has the
    baseline's features (a missing instruction would kill the process, not raise)."""
    path = prebuilt_path()
    baseline = _BASELINES.get(platform.machine())
    if baseline is None or not path.is_file() or not baseline[1] <= _cpu_features():
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("CPU decode attention: %s does not load: %s", path.name, exc)
        return None
    _declare(library)
    logger.info("CPU decode attention: prebuilt C kernel %s", path.name)
    return library


def _cpu_features() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def prebuild() -> Path:
    """Build the baseline copy next to the source (at image build time, where a compiler
    is installed and the CPU that will run it is not known)."""
    baseline = _BASELINES.get(platform.machine())
    if baseline is None:
        raise RuntimeError(f"no baseline CPU is defined for {platform.machine()}")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    target = prebuilt_path()
    error = _compile(compiler, (*_FLAGS, *baseline[0]), target)
    if error is not None:
        raise RuntimeError(error)
    return target


def _key(compiler: str, flags: tuple[str, ...], source: bytes) -> str:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256()
    for part in (source, version.encode(), " ".join(flags).encode(), _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    text = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                text += line + "\n"
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return f"{platform.machine()}\n{platform.processor()}\n{text}"


def _cache_dir() -> Path:
    """BROOK_KERNEL_CACHE, else ~/.cache/brook/kernels; a private temporary directory when
    neither can be written (a read-only home)."""
    configured = os.environ.get("BROOK_KERNEL_CACHE")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(configured) if configured else Path(base) / "brook" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return path
    except OSError:
        return Path(tempfile.mkdtemp(prefix="brook-kernels-"))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into ``target`` (atomically: concurrent engines may build the same file);
    the compiler's complaint on failure."""
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.part")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, str(_SOURCE), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            return f"{compiler} exited {done.returncode}: {done.stderr.strip()}"
        os.replace(partial, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _declare(library: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = library.brook_paged_decode
    fn.restype = i32
    fn.argtypes = [p, p, p, p, p, p, p, p, *[i64] * 8, i32, p, ctypes.c_float, i32]


def _lut(dtype: torch.dtype) -> torch.Tensor:
    """The 256 values of an 8-bit float type, as float32 (what ``.float()`` makes of them)."""
    table = _luts.get(dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()
        _luts[dtype] = table
    return table


def decode_attention(
    q: torch.Tensor,  # [decodes, heads, head_dim], as ``cache.query`` returns it
    cache: LayerKVCache,
    tables: torch.Tensor,  # [decodes, width] int64 block ids
    lens: torch.Tensor,  # [decodes] int64 context lengths (the new token included)
    scale: float,
    window: int | None,
) -> torch.Tensor | None:
    """Float32 attention output [decodes, heads, head_dim], or None when the kernel is not
    available here (the caller then runs the portable path)."""
    library = _load()
    kind = _KINDS.get(cache.k.dtype)
    if library is None or kind is None or q.device.type != "cpu":
        return None
    decodes, heads, dim = q.shape
    kv_heads, slots, _ = cache.k.shape
    q32 = q.to(torch.float32).contiguous()
    tables = tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    out = torch.empty((decodes, heads, dim), dtype=torch.float32)
    lut = _lut(cache.k.dtype) if kind == _LUT8 else None
    k_scale, v_scale = cache.k_scale, cache.v_scale
    status = library.brook_paged_decode(
        q32.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        decodes,
        heads,
        kv_heads,
        dim,
        slots,
        cache.block_size,
        tables.shape[1],
        window or 0,
        kind,
        None if lut is None else lut.data_ptr(),
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("decode attention: the kernel could not allocate its scratch memory")
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--prebuild"]:
        sys.exit("usage: python -m brook_engine.layers.cpu_decode --prebuild")
    print(f"built {prebuild()}")
