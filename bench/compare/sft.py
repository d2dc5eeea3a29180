"""Chat SFT with packing: the template (train.py, data=chat, data.packing=true) against TRL's SFTTrainer (packing on,
assistant_only_loss) on the same model, conversations, template, rows per step and seq_len.

    python -m bench.compare.sft [--rounds 3 --steps 12 --warmup 3 --seq-len 1024 --batch 4 --shape 2,2,64]

The data: the shared English tool-call demo's conversations that fit `--seq-len` whole with GPT-2's tokenizer,
written once in OpenAI's messages layout (tools and call arguments as JSON text, so Arrow keeps them as they are),
read by both. Both render ChatML (the template's `chatml`; TRL gets the same template with the `{% generation %}`
markers its assistant_only_loss needs, tests/helpers/chat_template.py) and train the assistant's turns only.
Packing differs as each library does it: the template fills rows in order (next fit) and runs them as `batch` rows
of `seq_len` with position ids; TRL packs best-fit decreasing and runs a step's rows as one flattened row
(padding-free). A "real" token is a conversation's own, never padding; real tokens/s = a step's mean real tokens /
its median step time. fp32, AdamW at a constant LR, clipping 1.0, no dropout; each run a fresh process, the ways
interleaved round by round, the ratio the median of per-round ratios [lowest-highest].
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
    StepTimer,
    interleaved,
    paired_ratio,
    parse_trl_bench,
    run_way,
    trl_child,
    trl_parts,
)

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT.parent / "shared" / "data" / "chat" / "glaive_toolcall_en_demo.json"
WAYS = ("template", "trl")


def whole_conversations(seq_len: int, work: Path) -> tuple[Path, int]:
    """The demo's conversations that fit seq_len whole as a messages JSONL file (tools and call arguments as JSON
    text); returns its path and how many."""
    from src.lm.data.chat import ChatDataModule, read_conversations

    every, out = work / "all.jsonl", work / f"chats_{seq_len}.jsonl"
    with open(every, "w", encoding="utf-8") as f:
        for messages, tools in read_conversations(str(CHATS), "auto"):
            for m in messages:
                for call in m.get("tool_calls", []):
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
            f.write(json.dumps({"messages": messages, "tools": json.dumps(tools, ensure_ascii=False)}) + "\n")
    dm = ChatDataModule(str(every), tokenizer=str(TOKENIZER), seq_len=seq_len, chat_template="chatml", overlong="drop")
    kept = [
        line
        for line, (messages, tools) in zip(
            every.read_text(encoding="utf-8").splitlines(), read_conversations(str(every), "auto")
        )
        if any(m["role"] == "assistant" for m in messages) and dm.cut(messages, tools, str(every)) is not None
    ]
    out.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return out, len(kept)


def template_cmd(args, out: str) -> list[str]:
    layers, heads, width = args.shape.split(",")
    return [
        sys.executable,
        "train.py",
        "data=chat",
        f"data.path={args.chats}",
        f"data.tokenizer={TOKENIZER}",
        "data.chat_template=chatml",
        f"data.seq_len={args.seq_len}",
        "data.packing=true",
        "data.overlong=drop",
        "data.val_fraction=0",
        "data.test_fraction=0",
        f"data.global_batch_size={args.batch}",
        f"model.n_layer={layers}",
        f"model.n_head={heads}",
        f"model.n_embd={width}",
        f"model.optimizer.lr={LR}",
        "model.scheduler=null",
        "model.weight_decay=0.0",
        f"trainer.max_steps={args.steps}",
        "trainer.precision=32-true",
        "trainer.gradient_clip_val=1.0",
        *TRAINING_ONLY,
        "train=true",
        f"paths.cache_dir={args.work}/cache",
        f"paths.log_dir={args.work}/logs",
        "+callbacks.timer._target_=bench.compare.sft.RowTimer",
        f"+callbacks.timer.warmup={args.warmup}",
        f"+callbacks.timer.out={out}",
    ]


class RowTimer(StepTimer):
    """StepTimer counting real tokens: a step's rows times the packed rows' mean real tokens (padding is added
    by the collate, after the rows)."""

    def on_train_end(self, trainer, pl_module) -> None:
        rows = trainer.datamodule.splits["train"]
        real = statistics.fmean(len(rows[i]["input_ids"]) for i in range(len(rows)))  # a packed row is a dict
        report(self.times, self.warmup, real * trainer.datamodule.batch_size, self.out, len(rows))


def report(times: list[float], warmup: int, tokens_per_step: float, out: str, rows: int) -> None:
    steps = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]
    median = statistics.median(steps)
    with open(out, "w") as f:
        json.dump({"step_s": median, "tokens_per_s": tokens_per_step / median, "rows": rows}, f)


def run_trl(args) -> None:
    """TRL's SFTTrainer on the same file: the same GPT-2 shape, ChatML with generation markers, packing (its
    default best-fit decreasing, padding-free), assistant_only_loss, fused AdamW, clipping 1.0, constant LR."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from tests.helpers.chat_template import MARKED

    tokenizer, model, times, timer, common = trl_parts(args, n_positions=args.seq_len + 1)
    tokenizer.chat_template = MARKED
    sft = SFTConfig(**common, max_length=args.seq_len, packing=True, assistant_only_loss=True)
    trainer = SFTTrainer(
        model=model,
        args=sft,
        train_dataset=load_dataset("json", data_files=str(args.chats), split="train"),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    trainer.train()
    report(times, args.warmup, statistics.fmean(lengths) * args.batch, args.out, len(lengths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="packed rows per step")
    ap.add_argument("--shape", default="2,2,64", help="GPT-2 layers,heads,width")
    args = parse_trl_bench(ap, ".cache/bench_sft", "chats")
    if args.child:
        run_trl(args)
        return
    os.makedirs(args.work, exist_ok=True)
    chats, n = whole_conversations(args.seq_len, Path(args.work))
    args.chats = str(chats)

    def run(way: str, r: int) -> dict:
        out = os.path.join(args.work, f"{way}_{r}.json")
        keys = ("steps", "warmup", "seq_len", "batch", "shape", "work")
        cmd = (
            trl_child("bench.compare.sft", args, keys, chats=chats, out=out)
            if way == "trl"
            else template_cmd(args, out)
        )
        return run_way(cmd, way, out)

    results = interleaved(list(WAYS), args.rounds, run)
    print(
        f"GPT-2 {args.shape} (layers, heads, width), GPT-2 tokenizer, {n} conversations that fit {args.seq_len} "
        f"tokens, {args.batch} packed rows a step, fp32, {args.steps} steps ({args.warmup} warm-up), median of "
        f"{args.rounds} interleaved rounds, {os.cpu_count()} CPU cores"
    )
    print(f"{'way':<10}{'packed rows':>12}{'step ms':>9}{'real tokens/s':>15}")
    for way, runs in results.items():
        step, rate = (statistics.median(run[k] for run in runs) for k in ("step_s", "tokens_per_s"))
        print(f"{way:<10}{runs[0]['rows']:>12}{step * 1e3:9.1f}{rate:15.0f}")
    low, mid, high = paired_ratio(results["template"], results["trl"])
    print(f"template/trl real tokens/s = {mid:.3f}  [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    main()
