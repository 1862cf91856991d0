"""Fused against split projections at Phi-3-mini's shapes (hidden 3072, 32 heads of 96, intermediate 8192):
one q/k/v product against three, one gate/up product against two, on the engine's own linear layers (W8A8
on the backend the plan (worker/engine/plan/schemes.py) picks here, and bfloat16), median milliseconds per call. Phi-3 checkpoints ship
qkv_proj and gate_up_proj fused; the engine keeps every family's projections fused (weights.py), and this
says what splitting them would cost or save.

  python scripts/fused_bench.py [--rows 1,16,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_int8_linear  # noqa: E402
from kernels.platform import tier_line  # noqa: E402
from worker.engine.quantization import make_linear  # noqa: E402

HIDDEN, INTERMEDIATE = 3072, 8192
SPLITS = {"qkv": [HIDDEN, HIDDEN, HIDDEN], "gate_up": [INTERMEDIATE, INTERMEDIATE]}


def median_ms(fn, reps: int = 7) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256")
    args = parser.parse_args()
    print(tier_line())
    backend = "onednn" if cpu_int8_linear.onednn_available() else None
    gen = torch.Generator().manual_seed(0)
    print(f"{'product':8} {'path':10} {'rows':>5} {'fused ms':>9} {'split ms':>9} {'split/fused':>11}")
    for name, sizes in SPLITS.items():
        parts = [torch.randn(n, HIDDEN, generator=gen) * 0.02 for n in sizes]
        for path, quantization in (("W8A8", "int8"), ("bfloat16", None)):
            def build(weight: torch.Tensor, quantization: str | None = quantization):
                # W8A8 up to 64 rows on the small-batch kernel, as the plan measures it on the AVX2 VM
                return make_linear(weight, None, torch.bfloat16, quantization, int8_backend=backend,
                                   small_batch_rows=64)  # fmt: skip

            fused = build(torch.cat(parts))
            split = [build(w) for w in parts]
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
                f = median_ms(lambda x=x, fused=fused: fused(x))
                s = median_ms(lambda x=x, split=split: [layer(x) for layer in split])
                print(f"{name:8} {path:10} {rows:5d} {f:9.3f} {s:9.3f} {s / f:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
