"""GRPO learns a verifiable task on a CPU: single-digit sums ("3+4=" -> "7"), rewarded by exact match.

    python -m bench.learn.grpo_learning [--sft-steps 150 --grpo-steps 400 --work logs/grpo_learning]

1. Writes the task: the 100 prompts a+b= (a, b in 0..9) with their answers, as the SFT records (`data=instruct`,
   prompt template `{instruction}`) and as GRPO's prompts (`data=prompts`), under --work/data.
2. A short SFT of a 2-layer, 64-wide GPT-2 from scratch (bytes): it learns the answer's form and some sums.
3. GRPO from that checkpoint, `experiment=gpt2_grpo`: each step samples G=8 completions of 8 prompts, exact-match
   reward against the answer.
Prints the mean reward of GRPO's steps by tenths of the run, and the held-out sums' (20 %) mean reward at each
quarter. Each stage is a train.py run in a fresh process, as a user would run it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["model=gpt2", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.dropout=0.0"]


def write_task(data: Path) -> tuple[Path, Path]:
    data.mkdir(parents=True, exist_ok=True)
    sums = [(a, b) for a in range(10) for b in range(10)]
    sft, prompts = data / "sums_sft.json", data / "sums_prompts.jsonl"
    sft.write_text(json.dumps([{"instruction": f"{a}+{b}=", "output": str(a + b)} for a, b in sums]))
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in sums))
    return sft, prompts


def train(args: list[str]) -> None:
    cmd = [sys.executable, "train.py", "extras.print_config=false", "trainer.enable_progress_bar=false", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = (log_dir / "train" / "runs").iterdir()
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--grpo-steps", type=int, default=400)
    parser.add_argument("--work", type=Path, default=ROOT / "logs" / "grpo_learning")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    work = opts.work.resolve()
    for stage in ("sft", "grpo"):  # a fresh run of each
        shutil.rmtree(work / stage, ignore_errors=True)
    sft_data, prompts = write_task(work / "data")
    common = SHAPE + [
        f"seed={opts.seed}",
        "logger=tensorboard",
        "callbacks.generate_text=null",
        "trainer.log_every_n_steps=5",
    ]
    train(
        common
        + [
            "data=instruct",
            f"data.path={sft_data}",
            "data.template_no_input='{instruction}'",
            "data.seq_len=16",
            "data.val_fraction=0.1",
            "data.test_fraction=0.0",
            "data.global_batch_size=16",
            f"trainer.max_steps={opts.sft_steps}",
            f"trainer.val_check_interval={opts.sft_steps}",
            "callbacks.model_checkpoint=null",
            "test=false",
            "model.optimizer.lr=3e-3",
            "model.scheduler.num_warmup_steps=20",
            f"paths.log_dir={work / 'sft'}",
        ]
    )
    (sft_run,) = (work / "sft" / "train" / "runs").iterdir()
    train(
        common
        + [
            "experiment=gpt2_grpo",
            f"model.pretrained={sft_run / 'checkpoints' / 'last.ckpt'}",
            f"data.path={prompts}",
            f"trainer.max_steps={opts.grpo_steps}",
            f"trainer.val_check_interval={max(1, opts.grpo_steps // 4)}",
            f"paths.log_dir={work / 'grpo'}",
        ]
    )
    rewards = [v for _, v in scalars(work / "grpo", "train/reward")]
    tenth = max(1, len(rewards) // 10)
    means = [sum(rewards[i : i + tenth]) / len(rewards[i : i + tenth]) for i in range(0, len(rewards), tenth)]
    print(f"GRPO train/reward by tenths of {len(rewards)} steps: " + " ".join(f"{m:.3f}" for m in means))
    held_out = " ".join(f"step {s}: {v:.3f}" for s, v in scalars(work / "grpo", "val/reward"))
    print(f"held-out val/reward (G samples of each of the 20 held-out sums): {held_out}")


if __name__ == "__main__":
    main()
