"""Packing against padding: tokens of real text trained per second, and the share of each batch that
is padding, on the shared chat demo (data=chat) and the Alpaca demo (data=instruct), GPT-2's tokenizer.

    python -m bench.profile.packing [--rounds 3 --steps 3 --batch 4 --seq-len 1024 --shape 2,2,64]

Each way trains a fresh GPT-2 of `--shape` (layers, heads, width; fp32, AdamW) for `--steps` batches of `--batch`
rows in the order training reads them (epoch 0's shuffle, seed 42): padded rows hold one record each (padded to the batch's longest, attention mask), packed rows
several (src/lm/data/packing.py: position ids, no mask). "Real" tokens are the records' own, never padding. The
ways are interleaved round by round in one process; the ratio is the median of per-round ratios [lowest-highest].
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
TOKENIZER = SHARED / "gpt2-tokenizer"
DATA = {
    "chat": ("src.lm.data.chat", "ChatDataModule", SHARED / "chat" / "glaive_toolcall_en_demo.json"),
    "alpaca": ("src.lm.data.instruct", "InstructDataModule", SHARED / "alpaca" / "alpaca_en_demo.json"),
}


def batches(data: str, packing: bool, batch: int, seq_len: int, steps: int) -> list[tuple[dict, int, int]]:
    """`steps` collated batches of `batch` rows in order, each with its real tokens and its records."""
    import importlib

    from src.parallel.samplers import train_sampler

    module, name, path = DATA[data]
    cls = getattr(importlib.import_module(module), name)
    dm = cls(str(path), tokenizer=str(TOKENIZER), seq_len=seq_len, packing=packing, val_fraction=0, test_fraction=0)
    dm.setup("fit")
    rows, collate = dm.splits["train"], dm.collate_fn()
    if len(rows) // batch < steps:
        raise SystemExit(f"{data}: {len(rows)} rows make {len(rows) // batch} batches of {batch}; ask fewer --steps")
    out = []
    order = train_sampler(rows, 42, (0, 1)).epoch_order(0)  # the order training reads them (1 process, data.seed)
    for k in range(steps):
        items = [rows[int(i)] for i in order[k * batch : (k + 1) * batch]]
        records = sum(int((item["position_ids"] == 0).sum()) if packing else 1 for item in items)
        ids = [item["input_ids"] if packing else item[0] for item in items]  # a packed row is a dict (PackedRows)
        out.append((collate(items), sum(len(row) for row in ids), records))
    return out


def train_time(batches_: list[tuple[dict, int, int]], shape: tuple[int, int, int], vocab: int) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel

    from src.lm.objectives.loss import summed_token_loss

    layers, heads, width = shape
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, n_positions=2048)
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for batch, _, _ in batches_:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        loss_sum, n = summed_token_loss(model(**inputs, use_cache=False).logits, batch["labels"])
        (loss_sum / n.clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--shape", default="2,2,64")
    ap.add_argument("--data", nargs="+", default=list(DATA), choices=list(DATA))
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"GPT-2 {shape} fp32, {a.steps} batches of {a.batch} rows, seq_len {a.seq_len}, {a.rounds} rounds")
    print(f"{'data':8} {'way':7} {'real tok/s':>11} {'padding':>8} {'records':>8}   packed / padded")
    for data in a.data:
        ways = {p: batches(data, p, a.batch, a.seq_len, a.steps) for p in (False, True)}
        vocab = max(int(b["input_ids"].max()) for bs in ways.values() for b, _, _ in bs) + 1
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.rounds):
            for packing, bs in ways.items():
                rates[packing].append(sum(real for _, real, _ in bs) / train_time(bs, shape, vocab))
        ratios = [p / q for p, q in zip(rates[True], rates[False])]
        for packing, bs in ways.items():
            real, total = sum(r for _, r, _ in bs), sum(b["input_ids"].numel() for b, _, _ in bs)
            ratio = f"   {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]" if packing else ""
            print(
                f"{data:8} {'packed' if packing else 'padded':7} {statistics.median(rates[packing]):11.0f} "
                f"{1 - real / total:8.0%} {sum(n for _, _, n in bs):8d}{ratio}"
            )


if __name__ == "__main__":
    main()
