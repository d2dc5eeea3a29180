"""Pipeline parallelism (torch.distributed.pipelining) applied to a decoder LM from outside it, in one place.

Like torchtitan: the model knows nothing about ranks. `parallelize` splits the LitModule's HF model
into `pipeline_parallel_size x stages_per_rank` stages of equal layer counts (stage 0 = the embeddings +
its layers; the last stage = its layers + the final norm + the LM head; src/parallel/pipeline/stages.py
reads them from transformers' pipeline plan, or GPT-2's adapter), removes from this rank's copy every
module it does not hold (so its parameters, optimizer and checkpoint shard are its stages' only, under
the plain HF names), and returns a `Pipeline` that runs the schedule. Rank r of a pipeline group holds
stages r, r + P, r + 2P, ... (the order the interleaved schedule expects).

Exactness (each checked against one process in tests/test_pipeline.py):
* loss: every micro-batch's loss is the objective's *sum* of its losses (`loss_sum`, src/lm/objectives/base.py) times
  1/N, N = the targets of the whole global batch (its `n_targets`), with scale_grads=False: the gradients are those
  of the mean over the global batch's targets (a per-micro-batch mean would weight micro-batches wrongly);
* an MoE model's router loss: each micro-batch's adds router_aux_loss_coef x the sum of its sequences'
  load-balancing losses (each from the routing totals its stages carried: stages.Routing) x 1/S, S = the
  sequences of the global batch, as one process averages it over the step's sequences;
* tied weights (GPT-2, Qwen2's small sizes: lm_head is the token embedding): the first and last stages each
  hold a copy, so their gradients are summed over those two ranks (else each copy would learn half and they
  drift apart); untied models (Llama) sum nothing;
* the function: each stage runs the model's own forward over the layers it holds (stages.py), and
  `check_stages` proves the stages chained equal to the model's own forward before anything is pruned.

With `tensor_parallel_size` > 1 each stage's blocks are then split over the mesh's tensor-parallel dim
(src/parallel/tensor/plan.py, the same functions as trainer=tp): a stage's input and output stay whole
(replicated) tensors, so rank (dp, pp, tp) sends to (dp, pp + 1, tp) over its pipeline group as before. The
gradient sums and the clipping norm below then work on each rank's DTensor shards.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from src.architectures.config import architecture
from src.parallel.contract import ParallelLM, implemented_by
from src.parallel.mesh import mesh_sizes
from src.parallel.parallelize import parallelize as compose
from src.parallel.pipeline.stages import Routing, check_stages, prune, stage_class, stage_ranges
from src.parallel.tensor.plan import check_divisible, check_plan
from src.utils.config import ConfigError, check_int, check_unsupported, world_size

log = logging.getLogger(__name__)
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
MULTI_STAGE = ("Interleaved1F1B",)


def check_config(cfg: DictConfig) -> None:
    """Everything trainer=pipeline needs from the config, checked before any process starts (src/run/checks.py)."""
    s = cfg.trainer.strategy
    pp, schedule, m, v = s.pipeline_parallel_size, s.schedule, s.n_microbatches, s.stages_per_rank
    if schedule not in SCHEDULES:
        raise ConfigError(f"trainer.strategy.schedule={schedule!r} is not known: use one of {', '.join(SCHEDULES)}.")
    for key, value, low in (("pipeline_parallel_size", pp, 2), ("n_microbatches", m, 1), ("stages_per_rank", v, 1)):
        check_int(f"trainer.strategy.{key}", value, low)
    if (schedule in MULTI_STAGE) != (v > 1):
        raise ConfigError(
            f"trainer.strategy.stages_per_rank={v} does not fit schedule={schedule}: use stages_per_rank>=2 "
            "with Interleaved1F1B only, and stages_per_rank=1 with GPipe or 1F1B."
        )
    if schedule == "1F1B" and m < pp:
        raise ConfigError(
            f"trainer.strategy.n_microbatches={m} is fewer than the {pp} pipeline stages, which 1F1B "
            f"needs at least: set n_microbatches >= {pp} (>= {4 * pp} keeps the bubble under 20%)."
        )
    config = architecture(cfg.model)
    if config is None or not implemented_by(cfg.model):
        raise ConfigError(
            "trainer=pipeline splits transformers decoder LMs only (model=gpt2, llama, qwen2, mistral or "
            "causal_lm), and this model is not one."
        )
    stage_class(config)  # one sentence for a model without a pipeline plan
    if cfg.get("data", {}).get("packing", False):
        raise ConfigError(
            "data.packing=true with trainer=pipeline: the stages do not carry the position ids that keep packed "
            "conversations apart; set data.packing=false, or use trainer=fsdp, trainer=tp or trainer=ddp."
        )
    n_layer = config.num_hidden_layers
    if n_layer % (pp * v):
        key = "model.n_layer" if "n_layer" in cfg.model else "model.config.num_hidden_layers"
        raise ConfigError(
            f"{key}={n_layer} does not divide into pipeline_parallel_size={pp} x stages_per_rank="
            f"{v} = {pp * v} stages of equal size: pick a layer count that is a multiple of {pp * v}."
        )
    tp = OmegaConf.select(cfg, "trainer.strategy.tensor_parallel_size", default=1)
    check_int("trainer.strategy.tensor_parallel_size", tp)
    if tp > 1:
        check_plan(config)
        check_divisible(config, tp)
    # compile: untested; freeze: a stage with nothing to train has no optimizer
    check_unsupported(cfg, "pipeline", ("model.lora.enabled", "model.peft", "model.compile", "model.freeze"))
    if cfg.trainer.get("gradient_clip_val"):
        raise ConfigError(
            f"trainer.gradient_clip_val={cfg.trainer.gradient_clip_val} does not apply to trainer=pipeline "
            "(its optimizer step is its own): set trainer.strategy.gradient_clip_val instead."
        )
    if cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches must be 1 with trainer=pipeline: its micro-batches are the "
            "accumulation; raise trainer.strategy.n_microbatches instead."
        )
    world = world_size(cfg.trainer)
    if world is not None:  # one sentence if the mesh does not fit
        mesh_sizes(world, pipeline_parallel=pp, tensor_parallel=tp)
    # the global batch over data-parallel replicas x n_microbatches: src/run/checks.py, with every strategy's


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's part on this rank (its shard, or its whole value if replicated); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of a whole gradient: a tensor-parallel shard's is summed over its ranks."""
    squares = grad.double().pow(2).sum()
    return squares.full_tensor() if isinstance(squares, DTensor) else squares


class Pipeline:
    """This rank's stages and the schedules that run them, for training and for evaluation."""

    def __init__(
        self,
        stages: list[nn.Module],
        indices: list[int],
        n_stages: int,
        mesh: DeviceMesh,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        routing: Optional[Routing] = None,
        aux_coef: float = 0.0,
    ) -> None:
        self.loss_sum = loss_sum  # (logits, labels) -> the sum of a micro-batch's losses: the objective's own
        self.routing, self.aux_coef = routing, aux_coef  # an MoE model's router loss, carried through the stages
        self.modules, self.indices, self.n_stages = stages, indices, n_stages
        self.group = mesh["pipeline_parallel"].get_group()
        self.data_group = mesh["data_parallel"].get_group()
        self.schedule_name, self.n_microbatches, self.device = schedule, n_microbatches, device
        self.has_first, self.has_last = 0 in indices, n_stages - 1 in indices
        # the last stage's tensor-parallel ranks all compute the loss: one of them reports it (sums count it once)
        self.reports_loss = self.has_last and mesh["tensor_parallel"].get_local_rank() == 0
        self.scale = 1.0  # 1 / targets of the global batch while training; 1 in evaluation
        self.sequence_scale = 1.0  # 1 / sequences of the global batch (the router loss's mean)
        self.losses: list[torch.Tensor] = []  # this run's micro-batches' loss sums (x scale), on the last stage
        self.routing_sums: list[torch.Tensor] = []  # and their [router loss sum, tokens per expert..., sequences]
        self._schedules: dict[tuple, object] = {}
        self.tie_group = self._tie_group(mesh)
        self.tied = bool(getattr(stages[0], "tied", False))

    @staticmethod
    def _tie_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
        """The (first stage, last stage) ranks of this rank's pipeline group: they both hold the tied wte/lm_head."""
        pp = mesh["pipeline_parallel"]
        if pp.size() == 2:
            return pp.get_group()
        grid = mesh.mesh.permute(0, 2, 1).reshape(-1, pp.size())  # one row per pipeline group
        mine = None
        for row in grid.tolist():  # every rank creates every group, in the same order
            group = dist.new_group([row[0], row[-1]])
            if dist.get_rank() in row:
                mine = group
        return mine

    def loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss on the last stage: the sum of its losses x scale (+ the router loss's share)."""
        logits = output[0] if self.routing is not None else output
        loss = self.loss_sum(logits, labels) * self.scale
        self.losses.append(loss.detach().float())
        if self.routing is None:
            return loss
        mask, hits, probs = output[1:]
        balance = self.routing.balance(mask, hits, probs)
        count = balance.new_tensor([mask.shape[0]])
        self.routing_sums.append(torch.cat([balance.detach().sum()[None], hits.detach().sum(0), count]))
        return loss + self.aux_coef * balance.sum() * self.sequence_scale

    def _schedule(self, training: bool, batch_shape: tuple[int, ...]):
        """One schedule per (mode, batch shape): stages size their send/receive buffers on the first step."""
        if training:
            cls, m = SCHEDULES[self.schedule_name], self.n_microbatches
        else:  # forward only: GPipe's order (or its multi-stage form), in micro-batches that divide a short last batch
            cls = ScheduleLoopedBFS if len(self.modules) > 1 else ScheduleGPipe
            m = max(d for d in range(1, min(self.n_microbatches, batch_shape[0]) + 1) if batch_shape[0] % d == 0)
        key = (training, batch_shape, m)
        if key not in self._schedules:
            if len(self._schedules) >= 8:  # e.g. instruction data: one shape per padded length
                self._schedules.pop(next(iter(self._schedules)))
            stages = [
                PipelineStage(mod, i, self.n_stages, self.device, group=self.group)
                for mod, i in zip(self.modules, self.indices)
            ]
            single = cls in (ScheduleGPipe, Schedule1F1B)
            self._schedules[key] = cls(
                stages[0] if single else stages, n_microbatches=m, loss_fn=self.loss, scale_grads=False
            )
        return self._schedules[key]

    def run(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        training: bool,
        scale: float = 1.0,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Runs the batch through the pipeline (each micro-batch's loss: the sum of its losses x `scale`); returns
        the sum of those on the rank that reports the loss, 0 elsewhere (`stat_sums`: the router's)."""
        self.scale, self.losses, self.routing_sums = scale, [], []
        self.sequence_scale = 1.0 / (input_ids.shape[0] * dist.get_world_size(self.data_group))
        schedule = self._schedule(training, tuple(input_ids.shape))
        args = (input_ids,) if self.has_first else ()
        if self.has_first and self.routing is not None:  # the router loss's real tokens (right padding: the
            args += (torch.ones_like(input_ids) if attention_mask is None else attention_mask,)  # stages need no mask)
        target = labels if self.has_last else None
        losses: list[torch.Tensor] = []
        if training:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses)
        # a schedule's first step also calls the loss on empty tensors (torch infers its shapes so): the micro-batches'
        # calls are the last len(losses)
        self.losses = self.losses[len(self.losses) - len(losses) :]
        self.routing_sums = self.routing_sums[len(self.routing_sums) - len(losses) :]
        if not losses or not self.reports_loss:
            return torch.zeros((), device=self.device)
        return torch.stack(self.losses).sum()

    def stat_sums(self) -> Optional[torch.Tensor]:
        """An MoE model's [router loss sum, tokens per expert..., sequences] over this run's micro-batches, on the
        rank that reports the loss (zeros elsewhere: a sum over all ranks gives the global batch's); None for others."""
        if self.routing is None:
            return None
        if not self.routing_sums or not self.reports_loss:
            return torch.zeros(self.routing.num_experts + 2, device=self.device)
        return torch.stack(self.routing_sums).sum(0)

    def tied_parameters(self) -> list[nn.Parameter]:
        """This rank's copy of the tied input/output embedding (first or last stage), if the model ties them."""
        if not self.tied:
            return []
        found = [
            m.weight for mod in self.modules for m in (mod.input_embedding(), mod.output_embedding()) if m is not None
        ]
        return list({id(p): p for p in found}.values())

    def sync_grads(self, params: list[nn.Parameter]) -> None:
        """Tied weights: sum over first and last stage; then every gradient summed over the data-parallel ranks
        (each replica's loss is already its shard's share of the global batch's mean: see `run`'s scale)."""
        for p in self.tied_parameters():
            if p.grad is not None:
                dist.all_reduce(local(p.grad), group=self.tie_group)
        if dist.get_world_size(self.data_group) > 1:
            grads = [local(p.grad) for p in params if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=self.data_group)  # a sum: each replica's loss is its share of the global mean
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grads(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient, as torch.nn.utils.clip_grad_norm_ on one process:
        squares summed over this pipeline group's stages, the tied weight counted once (on the first stage)."""
        skip = {
            id(mod.output_embedding().weight) for mod in self.modules if mod.last and self.tied and not self.has_first
        }
        squares = sum(
            (squared_norm(p.grad) for p in params if p.grad is not None and id(p) not in skip),
            torch.zeros((), dtype=torch.float64, device=self.device),
        )
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt().float()
        if max_norm:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
        return norm


def parallelize(
    module: ParallelLM, mesh: DeviceMesh, schedule: str, n_microbatches: int, stages_per_rank: int, device: torch.device
) -> Pipeline:
    """Split `module` (src/parallel/contract.py's ParallelLM) into this rank's stages, in place; return the Pipeline
    that runs them, its last stage computing the loss of the module's objective (`loss_sum`, src/lm/objectives/base.py)."""
    hf = module.hf_model
    pp = mesh["pipeline_parallel"]
    n_stages = pp.size() * stages_per_rank
    blocks = module.blocks()
    layers = blocks[0][0]  # the model's decoder-layer list (the parent of every block)
    n_layer = len(layers)
    if n_layer % n_stages:
        raise ConfigError(
            f"The model's {n_layer} layers do not divide into {n_stages} pipeline stages of equal size: "
            f"pick a layer count that is a multiple of {n_stages}."
        )
    make = stage_class(hf.config)
    eager = module.attn_implementation == "eager"  # the model's model.attn_implementation
    routing = Routing(hf, module.router_balance) if module.router_balance is not None else None  # MoE: its aux loss
    build = {"routing": routing} if routing is not None else {}
    check_stages(hf, layers, n_stages, make, eager, routing)  # = the model's own forward, or one sentence
    rank = pp.get_local_rank()
    indices = [rank + k * pp.size() for k in range(stages_per_rank)]
    ranges = stage_ranges(n_layer, n_stages)
    keep = {b for i in indices for b in range(*ranges[i])}
    prune(hf, layers, keep, first=0 in indices, last=n_stages - 1 in indices)
    tp = mesh["tensor_parallel"]
    compose(  # this rank's blocks: split over the tensor-parallel ranks (as trainer=tp does), checkpointed, compiled
        module,
        tensor_parallel=tp if tp.size() > 1 else None,
        blocks=[block for block in blocks if int(block[1]) in keep],
        whole_model=False,  # a stage is part of a network
        **module.wrappers(),
    )
    stages = [make(hf, *ranges[i], first=i == 0, last=i == n_stages - 1, eager=eager, **build) for i in indices]
    for stage in stages:
        stage.tied = bool(getattr(hf.config, "tie_word_embeddings", False))  # the first and last stage hold copies
    log.info(
        f"Pipeline: {n_stages} stages of {n_layer // n_stages} block(s) over {pp.size()} rank(s), schedule={schedule}, "
        f"{n_microbatches} micro-batches; this rank holds stages {indices}"
    )
    coef = float(getattr(hf, "router_aux_loss_coef", 0.0)) if routing is not None else 0.0
    loss_sum = functools.partial(module.objective.loss_sum, module)
    return Pipeline(stages, indices, n_stages, mesh, schedule, n_microbatches, device, loss_sum, routing, coef)
