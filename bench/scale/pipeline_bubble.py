"""Pipeline bubble, measured: GPipe, 1F1B and interleaved 1F1B on K gloo processes, M micro-batches.

    python -m bench.scale.pipeline_bubble [--k 2 4] [--m 1 2 4 8 16] [--modes sleep compute]

Each rank holds one stage (two for interleaved: stages r and r+K, each half the work), and the model's
work is the same for every schedule. bubble = 1 - ideal / measured, where measured is the median wall
time of one `schedule.step()` (forward and backward of all M micro-batches, between two barriers) and
ideal is M times one rank's own work for one micro-batch (forward + backward of its stage(s), timed
alone; for sleep stages it is known). So the bubble is the fraction of the step a rank is not doing
its own work: idle in the pipeline's fill and drain, or waiting on messages.

Formulas (equal stages, backward any multiple of forward): GPipe and 1F1B (K-1)/(M+K-1): a step lasts
M+K-1 stage slots of which M are a rank's own; 1F1B needs M >= K. Interleaved with V stages a rank:
(K-1)/(V·M+K-1) (Narayanan et al. 2021: bubble/ideal = (K-1)/(V·M)), here V = 2.

Sleep stages (a fixed sleep in forward, twice that in backward) measure the schedule apart from the
machine's noise: on 2 shared cores, K compute processes also compete for the cores, which the compute
mode shows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = ("gpipe", "1f1b", "interleaved")
V = 2  # stages per rank for the interleaved schedule


def formula(schedule: str, k: int, m: int) -> float:
    v = V if schedule == "interleaved" else 1
    return (k - 1) / (v * m + k - 1)


class Sleep(torch.autograd.Function):
    """Work that takes a fixed time: `seconds` in forward, twice that in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        if x.device.type != "meta":  # the stage's shape inference runs forward on meta tensors
            time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepStage(torch.nn.Module):
    def __init__(self, seconds: float, width: int) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x * self.scale, self.seconds)


def compute_stage(layers: int, width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(layers)]
    )


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def make_stages(mode: str, n: int, args) -> list[torch.nn.Module]:
    """n stage modules for one rank; together the K ranks always hold the same total work."""
    if mode == "sleep":
        return [SleepStage(args.sleep_ms / 1000 / n, args.width) for _ in range(n)]
    return [compute_stage(max(1, args.layers // n), args.width) for _ in range(n)]


def own_work(modules: list[torch.nn.Module], mode: str, args) -> float:
    """Seconds one rank needs for one micro-batch through its stage(s), forward + backward, alone."""
    if mode == "sleep":
        return 3 * args.sleep_ms / 1000
    x = torch.randn(args.micro, args.width)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for module in modules:
            module(x).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def measure(schedule_name: str, mode: str, k: int, m: int, args) -> tuple[float, float]:
    """(median step seconds, this rank's ideal busy seconds) for one configuration."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    rank = dist.get_rank()
    n = V if schedule_name == "interleaved" else 1
    torch.manual_seed(0)
    modules = make_stages(mode, n, args)
    indices = [rank + i * k for i in range(n)]
    stages = [PipelineStage(mod, idx, k * n, torch.device("cpu")) for mod, idx in zip(modules, indices)]
    if schedule_name == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
    x = torch.randn(m * args.micro, args.width)
    target = torch.randn(m * args.micro, args.width)
    steps = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        kwargs = {"target": target, "losses": []} if rank == k - 1 else {}
        schedule.step(x, **kwargs) if rank == 0 else schedule.step(**kwargs)
        dist.barrier()
        if i >= args.warmup:
            steps.append(time.perf_counter() - t0)
    return statistics.median(steps), m * own_work(modules, mode, args)


def worker(rank: int, k: int, init: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=k)
    try:
        for mode in args.modes:
            for m in args.m:
                for name in SCHEDULES:
                    if name != "gpipe" and m < k:  # 1F1B (and interleaved) need M >= K
                        if rank == 0:
                            print(f"{mode:7s} K={k} M={m:<3d} {name:12s} n/a (needs M >= K)", flush=True)
                        continue
                    step, ideal = measure(name, mode, k, m, args)
                    ideals = [torch.zeros(1) for _ in range(k)]
                    dist.all_gather(ideals, torch.tensor([ideal]))
                    mean_ideal = sum(float(t) for t in ideals) / k  # the ranks' own work (equal by design)
                    if rank == 0:
                        bubble = 1 - mean_ideal / step
                        print(
                            f"{mode:7s} K={k} M={m:<3d} {name:12s} step {step * 1000:8.1f} ms  "
                            f"measured {bubble:.3f}  formula {formula(name, k, m):.3f}",
                            flush=True,
                        )
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization. After the pipelining schedules have run, torch 2.13's
    # destroy_process_group no longer stops gloo's worker threads, and such a thread destroys a finished
    # collective's Work late; its tensors drop their Python objects, which takes the GIL, and during
    # finalization that ends the thread by a forced unwind through C++: "terminate called without an active
    # exception", SIGABRT (1 run in 12-25 before this; a core dump shows ~AsyncAllgatherWork on
    # ProcessGroupGloo::runLoop under Py_FinalizeEx). Everything is printed and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[2, 4], help="pipeline ranks")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="micro-batches per step")
    p.add_argument("--modes", nargs="+", default=["sleep", "compute"], choices=["sleep", "compute"])
    p.add_argument("--sleep-ms", type=float, default=10.0, help="one rank's forward per micro-batch (sleep)")
    p.add_argument("--layers", type=int, default=4, help="Linear+Tanh layers a rank (compute)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--micro", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    print(
        "bubble = 1 - M x (one rank's fwd+bwd of a micro-batch) / step time; "
        f"formula (K-1)/(M+K-1), interleaved (K-1)/({V}M+K-1)",
        flush=True,
    )
    for k in args.k:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(k, f"file://{os.path.join(tmp, 'store')}", args), nprocs=k, join=True)


if __name__ == "__main__":
    main()
