"""A LightningDataModule of the user's own, as Lightning's docs teach it (`train_dataloader()` returning
`DataLoader(dataset, batch_size=32, shuffle=True)`), made to read on N ranks what it reads on one.

The trainer configs turn Lightning's DistributedSampler off (`use_distributed_sampler: false`: it pads evaluation
with repeated samples), so without this every rank would read every sample. `shard_loaders` wraps the datamodule's
loader methods; each loader they return is rebuilt on its own dataset, collate function and workers with the
template's samplers, on 1 process as on N, so that both read the same batches:

- training: the loader's `batch_size` is the batch of one optimizer step (times the accumulation, as on 1 process);
  each of the W ranks reads batch_size / W of it, from one seeded permutation an epoch that all ranks share
  (`shuffle=True`), or in the dataset's order: global batch k is the same samples on any W. The last partial batch
  is dropped (it cannot be split over the ranks), and a run resumed mid-epoch trains on exactly the rest of it.
- random augmentation the Dataset draws in `__getitem__` (torch, numpy, Python's `random`): keyed by (seed, epoch,
  sample), so each sample is augmented alike on any layout (src/core/seeded.py).
- evaluation: each sample once over all ranks, every rank the same number of batches, and no padding
  (src/parallel/samplers.py EvenBatches): a loss logged with `self.log` and a torchmetrics metric count each sample
  once.

A loader that cannot be rebuilt the same on every layout (an IterableDataset, a sampler or batch sampler of its own,
a DataLoader subclass, several loaders) is refused in one sentence naming it: ShardedDataModule
(src/core/datamodule.py) is the way for those.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from src.core.datamodule import ResumableLoader, ShardedDataModule, batches_done_this_epoch
from src.core.seeded import SeededItems
from src.parallel.samplers import EvenBatches, rank_and_world, train_sampler
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

STAGES = ("train", "val", "test")


def shard_loaders(datamodule: Any, seed: int) -> bool:
    """Wrap a LightningDataModule's own train/val/test loader methods so that each rank reads its share (the module
    doc); nothing for a ShardedDataModule, which shards itself. Whether it wrapped any."""
    if isinstance(datamodule, ShardedDataModule) or not isinstance(datamodule, L.LightningDataModule):
        return False
    wrapped = False
    for stage in STAGES:
        name = f"{stage}_dataloader"
        if is_overridden(name, datamodule, L.LightningDataModule):
            setattr(datamodule, name, functools.partial(sharded, getattr(datamodule, name), datamodule, stage, seed))
            wrapped = True
    return wrapped


def sharded(make: Callable[[], Any], datamodule: Any, stage: str, seed: int) -> DataLoader:
    """The loader `make` returns, rebuilt with the template's samplers for this rank."""
    where = f"{type(datamodule).__name__}.{stage}_dataloader()"
    loader = make()
    check_rebuildable(loader, where)
    rank, world = rank_and_world(datamodule.trainer)
    if stage == "train":
        batch = loader.batch_size
        if batch % world:
            raise ConfigError(
                f"{where} has batch_size={batch}, which does not divide over {world} ranks: make it a multiple of "
                f"{world} (each rank reads batch_size / {world} samples of each batch)."
            )
        micro = batch // world
        sampler = train_sampler(loader.dataset, seed, (rank, world), shuffle=isinstance(loader.sampler, RandomSampler))
        sampler.with_epoch = True  # (epoch, index): the Dataset's own random draws keyed by them (seeded.py)
        sampler.skip = batches_done_this_epoch(datamodule.trainer, len(sampler) // micro) * micro
        if rank == 0:
            log.info(
                f"{where}: {world} rank(s) x {micro} samples a batch; the last {len(loader.dataset) % batch} "
                "sample(s) of each epoch's order are left out (a partial batch cannot be split over ranks)"
            )
        return ResumableLoader(
            SeededItems(loader.dataset, seed), batch_size=micro, sampler=sampler, drop_last=True, **settings(loader)
        )
    batches = EvenBatches(len(loader.dataset), -(-loader.batch_size // world), (rank, world))
    return DataLoader(SeededItems(loader.dataset, seed), batch_sampler=batches, **settings(loader))


def check_rebuildable(loader: Any, where: str) -> None:
    """One sentence for a loader whose samples cannot be dealt to ranks the same way on every layout."""
    base = "; or build it on src/core/datamodule.py's ShardedDataModule (docs/your-model.md)"
    if type(loader) is not DataLoader:
        what = "a DataLoader subclass" if isinstance(loader, DataLoader) else "not one DataLoader"
        raise ConfigError(
            f"{where} returns {type(loader).__name__} ({what}), which the template cannot deal to ranks: "
            f"return one torch.utils.data.DataLoader{base}."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError(
            f"{where} reads an IterableDataset, whose samples cannot be dealt to ranks by index: use a map-style "
            f"Dataset{base}."
        )
    random = isinstance(loader.sampler, RandomSampler)
    if loader.batch_size is None or not (isinstance(loader.sampler, SequentialSampler) or random):
        own = ("batch sampler", loader.batch_sampler) if loader.batch_size is None else ("sampler", loader.sampler)
        raise ConfigError(
            f"{where} uses a {own[0]} of its own ({type(own[1]).__name__}), which the template cannot deal to ranks "
            f"the same way on every layout: use batch_size= and shuffle={base}."
        )
    if random and (loader.sampler.replacement or loader.sampler.num_samples != len(loader.dataset)):
        raise ConfigError(
            f"{where} samples with replacement or a num_samples of its own: use shuffle=True alone{base}."
        )


def settings(loader: DataLoader) -> dict[str, Any]:
    """The loader's own collate function, workers and memory settings, for its rebuilt copy."""
    kwargs = {
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def check_config(cfg: Any) -> None:
    """Before any rank starts, what the config tells of a plain LightningDataModule (`cfg.data`'s target): a
    `data.overfit_batches` it does not take (debug=overfit), and a train `batch_size` that the ranks do not divide
    (sharded() checks the loader's own again, on each rank). Nothing for the template's datamodules."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from src.utils.config import accepted_parameters

    data = OmegaConf.select(cfg, "data", default=None)
    try:
        module = get_object(data._target_)
    except Exception:  # no data, no target or one that does not import: the key check says which
        return
    if not isinstance(module, type) or not issubclass(module, L.LightningDataModule):
        return
    if issubclass(module, ShardedDataModule):
        return
    name, takes = module.__name__, accepted_parameters(module)
    if "overfit_batches" in data and "overfit_batches" not in takes:
        raise ConfigError(
            f"data.overfit_batches={data.overfit_batches} (debug=overfit) deals the first batches of the template's "
            f"datamodules (src/core/datamodule.py), and {name} is a plain LightningDataModule that does not take it: "
            f"drop debug=overfit and set trainer.limit_train_batches=N (shuffle=False in {name}.train_dataloader() "
            "reads the same N batches every epoch), or build it on ShardedDataModule (docs/your-model.md)."
        )
    batch, devices, nodes = data.get("batch_size"), cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    counts = (batch, devices, nodes)
    if not cfg.get("train", False) or "batch_size" not in takes or not all(type(n) is int and n > 0 for n in counts):
        return  # no training, no batch_size key, or a count known only when the ranks start (auto, -1)
    if batch % (devices * nodes):
        world = devices * nodes
        raise ConfigError(
            f"data.batch_size={batch}, the batch of {name}.train_dataloader(), does not divide over {world} ranks "
            f"(trainer.devices={devices} x trainer.num_nodes={nodes}): make it a multiple of {world} (each rank "
            f"reads batch_size / {world} samples of each batch)."
        )
