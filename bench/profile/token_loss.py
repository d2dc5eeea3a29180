"""The LM head and its loss, forward and backward, four ways (docs/performance.md, "A real vocabulary"):
`eager` (F.linear + the template's summed_token_loss, as model.compile_loss=false runs it), `compiled` (the same
loss through torch.compile, as model.compile_loss=true), `matmul` (the head's matrix products alone: what no loss
can go below) and `lce` (torch's own F.linear_cross_entropy, chunked: LinearCrossEntropyOptions()).

    python -m bench.profile.token_loss [--tokens 4096 --width 384 --vocab 32000 --precision bf16-mixed --rounds 5]

Ways are interleaved round by round; each figure is the median over the rounds after the first (which compiles).
The compiled way's sums and gradients are checked against the eager way's before any timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from src.lm.objectives.loss import summed_token_loss


def ways(bf16: bool) -> dict:
    compiled = torch.compile(summed_token_loss)

    def head(loss):
        def run(h, w, labels):
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                logits = F.linear(h, w)
            return loss(logits[None], labels[None])[0]

        return run

    def matmul(h, w, labels):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return F.linear(h, w).sum(dtype=torch.float32)  # the sum's backward is a broadcast, no pass worth timing

    def lce(h, w, labels):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            options = torch.nn.LinearCrossEntropyOptions()
            return F.linear_cross_entropy(h, w, labels, reduction="sum", options=options)

    return {"eager": head(summed_token_loss), "compiled": head(compiled), "matmul": matmul, "lce": lce}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, generator=gen)
    weight = torch.randn(args.vocab, args.width, generator=gen) * 0.02
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    times: dict[str, list[float]] = {}
    grads: dict[str, tuple] = {}
    for r in range(args.rounds):
        for name, run in ways(args.precision == "bf16-mixed").items():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            start = time.perf_counter()
            loss = run(h, w, labels)
            loss.backward()
            if r:  # the first round compiles
                times.setdefault(name, []).append(time.perf_counter() - start)
            grads[name] = (loss.detach(), h.grad, w.grad)
        if r == 0:
            for got, want in zip(grads["compiled"], grads["eager"]):
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5)  # bf16 gradients: a rounding apart
    print(
        f"{args.tokens} tokens x {args.width} -> {args.vocab}, {args.precision}, forward + backward, "
        f"median of {args.rounds - 1} rounds"
    )
    for name, ts in times.items():
        print(f"{name:<10}{statistics.median(ts) * 1e3:9.1f} ms")
    print(f"eager/compiled = {statistics.median(times['eager']) / statistics.median(times['compiled']):.3f}")


if __name__ == "__main__":
    main()
