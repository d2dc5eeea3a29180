"""What keyed dropout (src/core/dropout.py) costs against torch's: one dropout, and a GPT-2 training step.

    python -m bench.profile.dropout [--rows 8 --seq 256 --width 256 --layers 2 --rounds 7 --device cpu]

`op`: forward + backward of one dropout (p = 0.1) on a rows x seq x width fp32 tensor, torch's `F.dropout` against
KeyedDropout. `step`: forward + backward of a GPT-2 (the width, `--layers` blocks of 64-wide heads) with dropout 0.1
everywhere: transformers' own (nn.Dropout modules, SDPA's dropout), the template's keyed (modules keyed, attention
through the model's eager function with its dropout keyed), and no dropout. Ways are interleaved round by round;
each figure is the median of the rounds after the first. Prints ms and the ratio to torch's, and what each step
way keeps for its backward (MiB of saved storages: the kernel keeps no mask).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from src.core import dropout as keyed


def timed(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def op_ways(rows: int, seq: int, width: int, device: torch.device) -> dict:
    x = torch.randn(rows, seq, width, requires_grad=True, device=device)
    module = keyed.KeyedDropout(0.1, "bench")
    keys = keyed.row_keys(torch.arange(rows, device=device), rows, step=0, seed=0)

    def torch_way():
        F.dropout(x, 0.1, training=True).sum().backward()

    def keyed_way(kernel: bool):
        def run():
            keyed.use_kernel(kernel)
            keyed.set_keys(keys)
            module(x).sum().backward()

        return run

    return {"torch": torch_way, "keyed": keyed_way(False), "kernel": keyed_way(True)}


def step_ways(rows: int, seq: int, width: int, layers: int, device: torch.device) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    def model(p: float, key: bool):
        torch.manual_seed(0)
        config = GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=seq, vocab_size=8192,
                            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)  # fmt: skip
        m = GPT2LMHeadModel(config).to(device).train()
        if key:
            keyed.key_attention(m, "sdpa")
            keyed.key_dropouts(m)
        return m

    ids = torch.randint(0, 8192, (rows, seq), generator=torch.Generator().manual_seed(0)).to(device)
    keys = keyed.row_keys(torch.arange(rows, device=device), rows, step=0, seed=0)

    def way(m, kernel: bool = False):
        def run():
            keyed.use_kernel(kernel)
            keyed.set_keys(keys)
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()

        return run

    keyed_model = model(0.1, True)
    return {"torch": way(model(0.1, False)), "keyed": way(keyed_model), "kernel": way(keyed_model, kernel=True),
            "none": way(model(0.0, False))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    for name, ways in (
        ("op", op_ways(args.rows, args.seq, args.width, device)),
        ("step", step_ways(args.rows, args.seq, args.width, args.layers, device)),
    ):
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, fn in ways.items():
                times[way].append(timed(fn, device))
        median = {way: statistics.median(t[1:]) for way, t in times.items()}
        shown = ", ".join(f"{way} {ms:.1f} ms ({ms / median['torch']:.2f}x torch)" for way, ms in median.items())
        print(f"{name} ({args.rows} x {args.seq} x {args.width}): {shown}")
    saved = {way: saved_mib(fn) for way, fn in ways.items()}  # the step's ways
    print("step, kept for the backward: " + ", ".join(f"{way} {mib:.3f} MiB" for way, mib in saved.items()))


def saved_mib(fn) -> float:
    """MiB of the storages autograd keeps for the backward while `fn` runs (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values()) / 2**20


if __name__ == "__main__":
    main()
