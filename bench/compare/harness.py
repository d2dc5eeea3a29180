"""Benchmark throughput: the template's lm-eval LM (src/lm/callbacks/harness.py: batches by length, one forward each) against lm-eval's own
`hf` backend (batched, padded) on the export-hf of the same checkpoint, the same tasks and documents.

    python -m bench.compare.harness [--ckpt PATH] [--tasks T ...] [--include-path DIR] [--limit N] [--rounds 3]

Without --ckpt a tiny GPT-2 is trained first (train.py, 2 steps, GPT-2's tokenizer); without --tasks three local tasks are written (a
multiple-choice, a rolling log-likelihood and a generate-until one, as tests/test_benchmarks.py's). Both ways run in
this process with their model built beforehand; a round times one lm-eval `simple_evaluate` of each (the task set-up
included on both sides), who goes first rotating; printed: documents/s of each way and the ratio template/hf, the
median of per-round ratios [lowest-highest]. Scores are not compared here: tests/test_benchmarks.py does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import TOKENIZER, interleaved

ROOT = Path(__file__).resolve().parents[2]


def write_task(root: Path, name: str, data: list[dict], body: str) -> None:
    """One local lm-eval task in `root`: its documents as JSONL and a YAML reading them (`body`: its output type,
    prompts and metrics)."""
    (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}.jsonl\n"
        f"test_split: test\n{body}"
    )


def local_tasks(root: Path) -> tuple[list[str], Path]:
    """Three small lm-eval tasks (YAML and JSONL documents) in `root`: their names and the include path."""

    def task(name: str, data: list[dict], body: str) -> None:
        write_task(root, name, data, body)

    words = ["mat", "dog", "tree", "sky"]
    task("bench_mc", [{"q": f"Q{i}: the cat sat on the", "choices": words, "answer": i % 4} for i in range(200)],
         'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
         "metric_list:\n  - metric: acc\n")  # fmt: skip
    task("bench_roll", [{"text": "The quick brown fox jumps over the lazy dog. " * k} for k in range(1, 41)],
         'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
         "metric_list:\n  - metric: word_perplexity\n")  # fmt: skip
    task("bench_gen", [{"q": f"Say {w}:", "a": w} for w in words * 6],
         'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
         'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
         "metric_list:\n  - metric: exact_match\n")  # fmt: skip
    return ["bench_mc", "bench_roll", "bench_gen"], root


def tiny_checkpoint(work: Path) -> Path:
    """A 2-step GPT-2 run on the tests' corpus (fp32, GPT-2's tokenizer, as lm-eval's hf backend needs): its last.ckpt."""
    args = [f"data.path={ROOT / 'tests' / 'data' / 'tiny_corpus.txt'}", "data.seq_len=64", "model.n_layer=2",
            "model.n_embd=64", "model.n_head=2", "data.global_batch_size=8", "trainer.max_steps=2", "test=false",
            "trainer.val_check_interval=2", "trainer.precision=32-true", "extras.print_config=false",
            "trainer.enable_progress_bar=false", f"data.tokenizer={TOKENIZER}", f"paths.log_dir={work / 'logs'}", f"paths.cache_dir={work / 'cache'}"]  # fmt: skip
    subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, check=True, capture_output=True)
    return next((work / "logs").rglob("checkpoints/last.ckpt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="a train.py checkpoint (default: a tiny GPT-2 trained here)")
    ap.add_argument("--tasks", nargs="+", help="lm-eval task names (default: three local tasks written here)")
    ap.add_argument("--include-path", help="a dir of your own lm-eval task YAMLs")
    ap.add_argument("--limit", type=float, default=None, help="the first N documents of each task")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="requests a forward, on both sides")
    args = ap.parse_args()
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from src.checkpoint.convert import build_module, export_hf, load_checkpoint
    from src.lm.callbacks import harness as benchmarks

    torch.set_grad_enabled(False)
    work = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    ckpt = Path(args.ckpt) if args.ckpt else tiny_checkpoint(work)
    tasks, include = (args.tasks, args.include_path) if args.tasks else local_tasks(work)
    module, datamodule = build_module(load_checkpoint(ckpt))
    hf = HFLM(pretrained=str(export_hf(ckpt, work / "hf")), device="cpu", dtype="float32", batch_size=args.batch_size)
    cfg = SimpleNamespace(tasks=tasks, include_path=str(include) if include else None, num_fewshot=None,
                          limit=args.limit, seed=0, batch_size=args.batch_size)  # fmt: skip

    def run(way: str, _round: int) -> dict:
        start = time.perf_counter()
        if way == "template":
            out = benchmarks.evaluate(module.model, datamodule.tokenizer, cfg)
            docs = sum(len(rows) for rows in out["samples"].values())
        else:
            out = simple_evaluate(model=hf, tasks=tasks, task_manager=benchmarks.task_manager(cfg), limit=args.limit, random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, log_samples=True)  # fmt: skip
            docs = sum(len(rows) for rows in out["samples"].values())
        seconds = time.perf_counter() - start
        print(f"  {way}: {docs} documents in {seconds:.2f} s", flush=True)
        return {"docs_per_s": docs / seconds}

    results = interleaved(["template", "hf"], args.rounds, run)
    ratios = [a["docs_per_s"] / b["docs_per_s"] for a, b in zip(results["template"], results["hf"])]
    for way, rows in results.items():
        print(f"{way:>8}: {statistics.median(r['docs_per_s'] for r in rows):.1f} documents/s (median of {args.rounds})")
    print(f"template/hf documents/s: {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
          f" (hf batch size {args.batch_size}; tasks {', '.join(tasks)})")  # fmt: skip


if __name__ == "__main__":
    main()
