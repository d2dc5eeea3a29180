"""What this machine offers a process."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a SLURM or container limit), else all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fastest_precision(accelerator: str = "auto") -> str:
    """The fastest correct precision for the hardware found: trainer.precision's default.

    GPU: bf16-mixed where bf16 is native (Ampere and newer), else 16-mixed (fp16 with a gradient scaler).
    CPU: bf16-mixed with AVX512-BF16 or AMX instructions (measured 1.3-2.4x faster than fp32 on such a
    CPU, docs/performance.md), else 32-true, as bf16 has no fast matmul path without them.
    """
    import torch

    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    if accelerator not in ("auto", "cpu"):
        return "32-true"  # e.g. mps: leave it to the user
    # torch.cpu's capability probes are private, hence the getattr: absent in some torch, then fp32
    probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return "bf16-mixed" if any(probe is not None and probe() for probe in probes) else "32-true"


def fastest_attention(accelerator: str, precision: str, seq_len: int) -> str:
    """GPT-2's attention kernel (model.attn_implementation): torch's fused SDPA, except where plain
    matmuls measured faster: bf16 on a CPU at contexts up to 256, 1.25-1.55x here; at 512 eager
    gained only 1.08-1.14x for 35% more memory, at 1024 SDPA won 2x, and in fp32 they are within
    6% up to 512 (docs/performance.md). GPUs: SDPA, which dispatches to flash attention there
    (not measured here).
    """
    import torch

    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return "eager" if on_cpu and precision == "bf16-mixed" and int(seq_len) <= 256 else "sdpa"
