"""What a causal LM's training step optimises, as a config choice: `model/objective=sft|dpo|reward|grpo`
(conf/model/objective/), each objective in its own module behind this one small interface, so that
CausalLMLitModule stays the same when an objective is added.

An objective owns its training step (a loss normalised over the whole optimizer step, so that N ranks train what one
process trains: LitModule.token_mean_loss), the statistics it logs, its evaluation metrics, what it adds to a
checkpoint, the kind of batch it trains on (checked against the data before the ranks start, src/run/checks.py) and
what it changes in the model it trains (dropout off, a frozen reference copy). `module` below is the
CausalLMLitModule, through `TrainedModule`: the few public members an objective may use, and no other
(tests/test_layers.py reads every objective's uses of `module` against it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn
from torchmetrics import Metric

from src.core.metrics import epoch_values


class TrainedModule(Protocol):
    """What an objective may use of the module it trains (src/lm/models/causal_lm.py, CausalLMLitModule)."""

    model: nn.Module  # the trained network (a peft model when an adapter trains)
    reference: Optional[nn.Module]  # the frozen starting policy, where needs_reference asked for one
    router_balance: Optional[Callable]  # a mixture-of-experts model's load-balancing loss, when it trains one
    seq_len: int
    base_seed: int  # one draw per run, the same on every rank (src/lm/init.py): seeds what must not vary
    device: torch.device
    trainer: Any
    training: bool

    @property
    def hf_model(self) -> nn.Module: ...  # the transformers model itself, also under an adapter

    def lm_forward(self, batch: dict[str, torch.Tensor], network: Optional[nn.Module] = None, **kwargs: Any): ...

    def loss_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_loss(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, torch.Tensor, torch.Tensor]: ...

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def token_mean_loss(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, batch_idx: int) -> torch.Tensor: ...

    def sequence_mean_loss(self, loss_sum: torch.Tensor, n_sequences: int, batch_idx: int) -> torch.Tensor: ...

    def log_train_loss(self, loss: torch.Tensor, batch_idx: int, sums: Optional[torch.Tensor] = None) -> None: ...

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any: ...

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


class Objective(nn.Module):
    name = ""  # its option in conf/model/objective/
    # What its batches hold, as the datamodule's `batch_kind` says: tokens (input ids with shifted targets: text,
    # instructions, chats) | pairs (a chosen and a rejected answer to one prompt: data=preference) | prompts
    # (data=prompts: GRPO samples the answers)
    batch_kind = "tokens"
    # the strategy capabilities (src/parallel/capabilities.py) that refuse it, each saying why where a strategy has
    # it: own_loss (the pipeline's last stage computes the loss from each micro-batch's logits and labels alone,
    # through `loss_sum` and `n_targets`, which an objective not refused under it gives)
    refused_under: tuple[str, ...] = ("own_loss",)
    generates = True  # whether the trained model writes text (callbacks.generate_text)
    # whether its loss adds a mixture-of-experts model's router load-balancing loss (model.router_aux_loss); an
    # objective that does not is refused such a model unless model.router_aux_loss=false (CausalLMLitModule)
    adds_router_loss = False
    # whether its loss is the token loss of the data's targets (module.forward_loss), which model.loss_chunk computes
    # from the head's input N tokens at a time; an objective that reads the logits itself is refused that option
    trains_token_loss = False

    def __init__(self) -> None:
        super().__init__()
        # what evaluation adds up over the ranks, per stage (torchmetrics: synced in compute())
        self.val_metrics = nn.ModuleDict()
        self.test_metrics = nn.ModuleDict()

    def prepare(self, model: nn.Module) -> list[str]:
        """Change the freshly built model in place, before an adapter is added (DPO: dropout off; a reward model:
        a scalar head). Returns the names of the parameters it added: the module gives them the layout-independent
        initial values of src/lm/init.py, and keeps them trainable under an adapter."""
        return []

    def needs_reference(self, adapter: bool) -> bool:
        """Whether the module keeps a frozen copy of the starting model (`module.reference`), sharded like it."""
        return False

    def check(self, module: TrainedModule) -> None:
        """One sentence (ConfigError) for a model this objective cannot train, once it is built."""

    def training_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The micro-batch's share of the step's loss (what LitModule.token_mean_loss returns); logs it through
        module.log_train_loss, with any per-step sums that train_metrics turns into means."""
        raise NotImplementedError

    def train_metrics(self, loss: torch.Tensor, sums: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """The logged training metrics from the step's loss (reduced over ranks) and the sums logged with it."""
        return {"train/loss": loss}

    def evaluation_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], metrics: nn.ModuleDict) -> None:
        """Add a validation or test batch to `metrics` (val_metrics or test_metrics)."""
        raise NotImplementedError

    # ---- what a strategy that computes the loss itself asks (own_loss: the pipeline's last stage) ----

    def loss_sum(self, module: TrainedModule, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The sum of a micro-batch's losses from the model's logits and its labels, with its gradient: the step's
        loss is these sums over its micro-batches, divided by the step's targets (`n_targets`)."""
        raise NotImplementedError

    def n_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The number of a batch's targets: what its loss sums are divided by, added over the step (where the data
        gives no table of them: LitModule.step_total) or over an evaluation."""
        raise NotImplementedError

    def add_sums(self, metrics: nn.ModuleDict, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
        """Add an evaluation batch's loss sum and targets to `metrics` (what evaluation_step adds)."""
        raise NotImplementedError

    def epoch_metrics(self, stage: str, metrics: nn.ModuleDict) -> dict[str, torch.Tensor]:
        """The stage's logged metrics over all ranks' batches; then reset for the next epoch."""
        return epoch_values(stage, metrics)

    def export(self, model: nn.Module, pad_id: Optional[int] = None) -> nn.Module:
        """The transformers model that export-hf saves: the trained model itself, unless the objective changed what
        it is (`pad_id`: the data's padding token)."""
        return model

    def on_fit_start(self, module: TrainedModule) -> None:
        """Before the first step (DPO: the precomputed reference table)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add what the objective needs to resume exactly."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read back what on_save_checkpoint added."""


class PairObjective(Objective):
    """An objective on preference pairs (DPO, a reward model): each pair's loss and statistics (`STATS`, the loss
    first) from `pair_sums`; the loss is their mean over the optimizer step's pairs (LitModule.token_mean_loss with
    one target per pair), so 1 x 8 = 2 x 4 = 1 x 4 x accumulation 2 pairs."""

    batch_kind = "pairs"
    STATS: tuple[str, ...] = ("loss",)

    def __init__(self) -> None:
        super().__init__()
        self.val_metrics = nn.ModuleDict({"pairs": MeanStats(self.STATS)})
        self.test_metrics = nn.ModuleDict({"pairs": MeanStats(self.STATS)})

    def pair_sums(self, module: TrainedModule, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums over the batch's pairs of each of STATS (the loss first, with its gradient) and the number of
        pairs; evaluation's padding pairs (no targets) left out."""
        raise NotImplementedError

    def training_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The mean over the step's pairs; the other statistics ride along with the logged loss."""
        sums, pairs = self.pair_sums(module, batch)
        loss = module.token_mean_loss(sums[0], pairs, batch_idx)
        module.log_train_loss(loss, batch_idx, torch.cat([sums[1:].detach(), pairs[None].to(sums.dtype)]))
        return loss

    def train_metrics(self, loss: torch.Tensor, sums: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        return {"train/loss": loss, **{f"train/{name}": s / sums[-1] for name, s in zip(self.STATS[1:], sums[:-1])}}

    def evaluation_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], metrics: nn.ModuleDict) -> None:
        metrics["pairs"].update(*self.pair_sums(module, batch))


class MeanStats(Metric):
    """Σ of each of `names` (per-item statistics: a preference pair's or a GRPO prompt's, its loss first) over the
    items of all ranks, and their count: compute() gives the means. Evaluation's padding items (no targets) are not
    counted, so every item counts once on any number of ranks."""

    full_state_update = False

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        self.add_state("sums", default=torch.zeros(len(names), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("pairs", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, sums: torch.Tensor, pairs: torch.Tensor) -> None:
        self.sums += sums.detach().double()
        self.pairs += pairs

    def compute(self) -> dict[str, torch.Tensor]:
        return {name: (s / self.pairs).float() for name, s in zip(self.names, self.sums)}


def disable_dropout(model: nn.Module) -> None:
    """Dropout off in the policy (and so in its copy), as TRL's DPOTrainer and GRPOTrainer do by default: with dropout
    on, the policy's log-probs at the start differ from the reference's and the rewards start away from zero."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
