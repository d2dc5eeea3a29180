"""Seconds from `python train.py` starting to its first optimizer step, with a warm token cache.

    python -m bench.profile.startup [--repeats 3]

Also times the bare imports, for reference. Each measurement is a fresh process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import lightning as L


class FirstStep(L.Callback):
    """Prints the wall-clock time when the first optimizer step has finished, then stops the run."""

    def on_train_batch_end(self, trainer, *args) -> None:
        print(f"FIRST_STEP_AT {time.time():.6f}", flush=True)
        trainer.should_stop = True


def seconds(cmd: list[str]) -> float:
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    marker = [line for line in out.splitlines() if line.startswith("FIRST_STEP_AT")]
    return (float(marker[0].split()[1]) if marker else time.time()) - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        train = [
            sys.executable,
            "train.py",
            f"paths.log_dir={logs}",
            "+callbacks.first._target_=bench.profile.startup.FirstStep",
            "test=false",
            "optimized_metric=null",
            "trainer.num_sanity_val_steps=0",
        ]
        subprocess.run(train, capture_output=True, check=True)  # warms the token cache and the page cache
        runs = {"train.py to first step": [], "imports only": []}
        imports = [sys.executable, "-c", "import torch, lightning, transformers, torchmetrics, hydra"]
        for _ in range(args.repeats):
            runs["train.py to first step"].append(seconds(train))
            runs["imports only"].append(seconds(imports))
    for name, values in runs.items():
        print(f"{name:<24} median {statistics.median(values):5.2f} s  (runs: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
