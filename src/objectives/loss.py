"""The token loss every language model here trains and evaluates on: sums and counts, never a mean of means."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.checkpoint import checkpoint
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
    chunk: int,
    loss: Callable = summed_token_loss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """summed_token_loss(head(hidden), labels) without the logits of every token at once (model.loss_chunk): the
    LM head `head` ([tokens, width] -> [tokens, vocabulary]) and `loss` (summed_token_loss, compiled or not) on
    `chunk` tokens at a time, each chunk's logits dropped after its sum and recomputed in backward (non-reentrant
    torch.utils.checkpoint, which keeps the autocast state; the head's weight gets one gradient, summed over the
    chunks), so at most one chunk's logits exist at a time. `hidden` [batch, seq(+virtual), width] is what the head
    receives; its last labels.shape[1] positions are the targets' (prompt tuning prepends virtual tokens).

    The same sums as summed_token_loss, added chunk by chunk instead of in one reduction (fp32 rounding apart:
    tests/test_chunked_loss.py derives the bound), and the same count of targets."""
    h = hidden[:, -labels.shape[1] :].flatten(0, 1)
    total = None
    for h_chunk, y_chunk in zip(h.split(chunk), labels.flatten().split(chunk)):
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_loss, head, loss, h_chunk, y_chunk, use_reentrant=False)
        else:  # evaluation: nothing to recompute
            part = _chunk_loss(head, loss, h_chunk, y_chunk)
        total = part if total is None else total + part
    return total, (labels != IGNORE_INDEX).sum()


def _chunk_loss(head: Callable, loss: Callable, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return loss(head(hidden)[None], labels[None])[0]


def token_loss_function(
    compile: Union[bool, str], run_logits: float, device: torch.device, model_compiled: bool = False
) -> Callable:
    """summed_token_loss as the model runs it (model.compile_loss): compiled by torch.compile when `compile` is
    true, or "auto" where the model is compiled too (`model_compiled`: model.compile is on, its compiling time
    already spent), or on a CPU for a training run whose logits hold at least AUTO_MIN_LOGITS values (`run_logits`:
    global batch x sequence length x vocabulary x optimizer steps; 0 outside training); else eager.

    Eagerly, the fp32 upcast, the log-softmax and the pick of each target are separate passes over a (tokens x
    vocabulary) tensor, forward and backward; compiled, inductor fuses them into one pass each way, and no fp32
    copy of the logits is kept. On a 2-core Xeon (`python -m bench.token_loss`: 4096 tokens, a 384-wide head, a
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
