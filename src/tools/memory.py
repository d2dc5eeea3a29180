"""Per-rank memory estimate for training a GPT-2 shape: model states by strategy, plus activations.

    python -m src.tools.memory --size small --world-size 8 --strategy zero2 --precision bf16-mixed
    python -m src.tools.memory --size xl --world-size 4 --strategy zero3 --offload-optimizer --offload-param
    python -m src.tools.memory --size medium --world-size 8 --tensor-parallel 4          # trainer=tp: 2 x 4
    python -m src.tools.memory --size large --world-size 8 --pipeline-parallel 4 --schedule 1f1b --microbatches 8

Model states (ZeRO paper, Rajbhandari et al. 2020), Adam, Psi parameters, N ranks:
  mixed precision: 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32 master, m, v) = 16 bytes/param
  fp32:            4 (params)        + 4 (grads)        + 8 (m, v)                = 16 bytes/param
  ddp: all of it on every rank; zero1: optimizer states sharded; zero2: + gradients; zero3 (= FSDP
  full shard): + parameters. Offload moves the optimizer states (and with zero3 the parameters) to CPU.
Activations (Korthikanti et al. 2022, 16-bit, per layer): seq*batch*d*(34 + 5*heads*seq/d) bytes; with
activation checkpointing only each layer's input (2*seq*batch*d) is kept, plus one layer being recomputed.

Model parallelism divides the model before the strategy above shares what is left over the data-parallel
ranks (world / (tensor x pipeline)):
  tensor parallel t (src/distributed/tensor_parallel.py): each block's matrices (12d^2) and column-split
    biases (7d) are split t ways; row biases, LayerNorms and the embeddings are replicated. Activations per
    layer become seq*batch*d*(10 + 24/t + 5*heads*seq/(d*t)) (Korthikanti et al., no sequence parallel).
  pipeline K stages: each rank holds n_layer/K blocks, the first stage the embeddings, the last ln_f and
    (tied) a copy of wte for the head; we report the largest stage. Activations in flight on the first
    stage, micro-batches of `micro_batch`: GPipe M of them, 1F1B min(M, K), interleaved (v stages per
    rank) K*(1 + (K-1)/(K*v)) (Narayanan et al. 2021), each of n_layer/K layers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

SIZES = {"tiny": (4, 4, 128), "small": (12, 12, 768), "medium": (24, 16, 1024), "large": (36, 20, 1280),
         "xl": (48, 25, 1600)}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def gpt2_params(n_layer: int, n_embd: int, vocab: int = 50257, n_ctx: int = 1024) -> int:
    """Exact GPT-2 count with tied embeddings: 12d^2 + 13d per block, embeddings, final LayerNorm."""
    return n_layer * (12 * n_embd**2 + 13 * n_embd) + (vocab + n_ctx) * n_embd + 2 * n_embd


def rank_params(n_layer: int, n_embd: int, vocab: int = 50257, n_ctx: int = 1024, tensor_parallel: int = 1,
                pipeline_parallel: int = 1) -> int:
    """Parameters on the fullest rank: ceil(n_layer / K) blocks whose matrices (12d^2) and column biases (7d)
    are split t ways (row biases and LayerNorms, 6d, replicated), plus the embeddings (whole model or first
    stage) or ln_f and the tied head's copy of wte (last stage), whichever is larger."""
    d, t, k = n_embd, tensor_parallel, pipeline_parallel
    blocks = -(-n_layer // k) * ((12 * d**2 + 7 * d) // t + 6 * d)
    if k == 1:
        return blocks + (vocab + n_ctx) * d + 2 * d
    return blocks + max((vocab + n_ctx) * d, vocab * d + 2 * d)


def in_flight(schedule: str, stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: use one of {', '.join(SCHEDULES)}.")
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages)
    return min(microbatches, stages * (1 + (stages - 1) / (stages * stages_per_rank)))


@dataclass
class Estimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    cpu: float  # offloaded bytes, in host memory

    @property
    def device_total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def model_states(psi: int, world: int, strategy: str, mixed: bool,
                 offload_optimizer: bool = False, offload_param: bool = False) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, cpu) bytes per rank."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: use one of {', '.join(STRATEGIES)}.")
    if offload_param and strategy != "zero3":
        raise ValueError("offload_param needs zero3 (only sharded parameters can live on the CPU).")
    p_bytes, g_bytes, o_bytes = (2, 2, 12) if mixed else (4, 4, 8)
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, world), "zero2": (1, world, world), "zero3": (world, world, world)}
    dp, dg, do = shard[strategy]
    params, grads, optim = p_bytes * psi / dp, g_bytes * psi / dg, o_bytes * psi / do
    cpu = 0.0
    if offload_optimizer:
        cpu, optim = cpu + optim, 0.0
    if offload_param:
        cpu, params = cpu + params, 0.0
    return params, grads, optim, cpu


def activations(n_layer: int, n_head: int, n_embd: int, seq: int, micro_batch: int, checkpointing: bool,
                tp: int = 1) -> float:
    per_layer = seq * micro_batch * n_embd * (10 + 24 / tp + 5 * n_head * seq / (n_embd * tp))
    if checkpointing:
        return n_layer * 2 * seq * micro_batch * n_embd + per_layer
    return n_layer * per_layer


def estimate(size: str, world: int, strategy: str, precision: str = "bf16-mixed", seq: int = 1024,
             micro_batch: int = 8, offload_optimizer: bool = False, offload_param: bool = False,
             checkpointing: bool = False, vocab: int = 50257, tensor_parallel: int = 1, pipeline_parallel: int = 1,
             schedule: str = "1f1b", microbatches: int = 1, stages_per_rank: int = 1) -> Estimate:
    """Per rank; with pipeline parallelism `micro_batch` is one pipeline micro-batch."""
    n_layer, n_head, n_embd = SIZES[size]
    model_parallel = tensor_parallel * pipeline_parallel
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tensor x pipeline = {model_parallel}.")
    psi = rank_params(n_layer, n_embd, vocab, seq, tensor_parallel, pipeline_parallel)
    layers = n_layer
    if pipeline_parallel > 1:  # one stage's layers, for each micro-batch in flight
        layers = -(-n_layer // pipeline_parallel) * in_flight(schedule, pipeline_parallel, microbatches, stages_per_rank)
    p, g, o, cpu = model_states(psi, world // model_parallel, strategy, precision != "32-true", offload_optimizer,
                                offload_param)
    return Estimate(p, g, o, activations(layers, n_head, n_embd, seq, micro_batch, checkpointing, tensor_parallel), cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="small")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="zero3 = FSDP full shard")
    ap.add_argument("--precision", choices=["bf16-mixed", "16-mixed", "32-true"], default="bf16-mixed")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--offload-optimizer", action="store_true")
    ap.add_argument("--offload-param", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks per tensor-parallel group (trainer=tp)")
    ap.add_argument("--pipeline-parallel", type=int, default=1, help="pipeline stages K")
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches M per step")
    ap.add_argument("--stages-per-rank", type=int, default=1, help="v, for the interleaved schedule")
    a = ap.parse_args()
    try:
        e = estimate(a.size, a.world_size, a.strategy, a.precision, a.seq_len, a.micro_batch, a.offload_optimizer,
                     a.offload_param, a.activation_checkpointing, tensor_parallel=a.tensor_parallel,
                     pipeline_parallel=a.pipeline_parallel, schedule=a.schedule, microbatches=a.microbatches,
                     stages_per_rank=a.stages_per_rank)
    except ValueError as exc:
        ap.error(str(exc))
    gib = 2**30
    n_layer, _, n_embd = SIZES[a.size]
    data_parallel = a.world_size // (a.tensor_parallel * a.pipeline_parallel)
    layout = f"{a.strategy} over {data_parallel} data-parallel rank(s)"
    if a.tensor_parallel > 1:
        layout += f" x tensor parallel {a.tensor_parallel}"
    if a.pipeline_parallel > 1:
        layout += f" x pipeline {a.pipeline_parallel} ({a.schedule}, {a.microbatches} micro-batches)"
    print(f"GPT-2 {a.size}: {gpt2_params(n_layer, n_embd, 50257, a.seq_len) / 1e6:.1f}M params, {layout}, {a.precision}")
    for name in ("params", "grads", "optimizer", "activations"):
        print(f"  {name:<12}{getattr(e, name) / gib:9.2f} GiB per rank")
    print(f"  {'total':<12}{e.device_total / gib:9.2f} GiB per rank on the device, plus {e.cpu / gib:.2f} GiB in CPU memory")


if __name__ == "__main__":
    main()
