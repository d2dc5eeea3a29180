"""UserModule, a callback that changes the module it trains from outside: it rebinds the module's `self.log` and
`self.log_dict` (`rebind_log`) and its `self.all_gather`, turns on its metrics' `dist_sync_on_step` and keys its
dropouts. That makes exact three habits of any LightningModule (the template's LitModule or a plain one, as
Lightning's docs teach) that train or report another model on N ranks than on 1:

- `self.log(...)` / `self.log_dict(...)` without `sync_dist`: Lightning logs rank 0's own value (its default is
  sync_dist=False), not the global batch's. Here a call that does not say reduces over the ranks (sync_dist=True,
  with the call's reduce_fx): a mean of equal micro-batches' means is the global batch's mean, and an evaluation mean
  (Lightning weights each batch by its size and divides the synced sums) counts each sample once where no batch holds
  padding (src/core/plain_loaders.py). On 1 process the sync does nothing. A call that says sync_dist=False keeps
  rank 0's value: LitModule's own calls, whose values are already reduced, say so. Lightning adds the batch sizes it
  weights a mean by in an integer tensor and divides their synced mean as integers (57 rows on 2 ranks count as 28):
  here the batch size goes in as a float (the batch's own, as Lightning would infer it, or the call's).
- a torchmetrics metric logged each step (`self.train_acc(logits, y); self.log("train/acc", self.train_acc)`):
  Lightning logs the value of the rank's own batch. Here every metric of the module syncs its batch's states before
  that value is computed (torchmetrics' `dist_sync_on_step`): the global batch's value. Epoch values were synced
  already.
- dropout: each rank draws its masks from its own generator, so a sample gets another mask on every layout. Here
  each `nn.Dropout` becomes a KeyedDropout, a transformers model's attention dropout (SDPA's `dropout_p`, eager
  attention's) and the `F.dropout` a module's own forward calls are keyed the same way (src/core/dropout.py
  key_module), and a training batch's masks are keyed by the run's seed, the step and its samples' dataset indices,
  read from the training sampler: the masks one process draws. Any other random number a training step draws
  itself (`torch.randn`, a Tensor's `normal_`, attention that drops inside its kernel) would come from each rank's
  generator too: on N ranks the first training step that draws one is refused in one sentence naming it, before
  its backward and any optimizer step.
  A module that does the last two itself (`exact_by_itself`: the LM, which keys its dropout by each row's sample and updates
  its metrics without a per-step value) is left as it is.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.overrides import TorchFunctionMode
from torchmetrics import Metric

from src.callbacks.cancelled_bias import CancelledBiases
from src.callbacks.epoch_end import PerRankValues, RowsInOrder
from src.core import dropout as keyed
from src.parallel.samplers import ResumableDistributedSampler
from src.utils.config import ConfigError

log = logging.getLogger(__name__)


class SyncedByDefault:
    """`log` (a module's bound log or log_dict) with sync_dist=True where the call does not set it, and the batch size
    as a float: the call's, else `batch_size()` (the current batch's; None outside a batch, where Lightning weights
    each call alike). `check` sees each call's arguments by name first."""

    def __init__(
        self, log: Callable[..., Any], batch_size: Callable[[], Optional[int]], check: Callable[[dict], None]
    ) -> None:
        self.log, self.batch_size, self.check, self.signature = log, batch_size, check, inspect.signature(log)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = self.signature.bind_partial(*args, **kwargs).arguments
        self.check(given)
        if "sync_dist" not in given:
            kwargs["sync_dist"] = True
        size = given.get("batch_size", self.batch_size())
        if size is not None:
            if "batch_size" in given and "batch_size" not in kwargs:  # given by position: leave the call as it is
                return self.log(*args, **kwargs)
            kwargs["batch_size"] = float(size)
        return self.log(*args, **kwargs)


def rebind_log(
    module: L.LightningModule, batch_size: Callable[[], Optional[int]], check: Callable[[dict], None]
) -> bool:
    """Replace `module.log` and `module.log_dict` (its bound methods) with SyncedByDefault wrappers of them, set on the
    instance: the module's own `self.log(...)` calls then go through the wrappers. False if they already were."""
    if isinstance(module.log, SyncedByDefault):
        return False
    module.log = SyncedByDefault(module.log, batch_size, check)
    module.log_dict = SyncedByDefault(module.log_dict, batch_size, check)
    return True


def _dropout_draws(args: tuple, kwargs: dict, p_at: int = 1, training_at: int = 2, training: bool = True) -> bool:
    p = kwargs.get("p", args[p_at] if len(args) > p_at else 0.5)
    return bool(kwargs.get("training", args[training_at] if len(args) > training_at else training)) and p > 0


F = torch.nn.functional
# torch's functions that draw from the generator, each with whether a call's arguments make it draw
RANDOM: dict[Callable, Callable[[tuple, dict], bool]] = {
    **dict.fromkeys(
        (
            torch.rand,
            torch.rand_like,
            torch.randn,
            torch.randn_like,
            torch.randint,
            torch.randint_like,
            torch.randperm,
            torch.bernoulli,
            torch.multinomial,
            torch.normal,
            torch.poisson,
            F.gumbel_softmax,
            torch.Tensor.bernoulli,
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            torch.Tensor.bernoulli_,
            torch.Tensor.exponential_,
            torch.Tensor.geometric_,
            torch.Tensor.log_normal_,
            torch.Tensor.cauchy_,
            torch.Tensor.random_,
        ),
        lambda args, kwargs: True,
    ),  # fmt: skip
    **dict.fromkeys(
        (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout), _dropout_draws
    ),
    torch.dropout: lambda args, kwargs: _dropout_draws(args, kwargs, training_at=2),
    F.rrelu: lambda args, kwargs: _dropout_draws(args, {**kwargs, "p": 1}, training_at=3, training=False),
    F.scaled_dot_product_attention: lambda args, kwargs: kwargs.get("dropout_p", args[4] if len(args) > 4 else 0) > 0,
}


class RandomDraws(TorchFunctionMode):
    """While a training step runs: a call to one of RANDOM that draws is one sentence naming it and the module."""

    def __init__(self, module: str) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        draws = RANDOM.get(func)
        if draws is not None and kwargs.get("generator") is None and draws(args, kwargs):  # a generator given: seeded
            name = getattr(func, "__name__", str(func))
            raise ConfigError(
                f"{self.module}'s training step draws random numbers of its own ({name}), from each rank's generator: "
                "on N ranks it would train another model than on 1. Use dropout (nn.Dropout or F.dropout in a forward: "
                "keyed by sample for you), draw augmentation in the Dataset's __getitem__ (keyed by sample too), "
                "or train on 1 device."
            )
        return func(*args, **kwargs)


class UserModule(L.Callback):
    """Changes the trained module as the module doc says, at setup: its `log` and `log_dict` rebound (`rebind_log`),
    its `all_gather` rebound (RowsInOrder), its metrics synced each step, its dropouts keyed; `seed`: the run's (keys
    the dropout masks); `compile_dropout`: how keyed dropout runs (src/core/dropout.py, wants_kernel)."""

    def __init__(self, seed: int, compile_dropout: Any = "auto", optimized_metric: Optional[str] = None) -> None:
        keyed.wants_kernel(compile_dropout, torch.device("cpu"))  # a bad value fails here, before the run
        self.seed, self.compile_dropout = seed, compile_dropout
        self.keys_dropout = False
        self.rows = {"train": 0, "validation": 0, "test": 0}  # rows the running epoch's batches held, per loop
        self.loop = "train"
        self.epoch_end: Optional[str] = None  # the epoch-end hook running, between the callbacks' and the next hook
        self.optimized_metric = optimized_metric
        self.per_rank: Optional[PerRankValues] = None
        self.cancelled = CancelledBiases()  # biases a BatchNorm cancels, watched over the fit's first batch
        self.batch_size: Optional[int] = None  # the current batch's, between a batch's start and end hooks
        self.probe: Optional[RandomDraws] = None  # on N ranks, around the first training step's forward
        self.probed = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if rebind_log(pl_module, lambda: self.batch_size, self.check_epoch_end):
            self.per_rank = PerRankValues(lambda: self.monitored(trainer))
        kernel = keyed.wants_kernel(self.compile_dropout, trainer.strategy.root_device)
        keyed.use_kernel(kernel)
        if stage == "fit" and keyed.has_dropout(pl_module):
            way = "one compiled kernel per tensor" if kernel else "eager tensor ops"
            log.info(f"Dropout keyed by sample, as {way} (compile_dropout={str(self.compile_dropout).lower()})")
        if getattr(pl_module, "exact_by_itself", False):
            return
        if not isinstance(pl_module.all_gather, RowsInOrder):
            rows = lambda: self.rows[self.loop] if self.epoch_end else None  # noqa: E731
            pl_module.all_gather = RowsInOrder(pl_module.all_gather, rows, lambda: trainer)
        for module in pl_module.modules():
            if isinstance(module, Metric):
                module.dist_sync_on_step = True
        self.keys_dropout = keyed.key_module(pl_module) > 0 or keyed.has_dropout(pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not getattr(pl_module, "exact_by_itself", False):  # (after the strategy: its SyncBatchNorm is watched)
            self.cancelled.watch(pl_module, announce=trainer.is_global_zero)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.cancelled.hold()

    def monitored(self, trainer: L.Trainer) -> set[str]:
        """The metrics something selects by: the checkpoints', early stopping's and a sweep's (optimized_metric)."""
        callbacks = [*trainer.checkpoint_callbacks, *trainer.early_stopping_callbacks]
        return {c.monitor for c in callbacks if getattr(c, "monitor", None)} | {self.optimized_metric} - {None}

    def check_epoch_end(self, given: dict) -> None:
        """A value logged from an epoch-end hook on N ranks (src/callbacks/epoch_end.py), unless sync_dist=False."""
        if self.epoch_end is None or given.get("sync_dist") is False or self.per_rank is None:
            return
        items = given["dictionary"].items() if "dictionary" in given else [(given["name"], given.get("value"))]
        for name, value in items:
            self.per_rank.check(self.epoch_end, name, value)

    def epoch_started(self, loop: str) -> None:
        self.loop, self.rows[loop], self.epoch_end = loop, 0, None

    def epoch_ending(self, loop: str, hook: str) -> None:
        self.loop, self.epoch_end = loop, hook

    def loop_ended(self, *args: Any) -> None:
        self.epoch_end = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epoch_started("train")

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.epoch_started("validation")

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.epoch_started("test")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_ending("train", "on_train_epoch_end")

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_ending("validation", "on_validation_epoch_end")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_ending("test", "on_test_epoch_end")

    def on_validation_end(self, trainer, pl_module) -> None:
        self.loop_ended()
        self.loop = "train"  # (validation inside a training epoch: back to its rows)

    on_test_end = on_train_end = loop_ended

    def batch_started(self, batch: Any, loop: str) -> None:
        try:
            self.batch_size = extract_batch_size(batch)
        except MisconfigurationException:  # no tensor in it: Lightning's own default (1) then
            self.batch_size = None
        self.rows[loop] += self.batch_size or 0
        self.loop, self.epoch_end = loop, None

    def batch_ended(self, *args: Any) -> None:
        self.batch_size = None
        self.end_probe()
        self.cancelled.stop_watching()

    def end_probe(self, *args: Any) -> None:
        if self.probe is not None:
            self.probe.__exit__(None, None, None)
            self.probe = None

    on_before_backward = on_exception = end_probe

    def on_validation_batch_start(
        self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.batch_started(batch, "validation")

    def on_test_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.batch_started(batch, "test")

    on_train_batch_end = on_validation_batch_end = on_test_batch_end = batch_ended

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batch_started(batch, "train")
        self.key_dropout(trainer, pl_module, batch_idx)
        if not self.probed and trainer.world_size > 1 and not getattr(pl_module, "exact_by_itself", False):
            self.probed, self.probe = True, RandomDraws(type(pl_module).__name__)
            self.probe.__enter__()  # the step's own draws from here to its backward

    def key_dropout(self, trainer: L.Trainer, pl_module: L.LightningModule, batch_idx: int) -> None:
        if not self.keys_dropout:
            return
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, ResumableDistributedSampler):
            raise ConfigError(
                f"{type(pl_module).__name__} has dropout, whose masks are keyed by the samples the template's training "
                "sampler deals, and its training loader has none: return a DataLoader with batch_size= and shuffle= "
                "(src/core/plain_loaders.py) or build the data on ShardedDataModule."
            )
        samples = torch.from_numpy(sampler.batch(batch_idx, loader.batch_size)).to(pl_module.device)
        keyed.set_keys(keyed.row_keys(samples, samples.numel(), trainer.global_step, self.seed))
