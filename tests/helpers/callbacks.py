"""Test-only callbacks, instantiated into real train.py runs with +callbacks.NAME._target_=..."""

from __future__ import annotations

import json

import lightning as L
import torch


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard only
    return t.numel() * t.element_size()


class RecordStateBytes(L.Callback):
    """Writes this rank's parameter, gradient and optimizer-state bytes just before the 2nd optimizer step."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step != 1:  # the optimizer state exists from the first step on
            return
        params = [p for p in pl_module.parameters()]
        record = {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(
                local_bytes(v)
                for s in optimizer.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            ),  # m and v; not the scalar step counters
        }
        path = f"{trainer.default_root_dir}/state_bytes_rank{trainer.global_rank}.json"
        with open(path, "w") as f:
            json.dump(record, f)


class SaveParamsAtEnd(L.Callback):
    """Every rank saves its full parameters at the end of fit: proof that ranks trained in lockstep."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import os

        params = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
        torch.save(params, os.path.join(trainer.default_root_dir, f"params_rank{trainer.global_rank}.pt"))


class RecordEnv(L.Callback):
    """Writes the job's environment as every rank sees it."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import os

        with open(f"{trainer.default_root_dir}/env_rank{trainer.global_rank}.json", "w") as f:  # noqa: PTH123
            json.dump(dict(os.environ), f)


class KillAtStep(L.Callback):
    """Simulates a preemption: SIGKILL this process (no cleanup, no final checkpoint) at a given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        import os
        import signal

        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordInitParams(L.Callback):
    """Writes, per rank, the parameter storage the model holds before it is set up (Lightning calls callbacks'
    `setup` before `configure_model` and the strategy's setup) and each parameter's local and full numel
    once it is set up; rank 0 also writes the logits of a fixed input then (a forward on every rank)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.before = sum(param_sizes(p)[0] * p.element_size() for p in pl_module.parameters())
        self.full = sum(param_sizes(p)[1] * p.element_size() for p in pl_module.parameters())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sizes = {name: [*param_sizes(p), rows(p)] for name, p in pl_module.named_parameters()}
        record = {"before_setup_bytes": self.before, "full_bytes": self.full, "after_setup": sizes}
        with open(f"{trainer.default_root_dir}/init_rank{trainer.global_rank}.json", "w") as f:  # noqa: PTH123
            json.dump(record, f)
        ids = torch.arange(12, device=pl_module.device).remainder(50).view(2, 6)
        training, _ = pl_module.training, pl_module.eval()  # no dropout
        with torch.no_grad():
            logits = pl_module(ids).logits.float().cpu()
        pl_module.train(training)
        if trainer.global_rank == 0:
            torch.save(logits, f"{trainer.default_root_dir}/init_logits.pt")


def rows(p: torch.Tensor) -> int:
    """Length of the dim that FSDP2 and ZeRO shard by (dim 0; ZeRO-3 partitions the flat tensor)."""
    shape = getattr(p, "ds_shape", None) or p.shape
    return shape[0] if len(shape) else 1


def param_sizes(p: torch.Tensor) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole parameter): FSDP2 DTensor shard, DeepSpeed ZeRO-3
    partition (ds_tensor), or a plain tensor; a meta tensor holds none."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel(), p.ds_numel
    local = p.to_local() if hasattr(p, "to_local") else p
    return (0 if local.is_meta else local.numel()), p.numel()


class StopAfterFirstStep(L.Callback):
    """Ends fit after its first batch: what a run decides at its start (from trainer.max_steps), without the rest."""

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = True
