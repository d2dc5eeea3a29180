"""The throughput benchmark keeps running and reports what it claims (its figures are not asserted)."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import FULL_MATRIX_ONLY, python, shared

from bench.common import paired_ratio

ROOT = Path(__file__).resolve().parents[1]


def test_paired_ratio_pairs_runs_of_the_same_round():
    # Round 2 ran on a busy machine for both ways: its ratio is as good as the others'.
    template = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 90.0}]
    raw = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 100.0}]
    assert paired_ratio(template, raw) == (0.9, 1.0, 1.0)
    # a round in which either way failed (None) has no ratio; the others keep theirs
    assert paired_ratio([None, *template[1:]], [raw[0], None, raw[2]]) == (0.9, 0.9, 0.9)


def test_nanogpt_with_bias_is_the_templates_gpt2_parameter_for_parameter():
    """The way nanogpt_bias compares the template with nanoGPT at GPT-2's own architecture: the same parameter
    shapes as the template's GPT-2 (nanoGPT's default, bias=False, has none of the Linear and LayerNorm biases)."""
    from bench.compare.nanogpt import GPT
    from src.lm.models.gpt2_module import GPT2LitModule

    def shapes(model):  # dims sorted: transformers' Conv1D stores a projection as (in, out), nn.Linear as (out, in)
        return sorted(tuple(sorted(p.shape)) for p in model.parameters())

    ours = shapes(GPT2LitModule(vocab_size=257, seq_len=128, n_layer=4, n_head=4, n_embd=128).model)
    assert shapes(GPT(257, 128, 4, 4, 128, bias=True)) == ours
    bare = shapes(GPT(257, 128, 4, 4, 128, bias=False))
    assert len(ours) - len(bare) == 4 * 6 + 1  # per block: 4 projections + 2 LayerNorms; and the final LayerNorm


def test_outside_bench_gives_nanogpt_as_many_eval_forwards_as_the_template_validates(tmp_path):
    """bench.compare.outside's nanogpt_val way runs as many evaluation batches in nanoGPT as the template's validation:
    nanoGPT evaluates `eval_iters` batches of each of its two splits, the template its whole val split, whose
    length the bench derives from the corpus size: it must be the template's own val dataloader length."""
    from bench.compare.outside import BATCH, CTX, nanogpt_eval_iters, template_val_batches
    from src.lm.data.text import TextDataModule

    corpus = shared("tinyshakespeare", "input.txt")
    data = TextDataModule(path=str(corpus), seq_len=CTX, global_batch_size=BATCH, cache_dir=str(tmp_path))
    data.setup()
    assert template_val_batches(corpus) == len(data.val_dataloader()) == 28
    assert 2 * nanogpt_eval_iters(corpus) == len(data.val_dataloader())  # train + val splits in nanoGPT


NANOGPT_REPO = os.environ.get("NANOGPT_REPO")  # a checkout of karpathy/nanoGPT (not on any package registry)


@pytest.mark.skipif(not NANOGPT_REPO, reason="needs a checkout of karpathy/nanoGPT: NANOGPT_REPO=DIR")
def test_nanogpts_own_train_py_runs_as_a_way_with_its_vocabulary_and_biases(tmp_path):
    """--nanogpt-repo: nanoGPT's train.py itself on the same GPT-2 tokens: as it comes (no biases, its vocabulary
    rounded up to 50304) and as GPT-2 (biases, 50257), each with a row and a ratio against the template."""
    out = subprocess.run(
        [python(), "-m", "bench.compare.throughput", "--shapes", "overhead", "--rounds", "1", "--steps", "6", "--warmup", "2",
         "--cache-dir", str(tmp_path), "--tokenizer", str(shared("gpt2-tokenizer")), "--ways", "template",
         "--nanogpt-repo", NANOGPT_REPO],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for way in ("nanogpt_repo", "nanogpt_repo_gpt2"):
        row = re.search(rf"^overhead\s+{way}\s+([\d.]+)\s+(\d+)\s+(\d+)$", out.stdout, re.M)
        assert row and float(row[1]) > 0, f"no row for {way}:\n{out.stdout}"
        assert re.search(rf"^overhead\s+template/{way}\s+= \d+\.\d{{3}}", out.stdout, re.M), out.stdout
    printed = {
        way: (tmp_path / f"{way}_overhead" / "stdout.txt").read_text() for way in ("nanogpt_repo", "nanogpt_repo_gpt2")
    }
    assert "defaulting to vocab_size of GPT-2 to 50304" in printed["nanogpt_repo"]
    assert "Overriding: bias = False" in printed["nanogpt_repo"]
    assert "found vocab_size = 50257" in printed["nanogpt_repo_gpt2"]
    assert "Overriding: bias = True" in printed["nanogpt_repo_gpt2"]


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time, 20 s: a benchmark's run; every way it times is the template's own, tested elsewhere
def test_throughput_bench_runs_all_ways_and_prints_ratios(tmp_path):
    out = subprocess.run(
        [
            python(),
            "-m",
            "bench.compare.throughput",
            "--shapes",
            "overhead",
            "--rounds",
            "1",
            "--steps",
            "6",
            "--warmup",
            "2",
            "--cache-dir",
            str(tmp_path),
            "--tokenizer",
            str(shared("gpt2-tokenizer")),  # every way on GPT-2's BPE (the overhead shape keeps its head small)
            "--nanogpt",
            "--variants",
            "fp32=trainer.precision=32-true",
            "bad=+model.no_such_key=1",  # a way that fails: reported, and the others go on
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"tokenizer {shared('gpt2-tokenizer')} (50257 tokens)" in out.stdout
    for way in ("template", "raw", "hf", "hf_default", "nanogpt", "nanogpt_bias", "fp32"):
        row = re.search(rf"^overhead\s+{way}\s+([\d.]+)\s+(\d+)\s+(\d+)$", out.stdout, re.M)
        assert row, f"no row for {way}:\n{out.stdout}"
        assert float(row[1]) > 0 and int(row[2]) > 0 and int(row[3]) > 100  # step ms, tokens/s, peak RSS MiB
    for label in (
        "template/raw",
        "template/hf",
        "template/hf_default",
        "template/nanogpt",
        "template/nanogpt_bias",
        "fp32/template",
        "fp32/nanogpt",
    ):
        assert re.search(rf"^overhead\s+{label}\s+= \d+\.\d{{3}}  \[\d+\.\d{{3}}-\d+\.\d{{3}}\]$", out.stdout, re.M), (
            f"no ratio {label}:\n{out.stdout}"
        )
    assert "overhead bad round 0 failed (2)" in out.stderr and "Unknown config key 'model.no_such_key'" in out.stderr
    assert not re.search(r"^overhead\s+bad", out.stdout, re.M)  # no row, no ratio for it


def run_bench(name: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m bench.<name> args` from the repository root, which must exit 0; its output."""
    out = subprocess.run(
        [python(), "-m", f"bench.{name}", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@FULL_MATRIX_ONLY  # suite time, 9 s: a bench's run and its printed ratios stay (the dropout bench's test)
def test_token_loss_bench_times_four_ways_of_the_lm_head(tmp_path):
    """bench.profile.token_loss runs the eager, compiled, matmul-only and torch linear_cross_entropy heads and prints each
    way's time and the eager/compiled ratio (after checking the compiled loss against the eager one)."""
    out = run_bench("profile.token_loss", "--tokens", "64", "--width", "16", "--vocab", "500", "--rounds", "2")
    for way in ("eager", "compiled", "matmul", "lce"):
        assert re.search(rf"^{way}\s+\d+\.\d ms$", out.stdout, re.M), out.stdout
    assert re.search(r"^eager/compiled = \d+\.\d{3}$", out.stdout, re.M), out.stdout


def test_dropout_bench_times_keyed_against_torchs_dropout():
    """bench.profile.dropout prints one dropout's and a GPT-2 step's time, torch's, keyed (eager ops and the compiled
    kernel) and without dropout, with their ratios to torch's."""
    out = run_bench("profile.dropout", "--rows", "2", "--seq", "8", "--width", "64", "--layers", "1", "--rounds", "2")
    ways = r"torch [\d.]+ ms \(1\.00x torch\), keyed [\d.]+ ms \([\d.]+x torch\), kernel [\d.]+ ms \([\d.]+x torch\)"
    assert re.search(rf"^op \(2 x 8 x 64\): {ways}$", out.stdout, re.M), out.stdout
    assert re.search(rf"^step \(2 x 8 x 64\): {ways}, none [\d.]+ ms", out.stdout, re.M), out.stdout
    kept = dict(re.findall(r"(\w+) ([\d.]+) MiB", out.stdout.split("kept for the backward:")[1]))
    assert set(kept) == {"torch", "keyed", "kernel", "none"} and float(kept["kernel"]) < float(kept["keyed"]), kept


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time, 25 s: a benchmark's figure; the pipeline schedules' parity tests stay
def test_pipeline_bubble_of_sleep_stages_is_near_the_formula():
    """2 gloo ranks whose stages sleep (fixed work): GPipe's and 1F1B's measured bubble is close to
    (K-1)/(M+K-1) and falls with M; 1F1B with M < K is refused, not measured."""
    out = run_bench(
        "scale.pipeline_bubble",
        *("--k", "2", "--m", "1", "2", "8", "--modes", "sleep", "--steps", "2"),
        # 20 ms: a loaded 2-core machine's per-action overhead once took M=8's bubble to 0.41 (formula 0.11)
        *("--sleep-ms", "50"),
    )
    rows = {
        (int(m), name): (float(measured), float(expected))
        for m, name, measured, expected in re.findall(
            r"^sleep\s+K=2 M=(\d+)\s+(\w+)\s+step\s+[\d.]+ ms\s+measured (-?[\d.]+)\s+formula ([\d.]+)$",
            out.stdout,
            re.M,
        )
    }
    assert re.search(r"^sleep\s+K=2 M=1\s+1f1b\s+n/a", out.stdout, re.M), out.stdout
    for key in [(1, "gpipe"), (2, "gpipe"), (2, "1f1b"), (8, "gpipe"), (8, "1f1b")]:
        measured, expected = rows[key]
        assert expected - 0.05 < measured < expected + 0.25, (key, measured, expected, out.stdout)
    assert rows[(8, "gpipe")][0] < rows[(1, "gpipe")][0]  # more micro-batches, smaller bubble
    assert (8, "interleaved") in rows  # measured and printed (its per-action overhead is larger, see docs)


def test_the_step_profiler_reports_a_real_runs_steps_by_kind(tmp_path):
    """bench/profile/profile_step.py in a real train.py run: steps 3-4 profiled, their self time split into kinds whose shares
    add up to the whole, matrix products among them, and the ops listed with the calls of 2 steps."""
    from conftest import path_overrides, run_script
    from test_parity import GPT2, QUIET

    out = tmp_path / "profile.txt"
    profiler = ["+callbacks.profile._target_=bench.profile.profile_step.StepProfiler", f"+callbacks.profile.out={out}",
                "+callbacks.profile.start=2", "+callbacks.profile.steps=2"]  # fmt: skip
    dirs = {"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"}
    run_script("train.py", QUIET + path_overrides(dirs) + GPT2 + profiler)
    text = out.read_text()
    assert re.match(r"CPU self time over 2 steps: [\d.]+ ms, [\d.]+ ms a step\n", text), text
    shares = dict(re.findall(r"^  (\S.*?)\s+([\d.]+)%$", text, re.M))
    assert "matmul" in shares and abs(sum(float(v) for v in shares.values()) - 100) < 0.5, shares
    mm = re.search(r"^aten::addmm\s+[\d.]+\s+[\d.]+%\s+(\d+)$", text, re.M)
    assert mm and int(mm[1]) % 2 == 0, text  # the same matmuls in each of the 2 steps


def test_the_step_profilers_idle_report_finds_where_no_kernel_runs():
    """profile_step.idle_gaps / idle_report: kernels (overlapping) leave their window's gaps, longest first; a window
    of 100 µs with kernels over 10-40 and 60-90 is idle 10 + 20 + 10 µs, each stretch with the host ops begun in it."""
    from types import SimpleNamespace

    from bench.profile.profile_step import idle_gaps, idle_report

    assert idle_gaps([(50, 90), (10, 30), (20, 40)], 0, 100) == [(0, 10), (40, 50), (90, 100)]
    assert idle_gaps([(0, 100)], 0, 100) == [] and idle_gaps([], 0, 5) == [(0, 5)]

    def event(name, device, a, b):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                               time_range=SimpleNamespace(start=a, end=b))  # fmt: skip

    events = [event("k1", "CUDA", 10, 40), event("k2", "CUDA", 60, 90), event("aten::copy_", "CPU", 42, 44),
              event("cudaLaunchKernel", "CPU", 45, 46)]  # fmt: skip
    text = idle_report(events, 0, 100, steps=1)
    assert "wall 0.10 ms a step, GPU busy 0.06 ms, idle 0.04 ms (3 stretches)" in text, text
    lines = text.strip().splitlines()[1:]
    assert "aten::copy_" in lines[0] and "0.02 ms at +    0.04 ms" in lines[0], text  # 40-60: the longest
    assert all("(no op: Python)" in line for line in lines[1:]), text  # launches are not host work


@pytest.mark.slow
@FULL_MATRIX_ONLY
def test_finetune_methods_bench_pretrains_a_base_and_fine_tunes_from_it(tmp_path):
    """bench.learn.finetune_methods, shortened: a base of 4 steps, then 2 methods for 10 steps each, one JSON line each
    with the figures docs/fine-tuning.md shows (the frozen base's own tokens: bytes)."""
    import json

    shared("alpaca", "alpaca_en_demo.json")
    proc = subprocess.run(
        [python(), "-m", "bench.learn.finetune_methods", "--base-steps", "4", "--steps", "10", "--work", str(tmp_path),
         "--only", "full", "bottleneck r=16"],  # fmt: skip
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in records] == ["full", "bottleneck r=16"]
    assert all(r["val_loss"] > 0 and r["step_ms"] > 0 and r["peak_mib"] > 0 for r in records)
    assert records[1]["trainable"] == "17.5 K"  # 4 blocks x 2 adapters x (128 x 8 + 8 + 8 x 128 + 128)


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time, 35 s: a benchmark's figure (its scores are tests/test_benchmarks.py's)
def test_harness_bench_times_the_templates_lm_and_lm_evals_hf_backend():
    """bench.compare.harness trains a tiny GPT-2, writes its three local tasks and prints both ways' documents/s and
    their ratio (its figures are not asserted)."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -e '.[bench]'")
    shared("gpt2-tokenizer")
    out = run_bench("compare.harness", "--rounds", "1", "--limit", "2")
    assert re.search(r"^template/hf documents/s: \d+\.\d\d \[", out.stdout, re.M), out.stdout
    assert out.stdout.count(" documents in ") == 2  # 1 round x 2 ways, 6 documents each
    assert "6 documents in" in out.stdout
