"""model.loss_chunk=N: the LM head and the token loss N tokens at a time, never the fp32 logits of every token.

The model's own forward runs as it always does; only its output embeddings module (`get_output_embeddings()`, the
LM head) computes, for that one call, the sum of the token losses over its input instead of the logits
(`head_computes_loss`, src/lm/objectives/loss.py's chunked_token_loss), and the model hands that sum on as its
`logits`. So the body runs in one process exactly as it does for the plain loss, and under a strategy that shards
the model from outside its forward, the loss is computed inside that forward: under FSDP2 the head's weight is the
one the root unit all-gathered for the forward, and the loss, the forward's output, carries its backward hooks.

That is the model's own function, its gradients included, only where its logits are its head's output, the head
maps each token alone and reads no trained tensor but its own parameters (chunked_token_loss computes their
gradients and its input's itself). `check_head` proves it for the model at hand, before step 1, on every rank alike,
on a probe batch: (1) the logits the model returns equal its head's output value for value, so nothing after the
head changes them (Granite's logits_scaling, Cohere's logit_scale and Gemma2's final_logit_softcapping do, unless 1,
1 and off); (2) the head a few tokens at a time equals the head on the whole batch in float64; (3) its output's
autograd graph reaches no trained tensor outside it; (4) the model hands the chunked sum on unchanged; and the head
holds no dropout. Else one sentence. It runs where the ranks hold the model (FSDP2's shards too): (1) and (4) exact in
the model's own dtype, (2) in float64 for the head alone, whose weight every strategy here holds whole in the forward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from src.core import dropout as keyed
from src.core.probe import probing
from src.lm.objectives.base import Objective
from src.lm.objectives.loss import chunked_token_loss
from src.utils.config import ArchitectureRefused, ConfigError, check_number
from src.utils.labels import IGNORE_INDEX

FLOAT64_TOL = 1e-9  # the head on a chunk and on every token run the same products: in float64 ~1e-16 apart


def check_loss_chunk(chunk: Any, objective: Objective, compile: Any) -> Optional[int]:
    """model.loss_chunk: null, or a number of tokens for an objective that trains on the token loss, the network not
    compiled whole."""
    if chunk is None:
        return None
    check_number("model.loss_chunk", chunk, lambda v: v >= 1, "a number of tokens >= 1, or null for the plain loss",
                 integer=True)  # fmt: skip
    if not objective.trains_token_loss:
        raise ConfigError(
            f"model.loss_chunk={chunk}: model/objective={objective.name} reads the model's logits itself, not the "
            "token loss; set model.loss_chunk=null."
        )
    if compile is True:  # (model.compile=auto compiles blocks where a chunk is set: src/lm/features/compiling.py)
        raise ConfigError(
            f"model.loss_chunk={chunk} with model.compile=true: a network compiled whole would trace its head's "
            "chunks and the backward each takes inside the forward; set model.compile=blocks (each chunk's loss is "
            "compiled by model.compile_loss) or model.loss_chunk=null."
        )
    return chunk


def check_strategy(chunk: Optional[int], declared: Any, stage: Any) -> None:
    """model.loss_chunk under a strategy (its capabilities, before any rank starts) that computes the loss elsewhere,
    or where its equality with one process is not proven."""
    if chunk is None:
        return
    if declared.own_loss:
        raise ConfigError(
            f"model.loss_chunk={chunk} with trainer=pipeline: its schedule computes the loss from the last stage's "
            "logits of every token; set model.loss_chunk=null, or train with trainer=fsdp."
        )
    if declared.zero_stages and stage == 3:
        raise ConfigError(
            f"model.loss_chunk={chunk} with DeepSpeed ZeRO-3 is not proven equal to one process (no run here had "
            "ZeRO-3 release the head's weight between the forward, where the chunks take its gradient, and the "
            "backward that hands it on): use trainer=fsdp, or trainer.strategy.stage=2, or model.loss_chunk=null."
        )


class ChunkedLoss:
    """The LM module's model.loss_chunk=N: its forward with the head computing the loss, and the head's probe, run
    once before the first step (or evaluation) on every rank alike."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.checked = chunk, False

    def forward_loss(self, module: Any, batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, torch.Tensor, Any]:
        """(the model's output with `logits` None, sum of the batch's token losses, number of targets)."""
        self.probe(module)  # a module used on its own (not by a Trainer) has had no on_fit_start
        labels, head = batch["labels"], output_head(module.hf_model, self.chunk)
        with head_computes_loss(head, labels, self.chunk, module.loss_function()):
            out = module.lm_forward(batch, **kwargs)
        loss_sum, out.logits = out.logits, None
        return out, loss_sum, (labels != IGNORE_INDEX).sum()

    def probe(self, module: Any) -> None:
        """check_head on the module's model, in eval mode, once."""
        if not self.checked:
            with probing(module):
                check_head(
                    module.hf_model, module.lm_forward, self.chunk, module.loss_function(), module.vocab_size,
                    module.device,
                )  # fmt: skip
            self.checked = True


def output_head(hf_model: nn.Module, chunk: int) -> nn.Module:
    """The model's LM head, or one sentence when it has none."""
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if head is None:
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {type(hf_model).__name__} has no output embeddings module "
            "(get_output_embeddings() is None) to compute the loss from; set model.loss_chunk=null."
        )
    return head


@contextlib.contextmanager
def replaced_forward(head: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Inside, a call of `head` runs forward(input, own), `own` being the head's forward as it was (its class's, or
    the one torch.compile set under model.compile=blocks), its output a plain tensor (`whole`); the head's hooks
    still run around it. Restored on exit."""
    own = head.forward
    saved = head.__dict__.get("forward")
    head.forward = lambda hidden, *args, **kwargs: forward(hidden, lambda x: whole(own(x, *args, **kwargs)))
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def whole(logits: torch.Tensor) -> torch.Tensor:
    """A plain tensor: trainer=tp's replicated head computes a replicated DTensor (its hooks make the input one),
    whose local value is the whole (differentiable; the loss's labels are plain tensors)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def head_computes_loss(head: nn.Module, labels: torch.Tensor, chunk: int, loss: Callable) -> Any:
    """Inside, `head` returns the sum of the token losses of `labels` over its input, `chunk` tokens at a time
    (chunked_token_loss with `loss`, summed_token_loss compiled or not), instead of the logits. Its parameters are
    read at the call: the ones a strategy put there for the forward (FSDP2's all-gathered weight)."""
    return replaced_forward(
        head, lambda hidden, own: chunked_token_loss(hidden, labels, own, trained(head), chunk, loss)[0]
    )


def trained(head: nn.Module) -> list[torch.Tensor]:
    """The head's parameters that train (a LoRA head's adapter; a frozen base weight gets no gradient)."""
    return [p for p in head.parameters() if p.requires_grad]


@torch.no_grad()
def check_head(
    hf_model: nn.Module, run: Callable[[dict], Any], chunk: int, loss: Callable, vocab_size: int, device: torch.device
) -> None:
    """Before step 1: the model's logits are its head's output and its head maps each token alone, on a probe batch of
    2 x 16 tokens; `run(batch)` is the module's forward (eval mode, eager). One sentence otherwise (module docstring)."""
    kind = type(hf_model).__name__
    head = output_head(hf_model, chunk)
    if keyed.has_dropout(head):
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {kind}'s LM head holds dropout, whose masks its chunks would not draw as the "
            "whole head does; set model.lora.dropout=0 (or leave the head out of model.lora.target_modules), or "
            "model.loss_chunk=null."
        )
    ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    labels = ids.roll(-1, 1)
    labels[:, -1], labels[0, :3] = IGNORE_INDEX, IGNORE_INDEX
    probe_chunk = min(chunk, 11)  # 32 tokens: 11 + 11 + 10 (or the run's N, when smaller)
    seen: dict[str, torch.Tensor] = {}

    def spy(hidden: torch.Tensor, own: Callable) -> torch.Tensor:
        seen["logits"] = own(hidden)
        rows = hidden[:, -labels.shape[1] :].double()
        with in_float64(head):  # the head as the model calls it, on [batch, seq, width], and as the chunks do
            seen["full"] = own(rows).flatten(0, 1)
            seen["chunks"] = torch.cat([own(part) for part in rows.flatten(0, 1).split(probe_chunk)])
        with torch.enable_grad():  # what its output's gradient would reach
            part = hidden.flatten(0, 1)[:probe_chunk].detach().requires_grad_()
            reached = trained_leaves(own(part))
        seen["outside"] = len(reached - {id(part)} - {id(p) for p in trained(head)})
        return seen["logits"]

    def summed(hidden: torch.Tensor, own: Callable) -> torch.Tensor:
        seen["sum"] = chunked_token_loss(hidden, labels, own, trained(head), chunk, loss)[0]
        return seen["sum"]

    try:
        with replaced_forward(head, spy):
            logits = run({"input_ids": ids}).logits
        with replaced_forward(head, summed):  # head_computes_loss, its sum kept
            handed = run({"input_ids": ids}).logits
    except Exception as error:  # noqa: BLE001 - any failure of the probe's forward is a refusal, said
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {kind}'s forward fails with its head computing the loss "
            f"({type(error).__name__}: {first}); set model.loss_chunk=null."
        ) from None
    _judge(hf_model, chunk, probe_chunk, logits, handed, seen)


def _judge(
    hf_model: nn.Module, chunk: int, probe_chunk: int, logits: torch.Tensor, handed: torch.Tensor, seen: dict
) -> None:
    """check_head's four tests on what its probe forwards saw, each failure one sentence."""
    kind = type(hf_model).__name__
    out = seen["logits"]
    if logits.shape != out.shape or not torch.equal(logits.double(), out.double()):
        gap = (logits.double() - out.double()).abs().max().item() if logits.shape == out.shape else "shapes"
        fields = ", ".join(f"{k}={v}" for k, v in after_head_fields(hf_model.config).items())
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {kind}'s logits are not its LM head's output "
            f"({'its config sets ' + fields + '; ' if fields else ''}{gap if isinstance(gap, str) else f'{gap:.3g}'}"
            " apart on a probe batch), so the head alone would train another function; set model.loss_chunk=null."
        )
    full, chunks = seen["full"], seen["chunks"]
    gap = (chunks - full).abs().max().item() if chunks.shape == full.shape else float("inf")
    if not gap <= FLOAT64_TOL * max(1.0, full.abs().max().item()):
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {kind}'s LM head gives other logits {probe_chunk} tokens at a time than on "
            f"all of them ({gap:.3g} apart in float64 on a probe batch); set model.loss_chunk=null."
        )
    if seen["outside"]:
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {kind}'s LM head reads {seen['outside']} trained tensor(s) that are not its "
            "parameters, whose gradients the chunks would not compute; set model.loss_chunk=null."
        )
    if handed.shape != () or not torch.equal(handed, seen["sum"]):
        raise ArchitectureRefused(
            f"model.loss_chunk={chunk}: {kind}'s forward does not hand its head's output on unchanged (the chunked "
            f"loss {seen['sum'].item():.6g} came back as a {tuple(handed.shape)} tensor); set model.loss_chunk=null."
        )


def trained_leaves(output: torch.Tensor) -> set[int]:
    """The ids of the tensors requiring a gradient that `output`'s autograd graph reaches (its AccumulateGrad nodes)."""
    found, todo, visited = set(), [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if hasattr(node, "variable"):
            found.add(id(node.variable))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def after_head_fields(config: Any) -> dict[str, Any]:
    """The config's fields that can change logits after the head (logits_scaling, logit_scale,
    final_logit_softcapping, ...), where set: named in the refusal."""
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    named = [k for k in fields if "logit" in k and "router" not in k and "attn" not in k]
    return {k: fields[k] for k in named if fields[k] not in (None, False, 1)}


@contextlib.contextmanager
def in_float64(head: nn.Module) -> Iterator[None]:
    """The head's floating-point parameters and buffers replaced by float64 copies, the originals put back on exit
    (whatever a strategy made them: the same objects): its own forward then computes in float64."""
    saved = []
    for module in head.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t.is_floating_point():
                saved.append((module, name, t))
                copy = t.detach().double()
                setattr(module, name, nn.Parameter(copy, requires_grad=False) if isinstance(t, nn.Parameter) else copy)
    try:
        yield
    finally:
        for module, name, t in saved:
            setattr(module, name, t)
