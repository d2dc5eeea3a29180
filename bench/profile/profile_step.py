"""Where train.py's training step spends its device time: torch.profiler over a few steps of a real run.

    python train.py <overrides> +callbacks.profile._target_=bench.profile.profile_step.StepProfiler \
        +callbacks.profile.out=profile.txt [+callbacks.profile.start=20 +callbacks.profile.steps=5]

After `start` optimizer steps (torch.compile and the allocator warmed up), it profiles the next `steps` and writes
to `out` (rank 0): the profiled time by kind of work, as shares, then the 30 ops with the most self time. Time is
each op's *self* device time on a GPU (the kernels an op launched itself, so nothing is counted twice; a compiled
region's Triton kernels count under the compiled graph that launches them) and self CPU time on a CPU. The kinds are
read from op names (KINDS, first match wins); what matches none is "other". An evaluation inside the window is
profiled too: choose `start` and `steps` between two of the run's validations.
Lightning's own `trainer.profiler=pytorch` reports the last profiled window, which is an evaluation's when one runs.
"""

from __future__ import annotations

import re
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

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self.prof is None or trainer.global_step != self.start + self.steps or self.out is None:
            return
        on_gpu = trainer.strategy.root_device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                f.write(report(self.prof.key_averages(), on_gpu, self.steps))
        self.out = None  # done
