"""Corpus scale: cold build, warm start and tokenizer throughput on a generated corpus (docs/data.md).

    nice -n 10 python -m bench.scale.corpus_scale --size-mb 300      # while developing on a shared machine
    python -m bench.scale.corpus_scale                               # the issue's 2 GB figure, on a quiet machine

Generates a JSONL corpus of --size-mb (tinyshakespeare cut into ~3 KB documents, each with its own counter,
as in the issue) in a temp dir that is deleted at exit, then measures, each in a fresh process:
- cold build: `python train.py data.path=big.jsonl` to its first optimizer step with an empty token cache,
  wall time and peak RSS;
- warm start: the same with the cache built, for the big corpus and for the default ~5 MB corpus (the
  Python stdlib), interleaved, and the ratio of their medians (goal: <= 1.5x, RSS independent of size);
- text -> tokens MB/s of the token-cache build (load_or_build) for the byte tokenizer and GPT-2 BPE
  (/work/shared/data/gpt2-tokenizer), beside nanoGPT's way on the same text: datasets.load_dataset("json")
  then .map(num_proc=N) and one np.memmap written from the shards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
TINY_MODEL = [
    "model.n_layer=1",
    "model.n_embd=64",
    "model.n_head=2",
    "data.seq_len=128",
    "data.global_batch_size=8",
    "data.tokenizer=bytes",
    "test=false",
    "optimized_metric=null",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",  # stopping after step 1 would otherwise run a whole validation
    "extras.print_config=false",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "callbacks=none",
    "trainer.precision=32-true",
    "+callbacks.first._target_=bench.profile.startup.FirstStep",
]


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(seconds to the FIRST_STEP_AT marker or to exit, peak RSS in MB of the process, stdout)."""
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        _, status, usage = os.wait4(proc.pid, 0)
        end = time.time()
        out.seek(0)
        text = out.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{text[-3000:]}")
    marks = [line for line in text.splitlines() if line.startswith("FIRST_STEP_AT")]
    return (float(marks[0].split()[1]) if marks else end) - t0, usage.ru_maxrss / 1024, text


def make_corpus(path: Path, size_mb: int) -> int:
    text = (SHARED / "tinyshakespeare" / "input.txt").read_text()
    pieces = [text[i : i + 3000] for i in range(0, len(text), 3000)]
    n, written = 0, 0
    with path.open("w") as f:
        while written < size_mb * 1_000_000:
            line = json.dumps({"text": f"[document {n}]\n{pieces[n % len(pieces)]}"}) + "\n"
            f.write(line)
            written, n = written + len(line), n + 1
    return n


BUILD = """
import sys, time
from src.lm.data.corpus import Corpus
from src.lm.data.token_cache import load_or_build
from src.lm.data.tokenizers import load_tokenizer
tok = load_tokenizer(sys.argv[2])
t0 = time.perf_counter()
tokens = load_or_build(Corpus.from_config(sys.argv[1], None, "train", "text"), tok, sys.argv[3])
print("BUILD", time.perf_counter() - t0, len(tokens))
"""

NANOGPT = """
import sys, time, numpy as np, datasets
from transformers import GPT2TokenizerFast
datasets.disable_progress_bars()
tok = GPT2TokenizerFast.from_pretrained(sys.argv[2])
eot = tok.eos_token_id
t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
t1 = time.perf_counter()
def process(example):  # nanoGPT data/openwebtext/prepare.py, with the HF GPT-2 tokenizer for tiktoken
    ids = tok(example["text"], add_special_tokens=False)["input_ids"] + [eot]
    return {"ids": ids, "len": len(ids)}
tokenized = ds.map(process, remove_columns=["text"], num_proc=int(sys.argv[4]))
total = int(np.sum(tokenized["len"], dtype=np.uint64))
arr = np.memmap(sys.argv[3] + "/train.bin", dtype=np.uint16, mode="w+", shape=(total,))
idx = 0
for i in range(1024 if len(tokenized) >= 1024 else 1):
    batch = tokenized.shard(num_shards=1024 if len(tokenized) >= 1024 else 1, index=i, contiguous=True).with_format("numpy")
    chunk = np.concatenate(batch["ids"])
    arr[idx : idx + len(chunk)] = chunk
    idx += len(chunk)
arr.flush()
print("NANOGPT", time.perf_counter() - t1, t1 - t0, total)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=2000, help="size of the generated JSONL corpus (MB)")
    ap.add_argument("--repeats", type=int, default=3, help="warm starts per corpus (interleaved)")
    ap.add_argument("--num-proc", type=int, default=os.cpu_count(), help="nanoGPT's datasets.map(num_proc=...)")
    ap.add_argument("--skip-nanogpt", action="store_true")
    ap.add_argument("--skip-bpe", action="store_true", help="skip the GPT-2 BPE throughput runs (slow on few cores)")
    args = ap.parse_args()
    gpt2 = str(SHARED / "gpt2-tokenizer")
    with tempfile.TemporaryDirectory(prefix="corpus_scale_") as tmp:
        tmp = Path(tmp)
        big = tmp / "big.jsonl"
        n_docs = make_corpus(big, args.size_mb)
        mb = big.stat().st_size / 1e6
        print(
            f"corpus: {big.stat().st_size / 1e9:.2f} GB, {n_docs:,} documents (CPU: {os.cpu_count()} cores)", flush=True
        )
        train = [sys.executable, "train.py", *TINY_MODEL, f"paths.log_dir={tmp / 'logs'}"]
        big_args, small_args = (
            [f"data.path={big}", f"paths.cache_dir={tmp / 'cache'}"],
            [f"paths.cache_dir={tmp / 'cache'}"],
        )

        s, rss, _ = run_measured(train + big_args)
        print(f"cold start, big corpus (build + first step): {s:7.1f} s  peak RSS {rss:7.0f} MB", flush=True)
        run_measured(train + small_args)  # the small corpus's cache
        warm = {"big": ([], []), "default": ([], [])}
        for _ in range(args.repeats):
            for name, extra in (("big", big_args), ("default", small_args)):
                s, rss, _ = run_measured(train + extra)
                warm[name][0].append(s)
                warm[name][1].append(rss)
        for name, (secs, rss) in warm.items():
            print(
                f"warm start, {name:<7} corpus: median {statistics.median(secs):5.2f} s (runs "
                f"{', '.join(f'{v:.2f}' for v in secs)})  peak RSS {max(rss):6.0f} MB",
                flush=True,
            )
        ratio = statistics.median(warm["big"][0]) / statistics.median(warm["default"][0])
        print(f"warm-start ratio big/default: {ratio:.2f}x (goal <= 1.5x)", flush=True)

        for tok in ["bytes"] + ([] if args.skip_bpe else [gpt2]):
            cache = tmp / f"cache-{Path(tok).name}"
            s, rss, out = run_measured([sys.executable, "-c", BUILD, str(big), tok, str(cache)])
            secs, n = out.split("BUILD")[1].split()[:2]
            print(
                f"token cache build, {Path(tok).name:<14}: {float(secs):6.1f} s  {mb / float(secs):6.1f} MB/s  "
                f"{int(n):,} tokens  peak RSS {rss:6.0f} MB",
                flush=True,
            )
            for f in cache.glob("*.bin"):
                f.unlink()
        if not args.skip_nanogpt and not args.skip_bpe:
            nano = tmp / "nanogpt"
            nano.mkdir()
            s, rss, out = run_measured([sys.executable, "-c", NANOGPT, str(big), gpt2, str(nano), str(args.num_proc)])
            secs, load, n = out.split("NANOGPT")[1].split()[:3]
            print(
                f"nanoGPT way (map num_proc={args.num_proc} + memmap), gpt2-tokenizer: {float(secs):6.1f} s  "
                f"{mb / float(secs):6.1f} MB/s  {int(n):,} tokens (+ {float(load):.1f} s json -> arrow)  "
                f"peak RSS (largest process) {rss:6.0f} MB",
                flush=True,
            )


if __name__ == "__main__":
    main()
