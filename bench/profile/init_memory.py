"""Peak host memory (RSS) per rank while trainer=fsdp sets up a GPT-2, built the old way (every rank
builds the whole model, then shards it) and on the meta device (each rank makes only its shards).

    python -m bench.profile.init_memory [--size medium] [--devices 2]

Each way is one real `train.py` run on gloo that stops when fit starts, i.e. once the model is sharded
and the optimizer made (no step). Every rank prints its peak RSS so far (ru_maxrss) and the parameter
bytes it holds; the model's full fp32 size is printed for comparison.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT.parent / "shared" / "data" / "gpt2-tokenizer"  # GPT-2's 50257-token BPE, when present


class PeakRSSAtFitStart(L.Callback):
    """Prints this rank's peak RSS and parameter bytes once the model is set up, then ends the run."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from src.lm.init import local_param_bytes

        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        full = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        print(
            f"INIT_MEMORY rank={trainer.global_rank} peak_rss_mib={peak_mib:.0f} "
            f"param_mib={local_param_bytes(pl_module) / 2**20:.0f} model_mib={full / 2**20:.0f}",
            flush=True,
        )
        trainer.should_stop = True  # no training step: the setup is what is measured


def run(size: str, devices: int, meta_init: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as logs:
        cmd = [
            sys.executable,
            "train.py",
            f"paths.log_dir={logs}",
            f"paths.cache_dir={logs}/cache",
            "trainer=fsdp",
            f"trainer.devices={devices}",
            f"trainer.strategy.meta_init={str(meta_init).lower()}",
            f"model/size={size}",
            "trainer.precision=32-true",
            "callbacks=none",
            "logger=none",
            "+callbacks.mem._target_=bench.profile.init_memory.PeakRSSAtFitStart",
            "extras.print_config=false",
            "trainer.enable_progress_bar=false",
            "trainer.num_sanity_val_steps=0",
            "test=false",
            "optimized_metric=null",
            f"data.path={ROOT / 'tests' / 'data' / 'tiny_corpus.txt'}",
            "data.seq_len=64",
            "data.global_batch_size=4",
            "trainer.max_steps=1",
        ]
        if TOKENIZER.exists():
            cmd.append(f"data.tokenizer={TOKENIZER}")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        text = out.stdout + out.stderr
        if out.returncode != 0:
            sys.exit(f"train.py failed ({out.returncode}):\n{text[-4000:]}")
    found = re.findall(r"INIT_MEMORY rank=(\d+) peak_rss_mib=(\d+) param_mib=(\d+) model_mib=(\d+)", text)
    rows = {
        int(r): {"rank": int(r), "peak_rss_mib": float(p), "param_mib": float(h), "model_mib": float(m)}
        for r, p, h, m in found
    }  # the ranks' output may interleave on one line
    return [rows[r] for r in sorted(rows)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", help="conf/model/size: tiny | small | medium | large | xl")
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()
    print(f"GPT-2 {args.size}, trainer=fsdp on {args.devices} gloo ranks, fp32: peak RSS per rank during setup")
    for meta_init, label in (
        (False, "whole model on every rank (meta_init=false)"),
        (True, "meta device (meta_init=true)"),
    ):
        for r in run(args.size, args.devices, meta_init):
            print(
                f"{label:<46} rank {r['rank']}: peak RSS {r['peak_rss_mib']:6.0f} MiB, holds "
                f"{r['param_mib']:5.0f} MiB of the {r['model_mib']:.0f} MiB model"
            )


if __name__ == "__main__":
    main()
