"""The token loss every language model here trains and evaluates on: sums and counts, never a mean of means."""

from __future__ import annotations

import torch
from torchmetrics import Metric

from src.utils.labels import IGNORE_INDEX


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, number of targets), in fp32.

    Labels are already shifted, the convention of all data here: labels[t] is the target of
    position t (the token after input t), -100 where there is none. A batch with no target gives
    exactly (0, 0), never NaN, so it can be added to any sum; a NaN logit still gives NaN.
    """
    logits = logits[:, -labels.shape[1] :]  # prompt tuning prepends virtual tokens to the logits
    loss = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


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
