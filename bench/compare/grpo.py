"""GRPO throughput: the template (train.py, model/objective=grpo) against TRL's GRPOTrainer on the same prompts,
model, G and completion length, each phase apart.

    python -m bench.compare.grpo [--rounds 3 --steps 8 --warmup 2 --prompts 8 --generations 8 --new-tokens 16 --shape 2,2,64]

The prompts: the 100 single-digit sums "a+b=" (bench/learn/grpo_learning.py's task) with GPT-2's tokenizer; a fresh GPT-2
of `--shape` (seed 0, no dropout, SDPA) on both sides; `--prompts` prompts a step, each sampled `--generations`
times to `--new-tokens` tokens at temperature 1 (TRL stops a completion at its EOS, the template samples every token
and masks after it: an untrained model rarely writes an EOS that early, and the lengths are reported); an
exact-match reward; beta 0 (no reference model), fused AdamW at a constant LR, clipping 1.0, fp32, one update per
generation. Per step: the sampling phase (the template's `GRPO.sample` calls; TRL's `_generate`, each timed on the
host: a CPU's figure) and the rest of the step (scoring, the log-prob forward, backward, optimizer), as
completion tokens/s of sampling and sequence tokens (prompt + completion) /s of the rest. Each run a fresh process,
the ways interleaved round by round; ratios are the median of per-round ratios [lowest-highest].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L

from bench.common import (
    CLIP,
    LR,
    TOKENIZER,
    TRAINING_ONLY,
    interleaved,
    paired_ratio,
    parse_trl_bench,
    run_way,
    trl_child,
    trl_parts,
)
from bench.learn.grpo_learning import write_task

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("template", "trl")


def summary(step_s: list[float], sample_s: list[float], warmup: int, completion_tokens: float, tokens: float) -> dict:
    """Medians over the steps after `warmup`: the step, its sampling, and the two phases' rates."""
    step, sample = statistics.median(step_s[warmup:]), statistics.median(sample_s[warmup:])
    return {
        "step_s": step,
        "sampling_s": sample,
        "sampling_tokens_per_s": completion_tokens / sample,
        "rest_tokens_per_s": tokens / (step - sample),
        "completion_tokens": completion_tokens,
    }


class PhaseTimer(L.Callback):
    """The template's side: each step's wall time and the part of it GRPO spent sampling."""

    def __init__(self, warmup: int, out: str) -> None:
        self.warmup, self.out = warmup, out
        self.steps, self.sampling, self.tokens = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.t0, self.s0 = time.perf_counter(), pl_module.objective.sampling_seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        objective = pl_module.objective
        self.steps.append(time.perf_counter() - self.t0)
        self.sampling.append(objective.sampling_seconds - self.s0)
        self.tokens.append(int(batch["prompt_lengths"].sum()) * objective.G)

    def on_train_end(self, trainer, pl_module) -> None:
        objective = pl_module.objective
        # every token is sampled (and masked after an EOS)
        new = objective.G * trainer.datamodule.batch_size * objective.max_new_tokens
        prompts = statistics.fmean(self.tokens[self.warmup :])
        result = summary(self.steps, self.sampling, self.warmup, new, prompts + new)
        Path(self.out).write_text(json.dumps(result))


def template_cmd(args, prompts: Path, out: str) -> list[str]:
    layers, heads, width = args.shape.split(",")
    return [
        sys.executable,
        "train.py",
        "data=prompts",
        "model/objective=grpo",
        f"data.path={prompts}",
        f"data.tokenizer={TOKENIZER}",
        "data.seq_len=64",
        "data.val_fraction=0",
        "data.test_fraction=0",
        f"data.global_batch_size={args.prompts}",
        f"model.n_layer={layers}",
        f"model.n_head={heads}",
        f"model.n_embd={width}",
        "model.dropout=0.0",
        f"model.objective.num_generations={args.generations}",
        f"model.objective.max_new_tokens={args.new_tokens}",
        f"model.optimizer.lr={LR}",
        "model.scheduler=null",
        "model.weight_decay=0.0",
        f"trainer.max_steps={args.steps}",
        "trainer.precision=32-true",
        f"trainer.gradient_clip_val={CLIP}",
        *TRAINING_ONLY,
        f"paths.cache_dir={args.work}/cache",
        f"paths.log_dir={args.work}/logs",
        "+callbacks.timer._target_=bench.compare.grpo.PhaseTimer",
        f"+callbacks.timer.warmup={args.warmup}",
        f"+callbacks.timer.out={out}",
    ]


def run_trl(args) -> None:
    """TRL's GRPOTrainer: the same model (trl_parts), prompts, G, completion length, reward and optimizer."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args.batch = args.prompts * args.generations  # TRL counts completions per device batch
    tokenizer, model, _, _, common = trl_parts(args, n_positions=64)
    rows = [json.loads(line) for line in Path(args.prompts_file).read_text().splitlines()]

    def exact_match(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    common.pop("pad_token")  # GRPOConfig takes the tokenizer's: GPT-2's EOS (trl_parts)
    tokenizer.pad_token = tokenizer.eos_token
    config = GRPOConfig(
        **common,
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        beta=0.0,
        loss_type="grpo",
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    steps, sampling, lengths, prompt_tokens = [], [], [], []
    generate = trainer._generate

    def timed_generate(prompts, *a, **k):
        start = time.perf_counter()
        out = generate(prompts, *a, **k)
        sampling.append(time.perf_counter() - start)
        prompt_tokens.append(sum(map(len, out[0])))  # per completion: its prompt's ids, its own ids
        lengths.append(sum(map(len, out[1])))
        return out

    trainer._generate = timed_generate

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.t0)

    trainer.add_callback(Steps())
    trainer.train()
    completions = statistics.fmean(lengths[args.warmup :])
    result = summary(
        steps, sampling, args.warmup, completions, statistics.fmean(prompt_tokens[args.warmup :]) + completions
    )
    Path(args.out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts a step")
    ap.add_argument("--generations", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--shape", default="2,2,64", help="GPT-2 layers,heads,width")
    args = parse_trl_bench(ap, ".cache/bench_grpo", "prompts-file")
    if args.child:
        run_trl(args)
        return
    _, prompts = write_task(Path(args.work) / "data")

    def run(way: str, r: int) -> dict:
        out = os.path.join(args.work, f"{way}_{r}.json")
        keys = ("steps", "warmup", "prompts", "generations", "new_tokens", "shape", "work")
        if way == "trl":
            cmd = trl_child("bench.compare.grpo", args, keys, prompts_file=prompts, out=out)
        else:
            cmd = template_cmd(args, prompts, out)
        return run_way(cmd, way, out)

    results = interleaved(list(WAYS), args.rounds, run)
    print(
        f"GPT-2 {args.shape} (layers, heads, width), GPT-2 tokenizer, {args.prompts} prompts x {args.generations} "
        f"completions of {args.new_tokens} tokens a step, fp32, {args.steps} steps ({args.warmup} warm-up), "
        f"median of {args.rounds} interleaved rounds, {os.cpu_count()} CPU cores"
    )
    print(f"{'way':<10}{'step ms':>9}{'sampling ms':>13}{'completion tok':>16}{'sampling tok/s':>16}{'rest tok/s':>12}")
    for way, runs in results.items():
        row = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(
            f"{way:<10}{row['step_s'] * 1e3:9.1f}{row['sampling_s'] * 1e3:13.1f}{row['completion_tokens']:16.0f}"
            f"{row['sampling_tokens_per_s']:16.0f}{row['rest_tokens_per_s']:12.0f}"
        )
    for phase in ("sampling", "rest"):
        key = f"{phase}_tokens_per_s"
        low, mid, high = paired_ratio(
            [{"tokens_per_s": r[key]} for r in results["template"]], [{"tokens_per_s": r[key]} for r in results["trl"]]
        )
        print(f"template/trl {phase} tokens/s = {mid:.3f}  [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    main()
