"""Direct Preference Optimization (Rafailov et al. 2023) as an objective (src/lm/objectives/base.py): `model/objective=dpo`
with `data=preference`. No reward model, no sampling: a frozen reference policy and a loss on the log-probability
ratios of a chosen and a rejected answer.

The losses, named as in TRL's DPOTrainer (h = (log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r)), sums over
the answer tokens):
- sigmoid: -(1-ε) log σ(βh) - ε log σ(-βh); ε = label_smoothing > 0 is conservative DPO (cDPO);
- hinge:   max(0, 1 - βh) (SLiC);
- ipo:     (h' - 1/(2β))², h' from log-probs averaged over each answer's tokens (Azar et al. 2023, as TRL does);
plus sft_weight x the chosen answer's NLL per token (RPO, Pang et al. 2024: per answer, then the mean over pairs).

Exact from 1 device to N: every term is a per-pair quantity and the loss is their mean over the optimizer step's
pairs (the normaliser of LitModule.token_mean_loss, with one "target" per pair). TRL's rpo_alpha instead takes the
token mean over its micro-batch, which changes with the split; ours does not.

The reference policy (`reference_logps`): the model with its peft adapter disabled (LoRA & co.: no second copy);
a precomputed table (`precompute_reference`: one pass before training, kept in the checkpoint); else a frozen
copy of the starting weights that strategies shard like the policy (CausalLMLitModule.networks()).
An MoE model's router loss is not added (refused: set model.router_aux_loss=false).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from src.lm.objectives.base import PairObjective, TrainedModule, disable_dropout
from src.lm.objectives.loss import IGNORE_INDEX
from src.utils.config import ConfigError, check_number
from src.utils.precision import at_least_fp32

log = logging.getLogger(__name__)

LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the target tokens' log-probabilities, number of targets) per row, in fp32 (fp64 for fp64 logits);
    labels already shifted."""
    logits = logits[:, -labels.shape[1] :]  # prompt tuning prepends virtual tokens
    token = -F.cross_entropy(
        at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    return token.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)


class DPO(PairObjective):
    """The objective's settings, its loss and the precomputed reference table."""

    name = "dpo"
    # per pair, summed over pairs and logged as their mean (train steps and evaluation alike)
    STATS = (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        sft_weight: float = 0.0,
        precompute_reference: bool = False,
        disable_dropout: bool = True,
    ) -> None:
        super().__init__()
        check_number(
            "model.objective.beta", beta, lambda v: v > 0,
            "a positive number (0.1 is usual; smaller lets the policy move further from the reference)",
        )  # fmt: skip
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"model.objective.loss_type={loss_type!r}: use one of {', '.join(LOSS_TYPES)}.")
        if not 0 <= label_smoothing < 0.5:
            raise ConfigError(
                f"model.objective.label_smoothing={label_smoothing!r}: use a probability in [0, 0.5) that a "
                "pair's preference is flipped (conservative DPO), or 0."
            )
        if label_smoothing and loss_type != "sigmoid":
            raise ConfigError(f"model.objective.label_smoothing applies to loss_type=sigmoid only, not {loss_type}.")
        if not sft_weight >= 0:
            raise ConfigError(
                f"model.objective.sft_weight={sft_weight!r}: use 0 (off) or a positive weight (RPO uses 1)."
            )
        self.beta, self.loss_type, self.label_smoothing = float(beta), loss_type, float(label_smoothing)
        self.sft_weight, self.precompute, self.disable_dropout = (
            float(sft_weight),
            precompute_reference,
            disable_dropout,
        )
        self.table: Optional[torch.Tensor] = None  # (pairs, 2) reference log-probs of chosen and rejected
        self.fingerprint: Optional[str] = None  # of the data the table was computed on

    # ---- the objective (src/lm/objectives/base.py) ----

    def prepare(self, model: nn.Module) -> list[str]:
        if self.disable_dropout:
            disable_dropout(model)
        return []

    def needs_reference(self, adapter: bool) -> bool:
        return not adapter and not self.precompute

    def on_fit_start(self, module: TrainedModule) -> None:
        if self.precompute:  # before the first step moves the policy
            self.precompute_table(module, module.trainer.datamodule)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.precompute:
            checkpoint["dpo_reference"] = self.state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "dpo_reference" in checkpoint:
            self.load_state(checkpoint["dpo_reference"])

    # ---- the loss ----

    def pair_stats(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """(pairs, len(STATS)): per pair the loss and the logged statistics. `logps`, `counts`: (2B,) policy sums and
        target counts, chosen rows first; `ref`: (2B,) the reference's sums."""
        chosen, rejected = logps.chunk(2)
        n_chosen, n_rejected = counts.clamp(min=1).chunk(2)
        chosen_ratio, rejected_ratio = (logps - ref).chunk(2)
        h = chosen_ratio - rejected_ratio
        if self.loss_type == "sigmoid":
            eps = self.label_smoothing
            loss = -(1 - eps) * F.logsigmoid(self.beta * h) - eps * F.logsigmoid(-self.beta * h)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - self.beta * h)
        else:  # ipo: per-token averages of the log-ratios
            loss = (chosen_ratio / n_chosen - rejected_ratio / n_rejected - 1 / (2 * self.beta)) ** 2
        if self.sft_weight:
            loss = loss - self.sft_weight * chosen / n_chosen
        rewards = self.beta * torch.stack([chosen_ratio, rejected_ratio]).detach()
        margin = rewards[0] - rewards[1]
        return torch.stack(
            [loss, rewards[0], rewards[1], (margin > 0).to(loss.dtype), margin, chosen.detach(), rejected.detach()],
            dim=1,
        )

    def pair_sums(self, module: TrainedModule, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums over the batch's pairs of each of STATS (the loss first, with its gradient) and the number of
        pairs; evaluation's padding pairs (no targets) left out. `module` is the CausalLMLitModule."""
        logits = module.lm_forward(batch).logits
        logps, counts = answer_logps(logits, batch["labels"])
        stats = self.pair_stats(logps, counts, self.reference_logps(module, batch))
        real = counts.chunk(2)[0] > 0
        return (stats * real[:, None]).sum(dim=0), real.sum()

    # ---- the reference policy ----

    def reference_logps(self, module: TrainedModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(2B,) the reference's log-prob sums of the batch's rows."""
        if self.precompute:
            if self.table is None:
                raise RuntimeError("The precomputed reference log-probs are missing (precompute runs in on_fit_start).")
            rows = self.table.to(batch["pair_index"].device)[batch["pair_index"]]  # (B, 2)
            return torch.cat([rows[:, 0], rows[:, 1]])
        with torch.no_grad():
            model, reference = module.model, module.reference
            if reference is None:  # a peft adapter: the reference is the model without it
                with model.disable_adapter():
                    logits = module.lm_forward(batch).logits
            else:
                logits = module.lm_forward(batch, network=reference).logits
            return answer_logps(logits, batch["labels"])[0]

    @torch.no_grad()
    def precompute_table(self, module: TrainedModule, datamodule: Any) -> None:
        """One pass of the starting policy over every split's pairs, each rank its shard (the evaluation sampler:
        every rank the same number of forwards, which FSDP2 and ZeRO-3 need); gathered so that every rank holds
        the whole table. Called before the first step, or not at all when a checkpoint brought the table."""
        fingerprint = data_fingerprint(datamodule)
        if self.table is not None:
            if self.fingerprint != fingerprint:
                raise ConfigError(
                    "model.objective.precompute_reference: the checkpoint's reference log-probs were computed "
                    "on other preference pairs than this run reads (data.path, the tokenizer, seq_len or "
                    "the splits changed); resume with the same data, or start a new run."
                )
            return
        splits = datamodule.splits
        # indexed by the pair's number among the file's pairs (a Subset's pairs keep their numbers)
        table = torch.zeros(1 + max((item[0] for split in splits.values() for item in pairs_of(split)), default=-1), 2)
        was_training = module.training
        module.eval()
        for split in (name for name, pairs in splits.items() if len(pairs)):  # data.val_fraction=0: no val split
            for batch in datamodule.eval_loader(split):
                batch = module.transfer_batch_to_device(batch, module.device, 0)
                logps, counts = answer_logps(module.lm_forward(batch).logits, batch["labels"])
                rows = torch.stack(
                    [*logps.chunk(2), counts.chunk(2)[0].to(logps.dtype), batch["pair_index"].to(logps.dtype)], dim=1
                )
                rows = module.all_gather(rows).reshape(-1, 4).cpu()
                real = rows[:, 2] > 0  # padding pairs have no targets
                table[rows[real, 3].long()] = rows[real, :2].float()
        module.train(was_training)
        self.table, self.fingerprint = table, fingerprint
        log.info(f"Reference log-probs precomputed for {len(table)} pairs; training holds one model")

    def state(self) -> dict[str, Any]:
        return {"table": self.table, "fingerprint": self.fingerprint}

    def load_state(self, state: dict[str, Any]) -> None:
        self.table, self.fingerprint = state["table"], state["fingerprint"]


def data_fingerprint(datamodule: Any) -> str:
    """Changes when any split's token ids or order change."""
    digest = hashlib.sha256()
    for name, split in sorted(datamodule.splits.items()):
        digest.update(f"{name}:{len(split)}".encode())
        for item in pairs_of(split):
            for array in item[1:]:
                digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def pairs_of(split: Any) -> Iterator[tuple]:
    """A split's items, (pair index, chosen ids, chosen labels, rejected ids, rejected labels), also where the
    split is a Subset of them (data.overfit_batches)."""
    return (split[i] for i in range(len(split)))
