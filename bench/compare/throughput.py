"""Training throughput, three ways, same model / data / global batch / optimizer (fused AdamW) / precision:
(a) the template (train.py itself), (b) a minimal raw PyTorch loop, (c) transformers.Trainer; and
(d) `hf_default`: transformers.Trainer as it comes, fp32 and SDPA attention unless told otherwise;
(e) `hf_compile`: (c) with TrainingArguments(torch_compile=True). On a GPU (`--device`, default: one if torch sees
it) every way trains there and a step is timed after torch.cuda.synchronize().

    python -m bench.compare.throughput [--steps 30 --warmup 5 --rounds 3 --shapes small,medium --precision auto]
    python -m bench.compare.throughput --variants "foreach=model.optimizer.fused=false" "compile=model.compile=true"
    python -m bench.compare.throughput --shapes overhead --steps 300 --warmup 50   # the loops' own cost per step
    python -m bench.compare.throughput --model llama --ways template,raw,hf      # Llama (qwen2, mistral) of each shape
    python -m bench.compare.throughput --model llama --tokenizer ../shared/data/gpt2-tokenizer  # a real 50257-token vocabulary
    python -m bench.compare.throughput --shapes gpu --ways template,raw,hf,hf_compile --variants compile=model.compile=true
    python -m bench.compare.throughput --shapes small --nanogpt --ways template,raw,hf   # also against nanoGPT (fp32),
                                                      # as it comes (no biases) and with GPT-2's biases
    python -m bench.compare.throughput --shapes gpu --tokenizer ../shared/data/gpt2-tokenizer --ways template \
        --variants compile=model.compile=true --nanogpt-repo DIR   # nanoGPT's own train.py, compiled on a GPU

Each run is a fresh process; all ways are interleaved round by round, so a noisy machine hits
them alike, and each reports the median time between optimizer steps after the warm-up, tokens/s
and peak RSS (on a GPU also peak GPU memory, and MFU: tokens/s x flops_per_token() / the GPU's dense peak from
the throughput callback's table). Ratios (template/raw, template/HF, ...) are the median over rounds of each round's
ratio, with the lowest and highest in brackets: that spread is the machine's noise. A variant is
the template with extra overrides (NAME=OVERRIDE[,OVERRIDE...]), to measure one switch at a time.

`--clock cpu` (for a busy, shared machine): every way runs on 1 thread (OMP_NUM_THREADS=1) and
steps are timed in process CPU seconds, which other processes' load changes far less; on a machine
at load 18 on 2 cores, wall time gave 6.0 s (template) and 9.1 s (raw loop) for a ~0.1 s step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.common import (
    BETAS,
    CLIP,
    LR,
    SHAPES,
    TRAINING_ONLY,
    WD,
    arch_fields,
    clock,
    data_and_model,
    device,
    paired_ratio,
    param_groups,
    report,
    resolve_precision,
)

NANOGPT_REPO = ("nanogpt_repo", "nanogpt_repo_gpt2")  # --nanogpt-repo's ways (bench/compare/nanogpt_repo.py)
MODELS = ("gpt2", "llama", "qwen2", "mistral")  # --model; the others than GPT-2 as conf/model/<name>.yaml builds them


def vocab_size(tokenizer: str) -> int:
    """The vocabulary every way trains with."""
    from src.lm.data.text import TextDataModule

    return TextDataModule(tokenizer=tokenizer).vocab_size


def raw_loop(
    shape: str,
    cache_dir: str,
    precision: str,
    steps: int,
    attn: str = "auto",
    model_type: str = "gpt2",
    tokenizer: str = "bytes",
) -> list[list[float]]:
    """The minimal PyTorch loop; per step, the times at which it has its batch, ends forward, ends
    backward and ends the optimizer step, after a start time (bench.profile.step_breakdown reads the phases)."""
    import torch

    dm, model = data_and_model(shape, cache_dir, attn, precision, model_type=model_type, tokenizer=tokenizer)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, fused=True)  # as the template's default
    autocast = torch.autocast(device(), dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    batches, times = iter(dm.train_dataloader()), []
    model.train()
    for _ in range(steps):
        t = [clock()]
        batch = {k: v.to(device(), non_blocking=True) for k, v in next(batches).items()}
        t.append(clock())
        with autocast:
            logits = model(input_ids=batch["input_ids"]).logits  # labels are already shifted (src/datamodules)
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
            )
        t.append(clock())
        loss.backward()
        t.append(clock())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(clock())
        times.append(t)
    return times


def run_raw(args) -> None:
    times = raw_loop(
        args.shape, args.cache_dir, args.precision, args.steps, model_type=args.model, tokenizer=args.tokenizer
    )
    layers, heads, width, ctx, batch = SHAPES[args.shape]
    report([t[-1] for t in times], args.warmup, batch * ctx, args.out)


def run_nanogpt(args, bias: bool = False) -> None:
    """bench/compare/nanogpt.py: a nanoGPT-style GPT and loop on the same tokens, always fp32 (nanoGPT on a CPU).
    bias=False is nanoGPT's default; bias=True (the way nanogpt_bias) is GPT-2's architecture, the template's."""
    from bench.compare import nanogpt

    dm, _ = data_and_model(args.shape, args.cache_dir, "sdpa", "32-true")
    tokens = dm.splits["train"].tokens
    times = nanogpt.train(tokens, dm.vocab_size, SHAPES[args.shape], args.steps, LR, BETAS, WD, CLIP, clock, bias)
    layers, heads, width, ctx, batch = SHAPES[args.shape]
    report(times, args.warmup, batch * ctx, args.out)


def run_nanogpt_repo(args, as_it_comes: bool) -> None:
    """nanoGPT's own train.py from the checkout --nanogpt-repo (bench/compare/nanogpt_repo.py says how it is run)."""
    from bench.compare import nanogpt_repo

    dm, _ = data_and_model(args.shape, args.cache_dir, "sdpa", "32-true", tokenizer=args.tokenizer)
    compile = {"auto": device() == "cuda", "true": True, "false": False}[args.nanogpt_compile]
    optimizer = {"lr": LR, "betas": BETAS, "weight_decay": WD, "clip": CLIP}
    work = os.path.join(os.path.dirname(args.out), f"{args.child}_{args.shape}")
    nanogpt_repo.run(args.nanogpt_repo, dm.splits["train"].tokens, dm.vocab_size, SHAPES[args.shape], args.steps,
                     args.warmup, optimizer, device(), args.precision, compile, as_it_comes, work, args.out)  # fmt: skip


def run_hf(args, defaults: bool = False, compile: bool = False) -> None:
    """defaults=True: no bf16 and transformers' own attention choice (SDPA), as a user starts out.
    compile=True: TrainingArguments(torch_compile=True), transformers' own switch for torch.compile."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    precision = "32-true" if defaults else args.precision
    dm, model = data_and_model(
        args.shape,
        args.cache_dir,
        attn="sdpa" if defaults else "auto",
        precision=precision,
        activation=args.hf_activation,
        model_type=args.model,
        tokenizer=args.tokenizer,
    )
    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, *a, **k):
            times.append(clock())

    targs = TrainingArguments(
        output_dir=os.path.join(args.cache_dir, "hf_trainer"),
        per_device_train_batch_size=dm.batch_size,
        max_steps=args.steps,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        weight_decay=WD,
        max_grad_norm=CLIP,
        optim="adamw_torch_fused",
        lr_scheduler_type="constant",
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        use_cpu=device() == "cpu",
        torch_compile=compile,
        bf16=precision == "bf16-mixed",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=model, args=targs, train_dataset=dm.splits["train"], callbacks=[Timer()]).train()
    report(times, args.warmup, dm.batch_size * dm.seq_len, args.out)


def template_cmd(args, out: str, extra: list[str] = ()) -> list[str]:
    layers, heads, width, ctx, batch = SHAPES[args.shape]
    prefix = "model." if args.model == "gpt2" else "model.config."
    shape = [f"model={args.model}", *(f"{prefix}{k}={v}" for k, v in arch_fields(args.model, args.shape).items())]
    return [
        sys.executable,
        "train.py",
        *shape,
        f"data.seq_len={ctx}",
        f"data.global_batch_size={batch}",
        f"data.tokenizer={args.tokenizer}",
        f"trainer.max_steps={args.steps}",
        f"trainer.precision={args.precision}",
        f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
        *TRAINING_ONLY,
        "model.scheduler=null",
        f"paths.cache_dir={os.path.dirname(args.cache_dir)}",
        f"paths.log_dir={args.cache_dir}/logs",
        "+callbacks.timer._target_=bench.common.StepTimer",
        f"+callbacks.timer.warmup={args.warmup}",
        f"+callbacks.timer.out={out}",
        *extra,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="small,medium")
    ap.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "32-true", "bf16-mixed"],
        help="for all three ways; auto: what train.py picks on this machine",
    )
    ap.add_argument("--cache-dir", default=".cache/bench")
    ap.add_argument("--variants", nargs="*", default=[], help="NAME=override[,override...] template variants")
    ap.add_argument(
        "--nanogpt",
        action="store_true",
        help="add the ways nanogpt (bench/compare/nanogpt.py, fp32, nanoGPT's default bias=False) and nanogpt_bias "
        "(the same with bias=True: GPT-2's architecture, biases in every Linear and LayerNorm)",
    )
    ap.add_argument(
        "--nanogpt-repo",
        help="a checkout of karpathy/nanoGPT: add the ways nanogpt_repo (its train.py as it comes) and "
        "nanogpt_repo_gpt2 (the same with GPT-2's biases and exact vocabulary); bench/compare/nanogpt_repo.py",
    )
    ap.add_argument(
        "--nanogpt-compile",
        default="auto",
        choices=["auto", "true", "false"],
        help="nanoGPT's compile= for the nanogpt_repo ways; auto: on a GPU (its default), not on a CPU",
    )
    ap.add_argument("--model", default="gpt2", choices=MODELS, help="the architecture every way trains")
    ap.add_argument(
        "--tokenizer",
        default="bytes",
        help="every way's tokenizer: bytes (257 ids, a tiny LM head) or a HF tokenizer dir, e.g. "
        "../shared/data/gpt2-tokenizer (50257 ids: the LM head and loss of a real vocabulary)",
    )
    ap.add_argument("--ways", default="template,raw,hf,hf_default", help="which of the fixed ways to run")
    ap.add_argument(
        "--hf-activation",
        default="gelu_new",
        help="GPT-2's activation in the HF Trainer ways: GPT2Config's default gelu_new (what a transformers "
        "user gets), or gelu_pytorch_tanh (the template's) to compare the loops alone",
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="cpu: 1 thread per run, timed in process CPU seconds (for a busy machine)",
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where every way trains; auto: the GPU if torch sees one (the template as trainer.accelerator=gpu)",
    )
    ap.add_argument(
        "--child",
        choices=["raw", "hf", "hf_default", "hf_compile", "nanogpt", "nanogpt_bias", *NANOGPT_REPO],
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cache_dir = os.path.abspath(os.path.join(args.cache_dir, "tokens"))
    if os.path.isdir(args.tokenizer):  # the same directory for train.py, whatever its working directory
        args.tokenizer = os.path.abspath(args.tokenizer)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ["BENCH_DEVICE"] = args.device  # inherited by every run
    args.precision = resolve_precision(args.precision)
    if args.clock == "cpu":
        os.environ.update(BENCH_CLOCK="cpu", OMP_NUM_THREADS="1")  # inherited by every run
    if args.child:
        {
            "raw": run_raw,
            "hf": run_hf,
            "hf_default": lambda a: run_hf(a, defaults=True),
            "hf_compile": lambda a: run_hf(a, compile=True),
            "nanogpt": run_nanogpt,
            "nanogpt_bias": lambda a: run_nanogpt(a, bias=True),
            "nanogpt_repo": lambda a: run_nanogpt_repo(a, as_it_comes=True),
            "nanogpt_repo_gpt2": lambda a: run_nanogpt_repo(a, as_it_comes=False),
        }[args.child](args)
        return
    results: dict = {}
    variants = {v.split("=", 1)[0]: v.split("=", 1)[1].split(",") for v in args.variants}
    for shape in args.shapes.split(","):
        for r in range(args.rounds):
            ways = [
                *args.ways.split(","),
                *(["nanogpt", "nanogpt_bias"] if args.nanogpt else []),
                *(NANOGPT_REPO if args.nanogpt_repo else []),
                *variants,
            ]
            k = r % len(ways)
            for way in ways[k:] + ways[:k]:  # rotate who goes first
                out = os.path.join(os.path.dirname(args.cache_dir), f"{shape}_{way}_{r}.json")
                args.shape = shape
                if way == "template" or way in variants:
                    cmd = template_cmd(args, out, variants.get(way, []))
                else:
                    cmd = [
                        sys.executable,
                        "-m",
                        "bench.compare.throughput",
                        "--child",
                        way,
                        "--shape",
                        shape,
                        "--out",
                        out,
                        f"--steps={args.steps}",
                        f"--warmup={args.warmup}",
                        f"--precision={args.precision}",
                        f"--hf-activation={args.hf_activation}",
                        f"--model={args.model}",
                        f"--tokenizer={args.tokenizer}",
                        f"--cache-dir={os.path.dirname(args.cache_dir)}",
                        *([f"--nanogpt-repo={args.nanogpt_repo}"] if args.nanogpt_repo else []),
                        f"--nanogpt-compile={args.nanogpt_compile}",
                    ]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:  # reported, and the other ways go on: that round has no figure for it
                    print(
                        f"{shape} {way} round {r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr
                    )
                    results.setdefault(shape, {}).setdefault(way, []).append(None)
                    continue
                with open(out) as f:
                    results.setdefault(shape, {}).setdefault(way, []).append(json.load(f))
    print(
        f"model {args.model}, precision {args.precision}, {args.steps} steps ({args.warmup} warm-up), median of {args.rounds} "
        f"interleaved rounds, {os.cpu_count()} CPU cores, clock {args.clock}, device {args.device}, "
        f"tokenizer {args.tokenizer} ({vocab_size(args.tokenizer)} tokens)"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    )
    gpu = args.device == "cuda"
    print(
        f"{'shape':<10}{'way':<18}{'step ms':>9}{'tokens/s':>11}{'peak RSS MiB':>14}"
        + ("  peak GPU MiB    MFU" if gpu else "")
        + "  warm-up s"  # train.py's ways: the warm-up steps beyond as many median steps (compiling: what it must repay)
    )
    for shape, ways in results.items():
        ways = {w: runs for w, runs in ways.items() if any(runs)}  # a way that failed in every round has no line
        med = {}
        for w, runs in ways.items():
            done = [r for r in runs if r]
            med[w] = {k: statistics.median(r[k] for r in done) for k in done[0] if k != "steps_s"}  # numbers
        peak = gpu_peak(args.precision) if gpu else None
        for way, m in med.items():
            mfu = m["tokens_per_s"] * flops_per_token(args.model, shape, args.tokenizer) / peak if peak else None
            print(
                f"{shape:<10}{way:<18}{m['step_s'] * 1e3:9.1f}{m['tokens_per_s']:11.0f}{m['peak_rss_mib']:14.0f}"
                + (f"{m['peak_gpu_mib']:14.0f}" if gpu else "")
                + (f"{mfu:7.1%}" if mfu is not None else "")
                + (f"{m['warmup_extra_s']:11.1f}" if "warmup_extra_s" in m else "")
            )
        from src.utils.machine import fastest_attention

        layers, heads, width, ctx, batch = SHAPES[shape]
        attn = fastest_attention(args.device, args.precision, ctx)
        print(f"{shape:<10}attention {attn}, train.py's choice, in all ways but hf_default (fp32, sdpa)")
        ratios = {
            f"template/{way}": (way, "template")
            for way in ("raw", "hf", "hf_default", "hf_compile", "nanogpt", "nanogpt_bias", *NANOGPT_REPO)
            if way in ways and "template" in ways
        }
        ratios.update({f"{name}/template": ("template", name) for name in variants if "template" in ways})
        for base in ("nanogpt", *NANOGPT_REPO):
            ratios.update({f"{name}/{base}": (base, name) for name in variants if base in ways})
        for base in ("hf", "hf_compile"):  # a variant (e.g. compile) against HF Trainer
            ratios.update({f"{name}/{base}": (base, name) for name in variants if base in ways})
        for label, (below, above) in ratios.items():
            if below not in ways or above not in ways:
                continue
            low, mid, high = paired_ratio(ways[above], ways[below])
            print(f"{shape:<10}{label:<20} = {mid:.3f}  [{low:.3f}-{high:.3f}]")


def flops_per_token(model: str, shape: str, tokenizer: str) -> float:
    """Training FLOPs per token of GPT-2 of `shape` with the tokenizer's vocabulary, one convention for every way
    (src/lm/features/flops.py's, PaLM's): 6 per matmul weight (12·d² a block, V·d the LM head) + 12·L·d·T attention.
    Other models: NaN (their MFU is what train.py's callback logs)."""
    if model != "gpt2":
        return float("nan")
    layers, heads, width, ctx, batch = SHAPES[shape]
    return 6 * (12 * layers * width**2 + vocab_size(tokenizer) * width) + 12 * layers * width * ctx


def gpu_peak(precision: str):
    """This GPU's dense peak FLOP/s in the precision's matmul dtype (the throughput callback's table), or None."""
    import torch

    from src.callbacks.throughput import available_flops, compute_dtype

    return available_flops(torch.device("cuda", 0), compute_dtype(precision))


if __name__ == "__main__":
    main()
