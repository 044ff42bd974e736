"""Float32 products at the row counts of decode batches and prefill chunks: Brook's packed
kernel (``layers/cpu_matmul.py``, every path this CPU runs) against oneDNN's inner product on
its own packed layout (what stock PyTorch runs, and Brook ran before) and ``F.linear`` on the
plain weight, in one run. SmolLM2-135M's shapes: 30 layers of qkv [960, 576], o [576, 576],
gate_up [3072, 576], down [576, 1536], distinct matrices, so the weights stream from memory
as in a decode step. Prints milliseconds for the model's 120 products and GFLOP/s (best of
five passes), and the CPU.

    .venv/bin/python tests/bench/small_m_rate.py [--threads N] [--rows 1,2,4,...]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from brook_engine.bench.machine import machine_line
from brook_engine.layers import cpu_kernels, cpu_matmul

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
PREFILL_LAYERS = 2  # 2,048 rows: a few layers are enough to time, and keep the run short


def _seconds(
    product: Callable[[torch.Tensor, torch.Tensor], object],
    weights: list[torch.Tensor],
    xs: dict[int, torch.Tensor],
) -> float:
    """Best of five passes of ``product`` over every weight, each with the rows of its width
    (read from the plain shape, Brook's packed shape or oneDNN's logical one alike)."""

    def run() -> None:
        for w in weights:
            product(xs[w.shape[1]], w)

    run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,2048")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.library() is None:
        raise SystemExit("Brook's CPU kernels do not run here (see the log): nothing to time")
    gen = torch.Generator().manual_seed(0)
    print(machine_line())
    print(f"float32, {args.threads} threads; ms for the layers' products (GFLOP/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        layers = PREFILL_LAYERS if rows > 256 else LAYERS
        plain = [torch.randn(*s, generator=gen) / 24 for _ in range(layers) for s in SHAPES]
        xs = {n: torch.randn(rows, n, generator=gen) for _, n in SHAPES}
        flops = sum(2 * rows * w.numel() for w in plain)
        cells = []
        for isa in ("avx512", "avx2", "c"):
            os.environ["BROOK_CPU_ISA"] = isa
            if cpu_matmul.isa() != cpu_kernels.ISA_LEVELS[isa]:
                continue  # this CPU has no such path
            packed = [cpu_matmul.pack(w) for w in plain]
            expected = F.linear(xs[576], plain[0])
            torch.testing.assert_close(cpu_matmul.matmul(xs[576], packed[0], None), expected)
            took = _seconds(lambda x, w: cpu_matmul.matmul(x, w, None), packed, xs)
            cells.append(f"Brook {isa} {took * 1e3:7.2f} ({flops / took / 1e9:5.1f})")
        os.environ.pop("BROOK_CPU_ISA", None)
        if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in plain]
            took = _seconds(
                lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                onednn,
                xs,
            )
            cells.append(f"oneDNN packed {took * 1e3:7.2f} ({flops / took / 1e9:5.1f})")
        took = _seconds(F.linear, plain, xs)
        cells.append(f"F.linear {took * 1e3:7.2f} ({flops / took / 1e9:5.1f})")
        print(f"{rows:5d} rows x {layers} layers: " + "  ".join(cells))


if __name__ == "__main__":
    main()
