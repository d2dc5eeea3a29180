"""Where one training step's time goes, in a raw loop: data, forward, backward, clip + optimizer.

    python -m bench.profile.step_breakdown [--shapes small,medium --precision auto --attn sdpa,eager]

Whatever a training loop adds or saves (the template's, transformers.Trainer's) can only come out of
the time outside forward and backward, which all three ways of bench.compare.throughput spend in the same
Hugging Face GPT-2 modules. This bounds how far apart their tokens/s can be.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import resolve_precision
from bench.compare.throughput import raw_loop

PHASES = ("data", "forward", "backward", "clip+optimizer")


def breakdown(shape: str, precision: str, steps: int, warmup: int, cache_dir: str, attn: str) -> dict[str, float]:
    """Median seconds of each phase of a step, over the steps after the warm-up."""
    times = raw_loop(shape, cache_dir, precision, steps, attn)[warmup:]
    return {phase: statistics.median(t[i + 1] - t[i] for t in times) for i, phase in enumerate(PHASES)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,medium")
    ap.add_argument("--precision", default="auto", choices=["auto", "32-true", "bf16-mixed"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attn", default="auto", help="attention kernels to compare, e.g. sdpa,eager; auto: train.py's")
    ap.add_argument("--cache-dir", default=".cache/bench/tokens")
    args = ap.parse_args()
    args.precision = resolve_precision(args.precision)
    print(f"precision {args.precision}, median of {args.steps - args.warmup} steps, {torch.get_num_threads()} threads")
    for shape in args.shapes.split(","):
        for attn in args.attn.split(","):
            parts = breakdown(shape, args.precision, args.steps, args.warmup, args.cache_dir, attn)
            total = sum(parts.values())
            print(
                f"{shape:<8}{attn:<6}{total * 1e3:8.1f} ms/step  "
                + "  ".join(f"{p} {s * 1e3:.1f} ms ({s / total:.1%})" for p, s in parts.items())
            )


if __name__ == "__main__":
    main()
