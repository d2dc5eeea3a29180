"""The LM head and its token loss, forward and backward, plain (summed_token_loss on the logits of every token)
against model.loss_chunk=N (chunked_token_loss): the time of each, rounds interleaved, and the most memory its
tensors hold at once (torch's memory profiler). Each step starts without gradients.

    python scripts/chunked_loss.py --tokens 4096 --width 384 --vocab 50257 --chunks 1024 256 --rounds 5
        [--precision bf16-mixed] [--compile]

Prints one line per variant: its median time, its time over the plain loss's (the median of the rounds' ratios,
[lowest-highest]) and its peak MiB of tensors; docs/performance.md has the figures."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.lm.objectives.loss import chunked_token_loss, summed_token_loss  # noqa: E402


def step(
    head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, chunk: int | None, bf16: bool, loss
) -> None:
    """One forward and backward of the head and the loss (the gradients of the hidden states and of the head)."""
    hidden.grad = head.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if chunk is None:
            total = loss(head(hidden), labels)[0]
        else:
            total = chunked_token_loss(hidden, labels, head, [head.weight], chunk, loss)[0]
    total.backward()


def peak_mib(run) -> float:
    """The most bytes of tensors alive at once while `run()` ran, the inputs and the head's weight included: torch's
    memory profiler's timeline (each tensor's allocation and free as torch makes them; no allocator's caching)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # export_memory_timeline: deprecated for CUDA's snapshots
        prof.export_memory_timeline(f"{tmp}/timeline.json", device="cpu")
        _, sizes = json.loads(Path(f"{tmp}/timeline.json").read_text())
    return max(sum(at) for at in sizes) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--compile", action="store_true", help="the loss compiled (model.compile_loss=true), both ways")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16 = args.precision == "bf16-mixed"
    head = torch.nn.Linear(args.width, args.vocab, bias=False)
    hidden = torch.randn(1, args.tokens, args.width, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.tokens))
    variants = [None, *args.chunks]
    loss = torch.compile(summed_token_loss) if args.compile else summed_token_loss
    run = {v: (lambda v=v: step(head, hidden, labels, v, bf16, loss)) for v in variants}
    for v in variants:  # warm-up, and each variant's peak memory
        run[v]()
    peaks = {v: peak_mib(run[v]) for v in variants}
    times: dict = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:  # each round starts elsewhere
            start = time.perf_counter()
            run[v]()
            times[v].append(time.perf_counter() - start)
    print(f"{args.tokens} tokens x width {args.width} x vocabulary {args.vocab}, {args.precision}, loss "
          f"{'compiled' if args.compile else 'eager'}, {torch.get_num_threads()} threads, {args.rounds} rounds")  # fmt: skip
    for v in variants:
        ratios = [t / p for t, p in zip(times[v], times[None])]
        print(
            f"{'plain' if v is None else f'loss_chunk={v}':>16}: {1000 * statistics.median(times[v]):8.1f} ms, "
            f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] x plain, peak {peaks[v]:7.1f} MiB of tensors"
        )


if __name__ == "__main__":
    main()
