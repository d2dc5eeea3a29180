"""The template against nanoGPT from outside: whole `python train.py` runs against whole nanoGPT runs, timed on the
wall clock, with everything the template does by default (validation every 100 steps on the whole val split,
checkpoints, sample text, TensorBoard), not only the training step that `bench.compare.throughput` times.

    python -m bench.compare.outside [--rounds 2 --short 40 --long 340] [--nanogpt-dir ~/nanoGPT] [--variants NAME=OVERRIDES]

Each way runs `--short` and `--long` optimizer steps; its time per step is the difference of the two runs' wall
times over the difference of their steps, so start-up, the first evaluation and the final test cancel out. Same
GPT shape as the issue (4 layers, 4 heads, width 128, context 128, batch 16), same bytes (tinyshakespeare,
vocabulary 257). The ways run interleaved round by round (who goes first rotates), so a noisy machine hits all.

- `template`: `python train.py` with the shape and data overrides only: the template's default precision.
- `template_fp32`: the same with `trainer.precision=32-true` (nanoGPT's only CPU mode).
- `nanogpt`: nanoGPT's own train.py (`--nanogpt-dir`, a checkout of github.com/karpathy/nanoGPT) with
  `--device=cpu --compile=False` and the same shape, optimizer and clipping; without `--nanogpt-dir`,
  `bench/compare/nanogpt.py`'s loop in a process of its own (`nanogpt_style`). nanoGPT's default evaluates at step 0
  only (every 2000 steps), so in the difference of the two runs it does no evaluation at all.
- `nanogpt_val`: nanoGPT's own train.py evaluating as often as the template does (`--eval_interval=100`, the
  template's `trainer.val_check_interval`) and as much: nanoGPT estimates the loss of both splits, `--eval_iters`
  batches each, so it gets half the template's val batches per split (14 + 14 for tinyshakespeare's 28), the
  same number of evaluation forwards in all. The equal-settings comparison for the template's default run.
  nanoGPT saves a checkpoint at each evaluation; the template writes sample text and two checkpoints (best and
  last).
- `--variants NAME=OVERRIDE[,OVERRIDE...]`: the template with extra overrides, e.g.
  `noval=trainer.limit_val_batches=0` to see what periodic validation costs.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
LAYERS, HEADS, WIDTH, CTX, BATCH = 4, 4, 128, 128, 16  # the shape (nanoGPT's shakespeare_char, smaller)
SHAPE = [
    f"model.n_layer={LAYERS}",
    f"model.n_head={HEADS}",
    f"model.n_embd={WIDTH}",
    f"data.seq_len={CTX}",
    f"data.global_batch_size={BATCH}",
]


def template_cmd(work: Path, name: str, steps: int, corpus: Path, extra: list[str]) -> tuple[list[str], Path]:
    return [
        sys.executable,
        "train.py",
        f"data.path={corpus}",
        *SHAPE,
        f"trainer.max_steps={steps}",
        f"hydra.run.dir={work}/runs/{name}_{steps}",
        f"paths.cache_dir={work}/cache",
        *extra,
    ], ROOT


def template_val_batches(corpus: Path) -> int:
    """Batches in the template's val split of the corpus as bytes: one block per CTX tokens (the last one
    padded), 5% of them (data.val_fraction), BATCH a batch."""
    from src.lm.data.text import split_blocks

    n_tokens = corpus.stat().st_size + 1  # the bytes and one EOS
    _, n_val, _ = split_blocks(math.ceil((n_tokens - 1) / CTX), val_fraction=0.05, test_fraction=0.05)
    return math.ceil(n_val / BATCH)


def nanogpt_eval_iters(corpus: Path) -> int:
    """nanoGPT's `--eval_iters` for as many evaluation forwards as the template's validation: nanoGPT runs
    `eval_iters` batches of each split, train and val, so half the template's val batches (rounded up)."""
    return math.ceil(template_val_batches(corpus) / 2)


def nanogpt_cmd(
    work: Path, steps: int, nanogpt_dir: Path | None, eval_every: int = 0, eval_iters: int = 20
) -> tuple[list[str], Path]:
    """eval_every 0: nanoGPT's default eval_interval (2000: only at step 0 here)."""
    if nanogpt_dir is None:
        return [sys.executable, "-m", "bench.compare.outside", "--child-nanogpt", str(steps), "--work", str(work)], ROOT
    # nanoGPT reads configurator.py and data/<dataset>/ from its working directory, so it runs from `work`.
    for f in ("train.py", "model.py", "configurator.py"):
        shutil.copy(nanogpt_dir / f, work / f)
    return [
        sys.executable,
        "train.py",
        "--dataset=bytes",
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        f"--n_layer={LAYERS}",
        f"--n_head={HEADS}",
        f"--n_embd={WIDTH}",
        f"--block_size={CTX}",
        f"--batch_size={BATCH}",
        "--gradient_accumulation_steps=1",
        "--dropout=0.0",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--warmup_iters=50",
        "--learning_rate=1e-3",
        "--min_lr=1e-4",
        "--weight_decay=0.1",
        "--beta2=0.95",
        "--grad_clip=1.0",
        f"--eval_iters={eval_iters}",
        *([f"--eval_interval={eval_every}"] if eval_every else []),
        f"--out_dir={work}/nanogpt_out",
    ], work


def byte_data(work: Path, corpus: Path) -> None:
    """nanoGPT's data layout for the corpus as bytes: data/bytes/{train,val}.bin (uint16) and meta.pkl."""
    out = work / "data" / "bytes"
    out.mkdir(parents=True, exist_ok=True)
    tokens = np.fromfile(corpus, dtype=np.uint8).astype(np.uint16)
    split = int(0.9 * len(tokens))  # nanoGPT's shakespeare_char split
    tokens[:split].tofile(out / "train.bin")
    tokens[split:].tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 257}, f)  # 256 bytes + the template's EOS id


def child_nanogpt(steps: int, work: Path) -> None:
    """bench/compare/nanogpt.py's model and loop as its own process, on nanoGPT's train.bin."""
    import torch

    from bench.compare import nanogpt

    torch.manual_seed(1337)
    tokens = np.memmap(work / "data" / "bytes" / "train.bin", dtype=np.uint16, mode="r")
    nanogpt.train(
        tokens, 257, (LAYERS, HEADS, WIDTH, CTX, BATCH), steps, 1e-3, (0.9, 0.95), 0.1, 1.0, time.perf_counter
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short", type=int, default=40)
    ap.add_argument("--long", type=int, default=340)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--nanogpt-dir", type=Path, help="a checkout of github.com/karpathy/nanoGPT (its train.py runs)")
    ap.add_argument("--ways", default="template,template_fp32,nanogpt")
    ap.add_argument("--variants", nargs="*", default=[], help="NAME=override[,override...]: template variants")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench_outside")
    ap.add_argument("--child-nanogpt", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_nanogpt:
        return child_nanogpt(args.child_nanogpt, args.work)
    if not args.corpus.is_file():
        sys.exit(f"bench.compare.outside: corpus {args.corpus} not found; give one with --corpus PATH")
    args.work.mkdir(parents=True, exist_ok=True)
    byte_data(args.work, args.corpus)
    variants = {v.split("=", 1)[0]: v.split("=", 1)[1].split(",") for v in args.variants}
    ways = [*args.ways.split(","), *variants]
    if "nanogpt_val" in ways and args.nanogpt_dir is None:
        sys.exit("bench.compare.outside: the way nanogpt_val runs nanoGPT's own train.py: give --nanogpt-dir")
    eval_iters = nanogpt_eval_iters(args.corpus)
    walls: dict[str, dict[int, list[float]]] = {w: {args.short: [], args.long: []} for w in ways}
    for r in range(args.rounds):
        k = r % len(ways)
        for way in ways[k:] + ways[:k]:
            for steps in (args.short, args.long):
                if way == "nanogpt":
                    cmd, cwd = nanogpt_cmd(args.work, steps, args.nanogpt_dir)
                elif way == "nanogpt_val":
                    cmd, cwd = nanogpt_cmd(args.work, steps, args.nanogpt_dir, eval_every=100, eval_iters=eval_iters)
                else:
                    extra = {"template": [], "template_fp32": ["trainer.precision=32-true"]}.get(way, variants.get(way))
                    cmd, cwd = template_cmd(args.work, way, steps, args.corpus, extra)
                start = time.perf_counter()
                proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
                walls[way][steps].append(time.perf_counter() - start)
                if proc.returncode != 0:
                    sys.exit(f"{way} ({steps} steps) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                print(f"round {r} {way:<14} {steps:>4} steps {walls[way][steps][-1]:7.1f} s", flush=True)
    per_step = {
        w: [(lo - sh) / (args.long - args.short) for sh, lo in zip(t[args.short], t[args.long])]
        for w, t in walls.items()
    }
    label = "nanogpt" if args.nanogpt_dir else "nanogpt_style"
    print(
        f"\n{args.rounds} rounds, {os.cpu_count()} CPU cores; ms/step = (wall {args.long} - wall {args.short}) / "
        f"{args.long - args.short}; nanogpt = {label}; nanogpt_val evaluates every 100 steps on {eval_iters} "
        f"batches of each split ({2 * eval_iters} in all, the template {template_val_batches(args.corpus)})"
    )
    bases = [b for b in ("nanogpt", "nanogpt_val") if b in per_step]
    print(
        f"{'way':<16}{'ms/step (rounds)':<24}{'tokens/s':>10}"
        + "".join(f"  vs {b}: median [lowest-highest]" for b in bases)
    )
    for way, steps in per_step.items():
        rounds = ", ".join(f"{s * 1e3:.1f}" for s in steps)
        line = f"{way:<16}{rounds:<24}{BATCH * CTX / statistics.median(steps):10.0f}"
        for base in bases:
            if way not in bases:
                ratios = [n / s for n, s in zip(per_step[base], steps)]  # tokens/s ratio, round by round
                line += f"  {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
        print(line)


if __name__ == "__main__":
    main()
