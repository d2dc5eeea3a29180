"""The throughput benchmark keeps running and reports what it claims (its figures are not asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.throughput import paired_ratio

ROOT = Path(__file__).resolve().parents[1]


def test_paired_ratio_pairs_runs_of_the_same_round():
    # Round 2 ran on a busy machine for both ways: its ratio is as good as the others'.
    template = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 90.0}]
    raw = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 100.0}]
    assert paired_ratio(template, raw) == (0.9, 1.0, 1.0)


@pytest.mark.slow
def test_throughput_bench_runs_all_ways_and_prints_ratios(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.throughput", "--shapes", "overhead", "--rounds", "1", "--steps", "6",
         "--warmup", "2", "--cache-dir", str(tmp_path), "--nanogpt", "--variants", "fp32=trainer.precision=32-true"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for way in ("template", "raw", "hf", "hf_default", "nanogpt", "fp32"):
        row = re.search(rf"^overhead\s+{way}\s+([\d.]+)\s+(\d+)\s+(\d+)$", out.stdout, re.M)
        assert row, f"no row for {way}:\n{out.stdout}"
        assert float(row[1]) > 0 and int(row[2]) > 0 and int(row[3]) > 100  # step ms, tokens/s, peak RSS MiB
    for label in ("template/raw", "template/hf", "template/hf_default", "template/nanogpt", "fp32/template",
                  "fp32/nanogpt"):
        assert re.search(rf"^overhead\s+{label}\s+= \d+\.\d{{3}}  \[\d+\.\d{{3}}-\d+\.\d{{3}}\]$", out.stdout, re.M), \
            f"no ratio {label}:\n{out.stdout}"
