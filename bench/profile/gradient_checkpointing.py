"""Peak memory and step time of one GPT-2 training step with and without gradient checkpointing.

    python -m bench.profile.gradient_checkpointing [--layers 6 --width 384 --heads 6 --seq 512 --batch 8 --vocab 50257]

Each variant runs in a fresh process (peak RSS is per process), interleaved and repeated, and
reports the peak resident memory above the process's level once the model and optimizer exist:
on CPU that is the activations, gradients and optimizer state of the step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one_step(args: argparse.Namespace) -> dict:
    import torch

    from src.lm.models.gpt2_module import GPT2LitModule

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    module = GPT2LitModule(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        gradient_checkpointing=args.gc,
    )
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    module(ids[:1, :8], ids[:1, :8]).loss.backward()  # warm-up allocations, then drop its grads
    opt.zero_grad(set_to_none=True)
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    module(ids, ids).loss.backward()
    opt.step()
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak_kib - base_kib) / 1024, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50257, help="small values isolate the blocks from the LM head")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gc", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_step(args)))
        return
    results = {False: [], True: []}
    base = [sys.executable, "-m", "bench.profile.gradient_checkpointing", "--child"] + [
        f"--{k}={getattr(args, k)}" for k in ("layers", "width", "heads", "seq", "batch", "vocab", "threads")
    ]
    for _ in range(args.repeats):
        for gc in (False, True):  # interleaved, so machine noise hits both alike
            out = subprocess.run(base + (["--gc"] if gc else []), capture_output=True, text=True, check=True)
            results[gc].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"GPT-2 {args.layers}L x {args.width}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, "
        f"{args.threads} threads, "
        f"median of {args.repeats}:"
    )
    med = {gc: {k: statistics.median(r[k] for r in results[gc]) for k in ("peak_mib", "seconds")} for gc in results}
    for gc in (False, True):
        print(
            f"  gradient_checkpointing={str(gc).lower():<5}  peak +{med[gc]['peak_mib']:7.0f} MiB  "
            f"step {med[gc]['seconds']:.2f} s"
        )
    print(
        f"  ratio (with / without): memory {med[True]['peak_mib'] / med[False]['peak_mib']:.2f}, "
        f"time {med[True]['seconds'] / med[False]['seconds']:.2f}"
    )


if __name__ == "__main__":
    main()
