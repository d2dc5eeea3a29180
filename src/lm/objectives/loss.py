"""The token loss every language model here trains and evaluates on: sums and counts, never a mean of means."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import Metric

from src.utils.config import ConfigError
from src.utils.labels import IGNORE_INDEX
from src.utils.precision import at_least_fp32

AUTO_MIN_LOGITS = 2e9  # compile_loss=auto compiles when a training run's logits hold this many values (below)


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, number of targets), in fp32 (fp64 for fp64 logits).

    Labels are already shifted, the convention of all data here: labels[t] is the target of
    position t (the token after input t), -100 where there is none. A batch with no target gives
    exactly (0, 0), never NaN, so it can be added to any sum; a NaN logit still gives NaN.
    """
    logits = logits[:, -labels.shape[1] :]  # prompt tuning prepends virtual tokens to the logits
    loss = torch.nn.functional.cross_entropy(
        at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


def chunked_token_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.Tensor],
    chunk: int,
    loss: Callable = summed_token_loss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """summed_token_loss(head(hidden), labels) without the logits of every token at once (model.loss_chunk): the
    LM head `head` ([tokens, width] -> [tokens, vocabulary]; `params`, the trainable tensors it reads) and `loss`
    (summed_token_loss, compiled or not) `chunk` tokens at a time. `hidden` [batch, seq(+virtual), width] is what the
    head receives; its last labels.shape[1] positions are the targets' (prompt tuning prepends virtual tokens).

    With gradients on, each chunk's forward is followed at once by its backward (Liger's fused linear cross-entropy,
    through the head's own autograd): the chunk's logits are dropped, and what is kept for the loss's backward is
    the gradient of the hidden states and of the head's parameters, summed over the chunks (ChunkedLoss). So at most
    one chunk's logits exist at a time, and the head's matrix products are the plain loss's three, not four as a
    recomputation in backward would take. The same sums as summed_token_loss, added chunk by chunk instead of in one
    reduction (fp32 rounding apart: tests/test_chunked_loss.py derives the bound), and the same count of targets."""
    h, y = hidden[:, -labels.shape[1] :].flatten(0, 1), labels.flatten()
    if torch.is_grad_enabled():
        total = ChunkedLoss.apply(h, y, head, chunk, loss, *params)
    else:  # evaluation: the sums alone
        total = sum(loss(head(h_part)[None], y_part[None])[0] for h_part, y_part in zip(h.split(chunk), y.split(chunk)))
    return total, (labels != IGNORE_INDEX).sum()


class ChunkedLoss(torch.autograd.Function):
    """forward(hidden [tokens, width], labels [tokens], head, chunk, loss, *params) -> the summed token loss; its
    gradients w.r.t. `hidden` and `params` computed in forward, chunk by chunk (chunked_token_loss), and scaled by the
    incoming gradient in backward: the loss is a sum, so d total / d x is the sum of the chunks' d part / d x."""

    @staticmethod
    def forward(ctx, hidden, labels, head, chunk, loss, *params):
        wanted = ctx.needs_input_grad[0], *ctx.needs_input_grad[5:]
        total, d_hidden, d_params = None, [], [None] * len(params)
        for h_part, y_part in zip(hidden.split(chunk), labels.split(chunk)):
            with torch.enable_grad():
                h_part = h_part.detach().requires_grad_(wanted[0])
                part = loss(head(h_part)[None], y_part[None])[0]
                inputs = [x for x, want in zip((h_part, *params), wanted) if want]
                grads = list(torch.autograd.grad(part, inputs)) if inputs else []
            if wanted[0]:
                d_hidden.append(grads.pop(0))
            for i, want in enumerate(wanted[1:]):
                if want:
                    grad = grads.pop(0)
                    d_params[i] = grad if d_params[i] is None else d_params[i].add_(grad)
            total = part.detach() if total is None else total + part.detach()
        ctx.save_for_backward(torch.cat(d_hidden) if d_hidden else None, *d_params)
        return total

    @staticmethod
    def backward(ctx, grad):
        d_hidden, *d_params = ctx.saved_tensors
        scaled = [None if d is None else d * grad for d in (d_hidden, *d_params)]
        return scaled[0], None, None, None, None, *scaled[1:]


def token_loss_function(
    compile: Union[bool, str], run_logits: float, device: torch.device, model_compiled: bool = False
) -> Callable:
    """summed_token_loss as the model runs it (model.compile_loss): compiled by torch.compile when `compile` is
    true, or "auto" where the model is compiled too (`model_compiled`: model.compile is on, its compiling time
    already spent), or on a CPU for a training run whose logits hold at least AUTO_MIN_LOGITS values (`run_logits`:
    global batch x sequence length x vocabulary x optimizer steps; 0 outside training); else eager.

    Eagerly, the fp32 upcast, the log-softmax and the pick of each target are separate passes over a (tokens x
    vocabulary) tensor, forward and backward; compiled, inductor fuses them into one pass each way, and no fp32
    copy of the logits is kept. On a 2-core Xeon (`python -m bench.profile.token_loss`: 4096 tokens, a 384-wide head, a
    32000-token vocabulary), the head's forward and backward take 1480 ms eagerly and 700 compiled in bf16 (737 for
    its matrix products alone), 2208 and 1753 ms in fp32: 4-6 ns saved per logit in bf16, 1-3.5 ns in fp32 over two
    runs (docs/performance.md). Compiling costs about 3 s of each process (9 s the first time on a machine, until
    inductor's cache in the temp dir holds the kernels); auto compiles where the run saves more than that: from
    2e9 logits, at least 8 s in bf16 (2 s in fp32).
    The decision reads only the config, so every device count makes the same one.
    """
    if compile not in (True, False, "auto"):
        raise ConfigError(f"model.compile_loss={compile!r}: use true, false or auto.")
    if compile == "auto":
        compile = model_compiled or (device.type == "cpu" and run_logits >= AUTO_MIN_LOGITS)
    return torch.compile(summed_token_loss) if compile else summed_token_loss


def run_logits(trainer: Optional[Any], seq_len: int, vocab_size: int) -> float:
    """The values in all the logits a training run computes: global batch x seq_len x vocabulary x optimizer steps
    (inf for a run without an end); 0 outside fit (eval.py, a validation or test run, a module without a Trainer)."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return 0
    return trainer.datamodule.global_batch_size * seq_len * vocab_size * trainer.estimated_stepping_batches


class TokenMeanLoss(Metric):
    """Σ token losses / Σ targets over all ranks: torchmetrics all-gathers the two sums, not a mean of
    means. Unlike MeanMetric it never drops NaNs (a diverged model must show NaN), and batches
    without targets add exactly 0 to both sums."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("n_targets", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
        self.loss_sum += loss_sum.detach().float()
        self.n_targets += n_targets

    def compute(self) -> torch.Tensor:
        return self.loss_sum / self.n_targets
