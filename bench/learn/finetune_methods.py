"""The fine-tuning methods side by side on the same data and steps: val loss, step time, peak memory.

    python -m bench.learn.finetune_methods [--base-steps 300 --steps 60 --work logs/finetune_methods]

1. A base: GPT-2 4 layers x 128 (bytes) pretrained on tinyshakespeare for --base-steps steps.
2. From that checkpoint, each method fine-tunes on Alpaca's demo records (data=instruct, loss on the responses) for
   --steps steps, global batch 8, each at its usual learning rate (METHODS), fp32; every run a fresh train.py process.
Prints, per method: trainable parameters, val/loss after the steps (all 50 held-out records), the step time (the
fastest window of train/device/batches_per_sec after the first: another job's load only slows a window) and rank 0's
peak memory (the process's peak RSS on a CPU).
A measurement on one small model: the losses compare the methods at this budget, not at convergence.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
SHAPE = ["model=gpt2", "model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.dropout=0.0"]
METHODS = {  # name -> (overrides, learning rate)
    "full": ([], 1e-3),
    "lora r=8 (c_attn)": (["model.lora.enabled=true", "model.lora.dropout=0.0"], 3e-3),
    "prefix tuning 16": (["model/peft=prefix_tuning"], 1e-2),
    "prompt tuning 16": (["model/peft=prompt_tuning"], 3e-2),
    "p-tuning 16 (MLP)": (["model/peft=p_tuning"], 3e-3),
    "bottleneck r=16": (["model/peft=bottleneck_adapters"], 3e-3),
    "freeze all_but_head": (["model.freeze=all_but_head"], 1e-3),
    "freeze first 2 blocks": (["model.freeze={first_k_blocks: 2}"], 1e-3),
}


def train(args: list[str]) -> str:
    cmd = [sys.executable, "train.py", "extras.print_config=false", "trainer.enable_progress_bar=false", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def scalars(log_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = (log_dir / "train" / "runs").iterdir()
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--work", type=Path, default=ROOT / "logs" / "finetune_methods")
    parser.add_argument("--base", type=Path, default=None, help="a base checkpoint from an earlier run: skip step 1")
    parser.add_argument("--only", nargs="*", default=list(METHODS), help="these methods (METHODS' names)")
    parser.add_argument("--record", type=Path, default=None, help="append each method's figures to this .jsonl")
    opts = parser.parse_args()
    work = opts.work.resolve()
    common = SHAPE + [f"paths.cache_dir={work / 'cache'}", "seed=0", "logger=tensorboard", "callbacks.generate_text=null",
                      "trainer.precision=32-true", "trainer.num_sanity_val_steps=0", "test=false"]  # fmt: skip
    base = opts.base
    if base is None:
        shutil.rmtree(work, ignore_errors=True)
        train(common + [
            f"data.path={SHARED / 'tinyshakespeare' / 'input.txt'}", "data.seq_len=128", "data.global_batch_size=16",
            f"trainer.max_steps={opts.base_steps}", f"trainer.val_check_interval={opts.base_steps}",
            "trainer.limit_val_batches=4", f"paths.log_dir={work / 'base'}", "+model.config.max_position_embeddings=512",
        ])  # fmt: skip
        (run,) = (work / "base" / "train" / "runs").iterdir()
        base = run / "checkpoints" / "last.ckpt"
    records = []
    for name in opts.only:
        overrides, lr = METHODS[name]
        log_dir = work / "".join(c if c.isalnum() else "_" for c in name)
        shutil.rmtree(log_dir, ignore_errors=True)
        out = train(common + overrides + [
            f"model.pretrained={base}", "data=instruct", "data.tokenizer=bytes",
            f"data.path={SHARED / 'alpaca' / 'alpaca_en_demo.json'}", "data.seq_len=256", "data.global_batch_size=8",
            f"model.optimizer.lr={lr}", "model.scheduler.num_warmup_steps=5", f"trainer.max_steps={opts.steps}",
            f"trainer.val_check_interval={opts.steps}", "trainer.log_every_n_steps=5",
            f"callbacks.throughput.window_size={max(2, opts.steps // 4)}", f"paths.log_dir={log_dir}",
        ])  # fmt: skip
        trainable = next(
            (line.split("Trainable params:")[1].strip() for line in out.splitlines() if "Trainable params:" in line),
            "?",
        )
        rates = scalars(log_dir, "train/device/batches_per_sec")
        record = {
            "method": name,
            "lr": lr,
            "trainable": trainable,
            "val_loss": round(scalars(log_dir, "val/loss")[-1], 4),
            # the fastest window but the first (compile-free warm-up aside): on a shared machine the least disturbed
            "step_ms": round(1000 / max(rates[1:] or rates), 1),
            "peak_mib": round(scalars(log_dir, "train/device/peak_memory_mib")[-1]),
        }
        print(json.dumps(record), flush=True)
        records.append(record)
    if opts.record is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        stamp = {"date": datetime.date.today().isoformat(), "machine": "AMD EPYC, 2 vCPUs", "commit": commit.stdout.strip(),
                 "bench": f"python -m bench.learn.finetune_methods --base-steps {opts.base_steps} --steps {opts.steps}"}  # fmt: skip
        with open(opts.record, "a") as f:
            for record in records:
                f.write(json.dumps({**stamp, **record}) + "\n")


if __name__ == "__main__":
    main()
