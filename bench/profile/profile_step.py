"""Where train.py's training step spends its device time: torch.profiler over a few steps of a real run.

    python train.py <overrides> +callbacks.profile._target_=bench.profile.profile_step.StepProfiler \
        +callbacks.profile.out=profile.txt [+callbacks.profile.start=20 +callbacks.profile.steps=5]

After `start` optimizer steps (torch.compile and the allocator warmed up), it profiles the next `steps` and writes
to `out` (rank 0): the profiled time by kind of work, as shares, then the 30 ops with the most self time; on a GPU
also the window's wall, the GPU's busy and idle time a step and the longest idle stretches (`idle_report`). Time is
each op's *self* device time on a GPU (the kernels an op launched itself, so nothing is counted twice; a compiled
region's Triton kernels count under the compiled graph that launches them) and self CPU time on a CPU. The kinds are
read from op names (KINDS, first match wins); what matches none is "other". An evaluation inside the window is
profiled too: choose `start` and `steps` between two of the run's validations.
Lightning's own `trainer.profiler=pytorch` reports the last profiled window, which is an evaluation's when one runs.
"""

from __future__ import annotations

import re
import time
from typing import Optional

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

KINDS = {  # kind: a regular expression on the op's name
    "matmul": r"\b(aten::)?(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)\b|gemm|nvjet|cutlass|xmma",
    "attention": r"attention|flash|fmha|sdpa",
    "loss (softmax, cross-entropy)": r"softmax|cross_entropy|nll_loss",
    "norm": r"layer_norm|rms_norm",
    "cat": r"\bcat\b|CatArray",
    "copy / cast": r"copy_|_to_copy|\bclone\b|contiguous|\bto\b",
    "optimizer": r"adam|foreach|Optimizer",
    "compiled (Triton)": r"triton|CompiledFunction|inductor",
    "reduction": r"\b(sum|mean|norm|max|amax|reduce)\b|reduce_kernel",
    "elementwise": r"\b(add|mul|div|sub|gelu|silu|tanh|pow|where|fill_|zero_)_?\b|elementwise",
}


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS.items() if re.search(pattern, name)), "other")


def report(averages, on_gpu: bool, steps: int) -> str:
    """The kinds' shares and the top ops of `averages` (a profile's key_averages())."""
    self_time = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    rows = [(e.key, getattr(e, self_time), e.count) for e in averages if e.device_type.name == "CPU"]
    total = sum(t for _, t, _ in rows) or 1.0
    by_kind: dict[str, float] = {}
    for name, t, _ in rows:
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + t
    lines = [f"{'GPU' if on_gpu else 'CPU'} self time over {steps} steps: {total / 1e3:.1f} ms, "
             f"{total / 1e3 / steps:.2f} ms a step"]  # fmt: skip
    lines += [f"  {k:<32}{t / total:7.1%}" for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines.append(f"\n{'op':<70}{'self ms':>10}{'share':>8}{'calls':>8}")
    for name, t, count in sorted(rows, key=lambda r: -r[1])[:30]:
        lines.append(f"{name[:69]:<70}{t / 1e3:10.2f}{t / total:8.1%}{count:8d}")
    return "\n".join(lines) + "\n"


def idle_gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] that no interval of `busy` (the GPU's kernels, in µs) covers, longest first."""
    gaps, reached = [], start
    for a, b in sorted(busy):
        if a > reached:
            gaps.append((reached, min(a, end)))
        reached = max(reached, b)
    if reached < end:
        gaps.append((reached, end))
    return sorted((g for g in gaps if g[1] > g[0]), key=lambda g: g[0] - g[1])


def idle_report(events, start: float, end: float, steps: int, shown: int = 8) -> str:
    """Where the GPU waits in the profiled window [start, end] (µs): its wall, the union of its kernels and the idle
    rest a step, then the longest idle stretches with the host ops that began in each (none: Python alone ran)."""
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"]
    gaps = idle_gaps(kernels, start, end)
    idle = sum(b - a for a, b in gaps)
    wall = end - start
    lines = [f"\nwall {wall / 1e3 / steps:.2f} ms a step, GPU busy {(wall - idle) / 1e3 / steps:.2f} ms, "
             f"idle {idle / 1e3 / steps:.2f} ms ({len(gaps)} stretches); the longest:"]  # fmt: skip
    host = [e for e in events if e.device_type.name == "CPU" and not e.name.startswith("cuda")]
    for a, b in gaps[:shown]:
        began = [e.name for e in host if a <= e.time_range.start < b]
        names = sorted(set(began), key=began.count, reverse=True)[:4]
        lines.append(
            f"  {(b - a) / 1e3:7.2f} ms at +{(a - start) / 1e3:8.2f} ms: {', '.join(names) or '(no op: Python)'}"
        )
    return "\n".join(lines) + "\n"


class StepProfiler(L.Callback):
    """Profiles optimizer steps start+1 .. start+steps of the run (see the module docstring)."""

    def __init__(self, out: str, start: int = 20, steps: int = 5) -> None:
        self.out, self.start, self.steps = out, start, steps
        self.prof: Optional[profile] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self.prof is None and trainer.global_step == self.start:
            on_gpu = trainer.strategy.root_device.type == "cuda"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            if on_gpu:
                torch.cuda.synchronize()
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self.window = [time.perf_counter()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self.prof is None or trainer.global_step != self.start + self.steps or self.out is None:
            return
        on_gpu = trainer.strategy.root_device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
        self.window.append(time.perf_counter())
        self.prof.__exit__(None, None, None)
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                f.write(report(self.prof.key_averages(), on_gpu, self.steps))
                if on_gpu:  # the profiler's clock (µs) spans the window from its first event to its last
                    events = self.prof.events()
                    start = min(e.time_range.start for e in events)
                    f.write(idle_report(events, start, start + (self.window[1] - self.window[0]) * 1e6, self.steps))
        self.out = None  # done
