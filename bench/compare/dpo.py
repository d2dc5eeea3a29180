"""DPO throughput and memory: the template (train.py, model/objective=dpo) against TRL's DPOTrainer on the same
model, the same token ids, global batch, optimizer (fused AdamW), clipping and precision; and the template's three
reference policies: a frozen copy (`template`), the model without its LoRA adapter (`template_lora`), a precomputed
table (`template_precompute`).

    python -m bench.compare.dpo [--rounds 3 --steps 30 --warmup 5 --seq-len 128 --batch 8 --shape 4,4,128]

Every pair is cut to fill the window exactly (prompt + answer = seq_len tokens, GPT-2's tokenizer), so every
way's step holds the same 2 x batch x seq_len tokens whatever order it reads them in. Each run is a fresh process;
the ways are interleaved round by round and the ratios are medians of per-round ratios [lowest-highest].
Peak RSS is the process's (ru_maxrss); `copy MiB` is the exact size of a frozen copy of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench.common import (
    LR,
    TOKENIZER,
    TRAINING_ONLY,
    interleaved,
    paired_ratio,
    parse_trl_bench,
    report,
    run_way,
    trl_child,
    trl_parts,
)

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT.parent / "shared" / "data" / "preference" / "dpo_en_demo.json"
WAYS = ("template", "trl", "template_lora", "template_precompute")
LORA = ["model.lora.enabled=true", "model.lora.dropout=0.0", "model.lora.target_modules=[c_attn,c_proj,c_fc]"]


def full_window_pairs(seq_len: int, out: Path) -> int:
    """Writes the demo pairs that fill seq_len exactly after the template's cut (as plain records, decoded), re-read
    until stable (BPE re-encoding of a cut text can differ at the cut); returns how many."""
    from src.lm.data.preference import PreferenceDataModule

    records = json.loads(PAIRS.read_text())
    source = out.with_suffix(".src.json")
    source.write_text(json.dumps(records))
    for _ in range(5):
        dm = PreferenceDataModule(
            str(source), tokenizer=str(TOKENIZER), seq_len=seq_len, val_fraction=0, test_fraction=0
        )
        dm.setup("fit")
        items = dm.splits["train"].items
        full = [i for i, item in enumerate(items) if len(item[1]) == len(item[3]) == seq_len]
        if len(full) == len(items):
            break
        decode = dm.tokenizer.decode
        records = []
        for i in full:
            _, c_ids, c_labels, r_ids, r_labels = items[i]
            start = int((c_labels != -100).argmax())  # the first target: the prompt's length - 1
            records.append(
                {
                    "prompt": decode(c_ids[: start + 1].tolist()),
                    "chosen": decode(c_ids[start + 1 :].tolist() + [int(c_labels[-1])]),
                    "rejected": decode(r_ids[start + 1 :].tolist() + [int(r_labels[-1])]),
                }
            )
        source.write_text(json.dumps(records))
    os.replace(source, out)
    return len(full)


def shape_args(shape: str) -> list[str]:
    layers, heads, width = shape.split(",")
    return [f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}"]


def template_cmd(args, out: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "data=preference",
        "model/objective=dpo",
        f"data.path={args.pairs}",
        f"data.tokenizer={TOKENIZER}",
        f"data.seq_len={args.seq_len}",
        "data.val_fraction=0",
        "data.test_fraction=0",
        f"data.global_batch_size={args.batch}",
        *shape_args(args.shape),
        f"model.optimizer.lr={LR}",
        "model.scheduler=null",
        "model.weight_decay=0.0",
        f"trainer.max_steps={args.steps}",
        f"trainer.precision={args.precision}",
        "trainer.gradient_clip_val=1.0",
        *TRAINING_ONLY,
        "train=true",
        f"paths.cache_dir={args.work}/cache",
        f"paths.log_dir={args.work}/logs",
        "+callbacks.timer._target_=bench.common.StepTimer",
        f"+callbacks.timer.warmup={args.warmup}",
        f"+callbacks.timer.out={out}",
        *extra,
    ]


def run_trl(args) -> None:
    """TRL's DPOTrainer on the same pair texts (it tokenizes prompt and answers apart with the same tokenizer, as
    the template does; max_length = seq_len + 1 because its inputs also hold the last target), the same GPT-2
    shape, a frozen copy as reference, fused AdamW, clipping 1.0, constant LR, no dropout."""
    import copy

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tokenizer, model, times, timer, common = trl_parts(args, n_positions=args.seq_len + 1)
    config = DPOConfig(
        **common, bf16=args.precision == "bf16-mixed", gradient_checkpointing=False, max_length=args.seq_len + 1
    )
    pairs = Dataset.from_list(json.loads(Path(args.pairs).read_text()))
    DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=config,
        train_dataset=pairs,
        processing_class=tokenizer,
        callbacks=[timer],
    ).train()
    report(times, args.warmup, 2 * args.batch * args.seq_len, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="pairs per step")
    ap.add_argument("--shape", default="4,4,128", help="GPT-2 layers,heads,width")
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    ap.add_argument("--ways", default=",".join(WAYS))
    args = parse_trl_bench(ap, ".cache/bench_dpo", "pairs")
    if args.child:
        run_trl(args)
        return
    os.makedirs(args.work, exist_ok=True)
    args.pairs = str(Path(args.work) / f"pairs_{args.seq_len}.json")
    n = full_window_pairs(args.seq_len, Path(args.pairs))
    ways = args.ways.split(",")
    extra = {
        "template": [],
        "template_lora": LORA,
        "template_precompute": ["model.objective.precompute_reference=true"],
    }

    def run(way: str, r: int) -> dict:
        out = os.path.join(args.work, f"{way}_{r}.json")
        keys = ("steps", "warmup", "seq_len", "batch", "shape", "precision", "work")
        if way == "trl":
            cmd = trl_child("bench.compare.dpo", args, keys, pairs=args.pairs, out=out)
        else:
            cmd = template_cmd(args, out, extra[way])
        result = run_way(cmd, way, out)
        if way != "trl":  # StepTimer counts batch x seq_len tokens; a batch of pairs is 2 x batch rows
            result["tokens_per_s"] *= 2
        return result

    results = interleaved(ways, args.rounds, run)
    layers, heads, width = map(int, args.shape.split(","))
    print(
        f"GPT-2 {layers} layers x {width} ({heads} heads), GPT-2 tokenizer, {n} pairs cut to fill {args.seq_len} "
        f"tokens, {args.batch} pairs a step, {args.precision}, {args.steps} steps ({args.warmup} warm-up), median of "
        f"{args.rounds} interleaved rounds, {os.cpu_count()} CPU cores"
    )
    print(f"{'way':<22}{'step ms':>9}{'tokens/s':>11}{'peak RSS MiB':>14}")
    for way, runs in results.items():
        m = {k: statistics.median(r[k] for r in runs) for k in ("step_s", "tokens_per_s", "peak_rss_mib")}
        print(f"{way:<22}{m['step_s'] * 1e3:9.1f}{m['tokens_per_s']:11.0f}{m['peak_rss_mib']:14.0f}")
    for label, (a, b) in {
        "template/trl": ("template", "trl"),
        "template_lora/template": ("template_lora", "template"),
        "template_precompute/template": ("template_precompute", "template"),
    }.items():
        if a in results and b in results:
            low, mid, high = paired_ratio(results[a], results[b])
            print(f"{label:<30} tokens/s = {mid:.3f}  [{low:.3f}-{high:.3f}]")
    from transformers import GPT2Config, GPT2LMHeadModel

    with __import__("torch").device("meta"):
        params = sum(
            p.numel()
            for p in GPT2LMHeadModel(
                GPT2Config(vocab_size=50257, n_positions=args.seq_len, n_layer=layers, n_head=heads, n_embd=width)
            ).parameters()
        )
    print(
        f"a frozen copy of the weights: {params:,} parameters, {params * 4 / 2**20:.1f} MiB in fp32 (what the "
        "LoRA and precomputed references do not hold)"
    )


if __name__ == "__main__":
    main()
