"""Per-rank memory estimate for training a decoder LM: model states by strategy, plus activations.

    python -m src.tools.memory --size small --world-size 8 --strategy zero2 --precision bf16-mixed
    python -m src.tools.memory --model llama --world-size 8 --strategy zero3   # LlamaConfig's defaults (7B)
    python -m src.tools.memory --model qwen2 --config num_hidden_layers=24 hidden_size=896 intermediate_size=4864 \
        num_attention_heads=14 num_key_value_heads=2 tie_word_embeddings=true vocab_size=151936 \
        --world-size 2 --tensor-parallel 2                                     # any config field (Qwen2-0.5B: 494M)
    python -m src.tools.memory --model path/to/checkpoint_dir --world-size 4 --strategy zero3
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

For --model (any transformers decoder: a model type with its config's defaults, or a pretrained dir or hub
name) the parameters per rank are counted exactly on the meta device, split as trainer=tp and trainer=pipeline
split them (the model's tensor-parallel plan; its embeddings on the first stage, its final norm and head on the
last). Its activations use the formula above with its hidden size and heads: exact in form for GPT-2, an
approximation for SwiGLU MLPs and grouped-query attention (not checked against a measurement).

Model parallelism divides the model before the strategy above shares what is left over the data-parallel
ranks (world / (tensor x pipeline)):
  tensor parallel t (src/parallel/tensor/plan.py): each block's matrices (12d^2) and column-split
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
from typing import Any

from src.architectures.gpt2_adapter import GPT2
from src.lm.hf import decoder_layers
from src.parallel.tensor import experts
from src.parallel.tensor.plan import check_divisible, check_plan

SIZES = {
    "tiny": (4, 4, 128),
    "small": (12, 12, 768),
    "medium": (24, 16, 1024),
    "large": (36, 20, 1280),
    "xl": (48, 25, 1600),
}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def gpt2_params(n_layer: int, n_embd: int, vocab: int = 50257, n_ctx: int = 1024) -> int:
    """GPT-2's exact count (its adapter's, src/architectures/gpt2_adapter.py) for a size given by its numbers."""
    from transformers import GPT2Config

    return GPT2.param_count(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=1, vocab_size=vocab, n_positions=n_ctx))


def rank_params(
    n_layer: int,
    n_embd: int,
    vocab: int = 50257,
    n_ctx: int = 1024,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
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


def model_config(model: str, fields: dict):
    """The transformers config of `model`: a model type (gpt2, llama, qwen2, mistral, ...) with its defaults, or a
    pretrained dir / hub name; `fields` set on top."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model in CONFIG_MAPPING:
        return AutoConfig.for_model(model, **fields)
    config = AutoConfig.from_pretrained(model)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


COLWISE_STYLES = ("colwise", "colwise_gather_output")  # weight and bias split by output rows
ROWWISE_STYLES = ("rowwise", "rowwise_split_input")  # weight split by input columns, bias whole


def config_rank_params(config, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> int:
    """Parameters on the fullest rank of any decoder, counted on a meta-device build of `config`: each layer's
    parameters split by the model's tensor-parallel plan (colwise styles: weight and bias; rowwise styles:
    weight; an experts module: all of its weights; the rest, per-head norms too, replicated), ceil(layers / K) layers per stage, the parts before the layer list on the first stage and the
    parts after it plus the head (a copy of a tied embedding) on the last."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    t, k = tensor_parallel, pipeline_parallel
    plan = check_plan(config) if t > 1 else {}
    if t > 1:
        check_divisible(config, t)
    layers = decoder_layers(model)
    per_layer = 0
    for name, param in layers[0].named_parameters():
        module, kind = name.rsplit(".", 1)
        style = plan.get(module)
        split = (
            style in COLWISE_STYLES or (style in ROWWISE_STYLES and kind == "weight") or style == experts.MODULE_STYLE
        )
        per_layer += param.numel() // t if split else param.numel()
    body = next(m for m in model.modules() if any(c is layers for c in m.children()))
    children = list(body.children())
    at = children.index(layers)

    def count(modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    head = model.get_output_embeddings().weight.numel()
    first, last = count(children[:at]), count(children[at + 1 :]) + head
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    blocks = -(-len(layers) // k) * per_layer
    if k == 1:
        return blocks + first + last - (head if tied else 0)
    return blocks + max(first, last)


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


def model_states(
    psi: int, world: int, strategy: str, mixed: bool, offload_optimizer: bool = False, offload_param: bool = False
) -> tuple[float, float, float, float]:
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


def activations(
    n_layer: int, n_head: int, n_embd: int, seq: int, micro_batch: int, checkpointing: bool, tp: int = 1
) -> float:
    per_layer = seq * micro_batch * n_embd * (10 + 24 / tp + 5 * n_head * seq / (n_embd * tp))
    if checkpointing:
        return n_layer * 2 * seq * micro_batch * n_embd + per_layer
    return n_layer * per_layer


def estimate(
    size: str,
    world: int,
    strategy: str,
    precision: str = "bf16-mixed",
    seq: int = 1024,
    micro_batch: int = 8,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    checkpointing: bool = False,
    vocab: int = 50257,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    stages_per_rank: int = 1,
    config=None,
) -> Estimate:
    """Per rank; with pipeline parallelism `micro_batch` is one pipeline micro-batch. `config`: any decoder's
    transformers config instead of the GPT-2 `size`."""
    model_parallel = tensor_parallel * pipeline_parallel
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tensor x pipeline = {model_parallel}.")
    if config is not None:
        n_layer, n_head, n_embd = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        psi = config_rank_params(config, tensor_parallel, pipeline_parallel)
    else:
        n_layer, n_head, n_embd = SIZES[size]
        psi = rank_params(n_layer, n_embd, vocab, seq, tensor_parallel, pipeline_parallel)
    layers = n_layer
    if pipeline_parallel > 1:  # one stage's layers, for each micro-batch in flight
        layers = -(-n_layer // pipeline_parallel) * in_flight(
            schedule, pipeline_parallel, microbatches, stages_per_rank
        )
    p, g, o, cpu = model_states(
        psi, world // model_parallel, strategy, precision != "32-true", offload_optimizer, offload_param
    )
    return Estimate(p, g, o, activations(layers, n_head, n_embd, seq, micro_batch, checkpointing, tensor_parallel), cpu)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="small", help="GPT-2's sizes (without --model)")
    ap.add_argument(
        "--model",
        help="any transformers decoder: a model type (llama, qwen2, mistral, gpt2: its config's "
        "defaults) or a pretrained dir / hub name",
    )
    ap.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="config fields set on --model's")
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
    return ap


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    try:
        fields = {k: _number(v) for k, v in (item.split("=", 1) for item in a.config)}
        config = model_config(a.model, fields) if a.model else None
        e = estimate(
            a.size,
            a.world_size,
            a.strategy,
            a.precision,
            a.seq_len,
            a.micro_batch,
            a.offload_optimizer,
            a.offload_param,
            a.activation_checkpointing,
            tensor_parallel=a.tensor_parallel,
            pipeline_parallel=a.pipeline_parallel,
            schedule=a.schedule,
            microbatches=a.microbatches,
            stages_per_rank=a.stages_per_rank,
            config=config,
        )
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError: one sentence each
        ap.error(str(exc).strip().splitlines()[0])
    report(a, config, e)


def report(a: argparse.Namespace, config: Any, e: Estimate) -> None:
    """The estimate `e` for the command line `a` (and --model's `config`, else None), per rank in GiB."""
    gib = 2**30
    n_layer, _, n_embd = SIZES[a.size]
    data_parallel = a.world_size // (a.tensor_parallel * a.pipeline_parallel)
    layout = f"{a.strategy} over {data_parallel} data-parallel rank(s)"
    if a.tensor_parallel > 1:
        layout += f" x tensor parallel {a.tensor_parallel}"
    if a.pipeline_parallel > 1:
        layout += f" x pipeline {a.pipeline_parallel} ({a.schedule}, {a.microbatches} micro-batches)"
    if config is not None:
        total = config_rank_params(config)
        print(f"{config.model_type} ({a.model}): {total / 1e6:.1f}M params, {layout}, {a.precision}")
    else:
        print(
            f"GPT-2 {a.size}: {gpt2_params(n_layer, n_embd, 50257, a.seq_len) / 1e6:.1f}M params, {layout}, "
            f"{a.precision}"
        )
    for name in ("params", "grads", "optimizer", "activations"):
        print(f"  {name:<12}{getattr(e, name) / gib:9.2f} GiB per rank")
    print(
        f"  {'total':<12}{e.device_total / gib:9.2f} GiB per rank on the device, plus {e.cpu / gib:.2f} GiB in CPU memory"
    )


def _number(text: str):
    """A --config value: int, float, true/false, or the string itself."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
