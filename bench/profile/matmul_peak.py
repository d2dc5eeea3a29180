"""This machine's matmul peak, the denominator for MFU on a CPU (callbacks.throughput.peak_flops).

python -m bench.profile.matmul_peak [--size 2048 --repeats 10]
"""

from __future__ import annotations

import argparse
import time

import torch


def peak(dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(f"{torch.get_num_threads()} threads, {args.size}x{args.size} matmul, best of {args.repeats}:")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"  {str(dtype):<16}{peak(dtype, args.size, args.repeats) / 1e12:7.3f} TFLOP/s")


if __name__ == "__main__":
    main()
