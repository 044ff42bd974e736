"""Brook's C kernels for CPU, built into one shared library and loaded with ctypes.

The sources in ``csrc/`` (decode attention over the paged cache, the fused element-wise
steps of a decoder layer, the one-row product of a 16-bit weight, the int8-weight product of
W8A16, the float32 product over Brook's packed layout) are compiled together at first use
with the machine's ``cc`` (``-O3 -march=native -fopenmp``, a few seconds) into a cache
directory keyed by the sources, the compiler and the CPU. The OpenMP runtime the library
links against is the one torch has already loaded, so the two never keep rival thread
pools. Where no compiler is installed (the engine image), a copy built for a baseline CPU
when the package was installed (``python -m brook_engine.layers.cpu_kernels --prebuild``)
is loaded if this CPU has what it was built for. Without either, or with
``BROOK_CPU_KERNELS=off`` (which also keeps linear weights plain), every caller runs its
portable PyTorch path and the reason is logged once.

``BROOK_CPU_ISA`` (``c``, ``avx2``, ``avx512``, ``avx512bf16``; default: the best the CPU has)
caps the vector path every kernel takes, so one machine measures and tests what a smaller
CPU runs. Set before the process starts, ``avx2`` and ``c`` also build the library for that
baseline (``-march=x86-64-v3``, ``-march=x86-64``) instead of this CPU, so the generic C
kernels (decode attention, fused steps) are compiled as they would be there.
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

from brook_engine.host import cpu_features

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES: tuple[Path, ...] = (
    _CSRC / "paged_decode.c",
    _CSRC / "fused_ops.c",
    _CSRC / "one_row.c",
    _CSRC / "int8_matmul.c",
    _CSRC / "f32_matmul.c",
    _CSRC / "decode_layer.c",
)
# What is tried when everything does not build: a compiler without AVX512-BF16 intrinsics
# (gcc < 9) still gets decode attention and the fused steps.
_OPTIONAL = frozenset({"one_row.c", "decode_layer.c"})  # the second calls the first
# No -ffast-math: the kernels write out the one function (exp) that needed it to vectorize.
# -fno-trapping-math changes no element-wise value (nothing here reads the FP exception flags);
# without it GCC keeps the clamps around that exp as branches and the loops that call it
# scalar. With it, decode attention's softmax sum (an `omp simd` reduction) is summed in
# vector lanes, a rounding-level change.
_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
)
# A copy built ahead for any CPU of a baseline: its flags and the CPU features it needs.
_BASELINES: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "x86_64": (("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2"})),
    "aarch64": ((), frozenset()),
}

# BROOK_CPU_ISA: the paths' numbers in the C kernels, and the build baseline a cap implies.
ISA_LEVELS = {"c": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
_CAPPED_ARCH = {"c": ("-march=x86-64",), "avx2": ("-march=x86-64-v3",)}
_NATIVE = max(ISA_LEVELS.values())

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    """Whether the C kernels run here (building them on the first call)."""
    return library() is not None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where the portable paths run."""
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


_isa_seen: tuple[str | None, str] = (None, "native")  # the variable's value, its name


def isa_name() -> str:
    """``BROOK_CPU_ISA`` as given (lower case), ``native`` when unset; an unknown value is
    an error naming the choices. (Read on every product: tests change it between calls.)"""
    global _isa_seen
    raw = os.environ.get("BROOK_CPU_ISA")
    if raw is None:
        return "native"
    if raw == _isa_seen[0]:
        return _isa_seen[1]
    name = raw.strip().lower() or "native"
    if name != "native" and name not in ISA_LEVELS:
        choices = ", ".join((*ISA_LEVELS, "native"))
        raise ValueError(f"BROOK_CPU_ISA={name!r} is not one of {choices}")
    _isa_seen = (raw, name)
    return name


def isa_limit() -> int:
    """The best vector path the kernels may take (``BROOK_CPU_ISA``); each kernel takes the
    best its CPU has up to this."""
    return ISA_LEVELS.get(isa_name(), _NATIVE)


def _native_arch() -> tuple[str, ...]:
    return _CAPPED_ARCH.get(isa_name(), ("-march=native",))


def _build_and_open() -> ctypes.CDLL | None:
    if os.environ.get("BROOK_CPU_KERNELS", "").lower() == "off":
        logger.info("CPU kernels: portable paths (BROOK_CPU_KERNELS=off)")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        prebuilt = _open_prebuilt()
        if prebuilt is None:
            logger.warning(
                "CPU kernels: no C compiler (cc) found and no prebuilt kernels for this CPU, "
                "running the portable paths (slower decode); install gcc or set CC to "
                "enable them"
            )
        return prebuilt
    errors: list[str] = []
    required = tuple(path for path in _SOURCES if path.name not in _OPTIONAL)
    attempts = [
        (arch, paths)
        for paths in (_SOURCES, required)
        for arch in (_native_arch(), ())  # -march=native is unknown to some compilers
    ]
    for arch, paths in attempts:
        flags = (*_FLAGS, *arch)
        sources = [path.read_bytes() for path in (*paths, *_headers(paths))]
        target = _cache_dir() / f"brook_kernels-{_key(compiler, flags, sources)}.so"
        if not target.exists():
            error = _compile(compiler, flags, paths, target)
            if error is not None:
                errors.append(error)
                continue
        try:
            opened = ctypes.CDLL(str(target))
        except OSError as exc:
            errors.append(str(exc))
            continue
        _declare(opened)
        logger.info("CPU kernels: %s", target.name)
        return opened
    prebuilt = _open_prebuilt()
    if prebuilt is None:
        logger.warning(
            "CPU kernels: the C kernels did not build, running the portable paths: %s",
            errors[-1][-2000:] if errors else "unknown error",
        )
    return prebuilt


def _headers(sources: tuple[Path, ...]) -> list[Path]:
    """The headers the sources include (their folder's), part of the build key."""
    return sorted({h for path in sources for h in path.parent.glob("*.h")})


def prebuilt_path() -> Path:
    return _SOURCES[0].with_name(f"brook_kernels.{platform.machine()}.so")


def _open_prebuilt() -> ctypes.CDLL | None:
    """The copy built ahead for a baseline CPU, when it is there and this CPU has the
    baseline's features (a missing instruction would kill the process, not raise)."""
    path = prebuilt_path()
    baseline = _BASELINES.get(platform.machine())
    if baseline is None or not path.is_file() or not baseline[1] <= cpu_features():
        return None
    try:
        opened = ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("CPU kernels: %s does not load: %s", path.name, exc)
        return None
    _declare(opened)
    logger.info("CPU kernels: prebuilt %s", path.name)
    return opened


def _declare(opened: ctypes.CDLL) -> None:
    """The C signatures, so that ctypes converts Python ints and floats correctly."""
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures: dict[str, tuple[type | None, list[type]]] = {
        # q, k, v, k_scale, v_scale, tables, lens, out, decodes, heads, kv_heads, dim,
        # slots, block_size, width, window, kind, lut, scale, threads
        "brook_paged_decode": (i32, [p] * 8 + [i64] * 8 + [i32, p, f32, i32]),
        # k, v, k_cache, v_cache, slots, tokens, kv_heads, dim, token_stride, slots, item
        "brook_kv_store": (i32, [p] * 5 + [i64] * 6),
        # x, map, offset, cache, slots, tokens, kv_heads, dim, token_stride, slots, threads
        "brook_kv_store_int8": (i32, [p] * 5 + [i64] * 5 + [i32]),
        # x, map, offset, out, tokens, heads, dim, token_stride, threads
        "brook_head_map": (i32, [p] * 4 + [i64] * 4 + [i32]),
        # x, delta, weight, out, residual, rows, hidden, eps, kind, threads
        "brook_add_rms_norm": (None, [p] * 5 + [i64, i64, f32, i32, i32]),
        # gate_up, out, rows, inter, kind, threads
        "brook_silu_mul": (None, [p, p, i64, i64, i32, i32]),
        # x, cos, sin, tokens, heads, rotated, dim, kind, threads
        "brook_rotary": (None, [p, p, p, i64, i64, i64, i64, i32, i32]),
        # limit, x kind, weight kind
        "brook_one_row_isa": (i32, [i32, i32, i32]),
        # x, weight, bias, out, out_features, in_features, x kind, weight kind, isa, threads
        "brook_one_row": (i32, [p, p, p, p, i64, i64, i32, i32, i32, i32]),
        # q, packed, out_features, in_features
        "brook_int8_pack": (None, [p, p, i64, i64]),
        "brook_int8_isa": (i32, [i32]),
        # x, packed, scales, bias, out, rows, out_features, in_features, group, kind, isa,
        # threads
        "brook_int8_matmul": (i32, [p] * 5 + [i64] * 4 + [i32, i32, i32]),
        # w, packed, out_features, in_features, threads
        "brook_f32_pack": (None, [p, p, i64, i64, i32]),
        "brook_f32_isa": (i32, [i32]),
        # x, packed, bias, out, rows, out_features, in_features, isa, threads
        "brook_f32_matmul": (None, [p] * 4 + [i64] * 3 + [i32, i32]),
    }
    for name, (restype, argtypes) in signatures.items():
        if not hasattr(opened, name):  # an optional kernel that did not build
            continue
        fn = getattr(opened, name)
        fn.restype = restype
        fn.argtypes = argtypes


def prebuild() -> Path:
    """Build the baseline copy next to the sources (at image build time, where a compiler
    is installed and the CPU that will run it is not known). Kernels that need more than
    the baseline (AVX-512, AVX512-BF16) are compiled for their own target and check the CPU
    before they run."""
    baseline = _BASELINES.get(platform.machine())
    if baseline is None:
        raise RuntimeError(f"no baseline CPU is defined for {platform.machine()}")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    target = prebuilt_path()
    error = _compile(compiler, (*_FLAGS, *baseline[0]), _SOURCES, target)
    if error is not None:
        raise RuntimeError(error)
    return target


def _key(compiler: str, flags: tuple[str, ...], sources: list[bytes]) -> str:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256()
    for part in (*sources, version.encode(), " ".join(flags).encode(), _cpu_signature().encode()):
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


def _compile(
    compiler: str, flags: tuple[str, ...], sources: tuple[Path, ...], target: Path
) -> str | None:
    """Compile into ``target`` (atomically: concurrent engines may build the same file);
    the compiler's complaint on failure."""
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.part")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, sources), "-o", partial, "-lm"],
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


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--prebuild"]:
        sys.exit("usage: python -m brook_engine.layers.cpu_kernels --prebuild")
    print(f"built {prebuild()}")
