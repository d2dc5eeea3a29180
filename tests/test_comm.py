"""Communication volume (src/callbacks/comm.py, bench/scale/comm.py): what gloo ranks send per step against the formulas.

The fast test checks how a real torch.profiler trace of real gloo collectives is read (it fails by name if torch
renames the events it reads). The slow ones run train.py through bench.scale.comm on 2 and 3 ranks and hold DDP, FSDP2
full shard and FSDP2 reshard_after_forward=false to 2(N-1)/N·Ψ, 3(N-1)/N·Ψ and 2(N-1)/N·Ψ per rank and step.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FULL_MATRIX_ONLY, ROOT, python, read_events
from test_distributed import run_ranks

from bench.scale import comm
from src.callbacks.comm import collectives, trace
from src.utils.logging import TRAIN_LOSS_REDUCE

# a 2-layer GPT-2 of width 32 on the tests' corpus: start-up dominates, the volumes are Ψ's
TINY = [
    "data.path=" + str(Path(__file__).parent / "data" / "tiny_corpus.txt"),
    "data.seq_len=32",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "trainer.precision=32-true",
    "callbacks.throughput=null",
]


def traced(rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function("comm:forward"):
            dist.all_gather_into_tensor(torch.empty(10 * world), torch.ones(10))
        with record_function("comm:backward"):
            dist.reduce_scatter_tensor(torch.empty(6), torch.ones(6 * world))  # gloo: an all-reduce of all 6·world
            dist.all_reduce(torch.ones(7, dtype=torch.bfloat16))
        with record_function(TRAIN_LOSS_REDUCE):
            dist.barrier()
            dist.all_reduce(torch.ones(2))
        dist.broadcast(torch.ones(5), 0)
        if rank == 0:
            dist.send(torch.ones(3), 1)
        else:
            dist.recv(torch.empty(3), 0)
    return collectives(trace(prof), world)


def test_collectives_read_from_a_real_profile_with_phases_sizes_and_ring_bytes():
    ranks = run_ranks(2, traced)
    rows = [(c["op"], c["phase"], c["elements"], c["dtype"], c["group"], c["bytes"]) for c in ranks[0]]
    assert rows == [
        ("all_gather", "forward", 20, "fp32", 2, 40.0),  # (n-1)/n · 20 · 4
        ("reduce_scatter", "backward", 12, "fp32", 2, 24.0),  # not the all-reduce gloo runs it as
        ("all_reduce", "backward", 7, "bf16", 2, 14.0),  # 2(n-1)/n · 7 · 2
        ("barrier", "logging", 0, "-", 2, 0.0),
        ("all_reduce", "logging", 2, "fp32", 2, 8.0),
        ("broadcast", "other", 5, "fp32", 2, 10.0),
        ("send", "other", 3, "fp32", 2, 12.0),
    ]
    assert ranks[1][-1]["op"] == "recv" and ranks[1][-1]["elements"] == 3 and ranks[1][-1]["bytes"] == 0


def bench_comm(*args: str, interpreter: str = sys.executable) -> subprocess.CompletedProcess:
    """`python -m bench.scale.comm args`: a fresh interpreter by default (a refusal before any import of torch costs
    nothing); python(), the tests' forking stand-in, for a run that gets as far as train.py."""
    return subprocess.run([interpreter, "-m", "bench.scale.comm", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args,words",
    [
        (["trainer=ddpp"], "trainer=ddpp is not a strategy bench.scale.comm can measure: use one of ddp, deepspeed"),
        (["trainer=cpu"], "trainer=cpu is not a strategy"),
        (["trainer=ddp", "--ranks", "100000"], r"--ranks 100000 needs about 60000 GiB .* use --ranks \d+ or fewer"),
        (["trainer=ddp", "--ranks", "1"], "--ranks takes numbers of processes >= 2"),
    ],
)
def test_bad_requests_are_one_sentence_before_anything_starts(args, words):
    proc = bench_comm(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert re.search(words, line), line


@pytest.mark.slow
def test_a_config_that_does_not_build_is_train_pys_sentence():
    """Without trainer= the bench runs DDP (train.py's default is 1 process), and train.py's refusal comes back."""
    proc = bench_comm("--ranks", "3", *TINY, "data.global_batch_size=8", interpreter=python())
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("bench.scale.comm: train.py refused trainer=ddp ")
    assert "data.global_batch_size=8 does not divide into 3" in line


GOALS = {  # (overrides, the formula's multiple of (N-1)/N·Ψ·4 bytes, tolerance, bytes by phase as such multiples)
    "ddp": (["trainer=ddp"], 2, 0.02, {"backward": 2}),
    "fsdp": (["trainer=fsdp"], 3, 0.05, {"forward": 1, "backward": 2}),
    "fsdp_no_reshard": (
        ["trainer=fsdp", "trainer.strategy.reshard_after_forward=false"],
        2,
        0.05,
        {"forward": 1, "backward": 1},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=FULL_MATRIX_ONLY)])  # suite time: 3 ranks in full
@pytest.mark.parametrize("name", GOALS)
def test_data_parallel_volume_per_rank_and_step_meets_the_formula(tmp_path, name, n):
    args, multiple, tol, phases = GOALS[name]
    result = comm.run(TINY + args, n, steps=1, python=python(), log_dir=tmp_path)
    rows = comm.summarize(result)
    assert sorted(r["rank"] for r in rows) == list(range(n)) and {r["step"] for r in rows} == {1}
    for row in rows:
        unit = (n - 1) / n * row["params"] * 4  # fp32 gradients
        assert row["params"] == result["records"][0]["params"] > 30_000
        assert abs(row["total"] / (multiple * unit) - 1) <= tol, (row, multiple * unit)
        for phase, k in phases.items():
            assert abs(row["phases"][phase] / (k * unit) - 1) <= tol, (phase, row)
        assert row["formulas"][0]["ratio"] == pytest.approx(row["total"] / (multiple * unit))
    if name == "ddp":  # rank 0's figure in TensorBoard, per collective
        ea = read_events(next(tmp_path.rglob("tensorboard")))
        (event,) = ea.Scalars("train/comm_mib_per_step/total")
        assert event.step == 1 and event.value == pytest.approx(rows[0]["total"] / 2**20, rel=1e-4)
