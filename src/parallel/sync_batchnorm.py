"""SyncBatchNorm on every backend: BatchNorm statistics over the global batch, not each rank's slice.

Without it, N ranks each normalise with the statistics of 1/N of the batch: the model trains
differently from the single-device run and its running stats are noisier. torch's
`nn.SyncBatchNorm` does this on GPUs only ("SyncBatchNorm layers only work with GPU modules":
`aten::batch_norm_stats` has no CPU kernel), so on gloo we all-reduce the sum, the sum of squares
and the count through an autograd-aware all_reduce, which matched full-batch BatchNorm to 1e-6.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from src.utils.precision import at_least_fp32


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x. Every rank's loss depends on y, so the gradient is summed over ranks too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlooSyncBatchNorm(_BatchNorm):
    """BatchNorm over all ranks for CPU / gloo; same parameters and buffers (so checkpoints) as BatchNorm."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        xf = at_least_fp32(x)  # statistics in fp32 even under bf16 autocast
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), xf.new_tensor([xf.numel() / channels])])
        total = _AllReduceSum.apply(local)  # one collective per layer forward (and one backward)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean  # biased, as used to normalise
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
                unbiased = var * count / (count - 1)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def _convert(module: nn.Module, to_gloo: bool) -> nn.Module:
    """Swap BatchNorm <-> GlooSyncBatchNorm in place of each layer, keeping parameters and buffers."""
    is_bn = isinstance(module, _BatchNorm) and not isinstance(module, (GlooSyncBatchNorm, nn.SyncBatchNorm))
    if (to_gloo and is_bn) or (not to_gloo and isinstance(module, GlooSyncBatchNorm)):
        cls = GlooSyncBatchNorm if to_gloo else module._original_class
        like = next((t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}  # a bf16/fp64 layer stays so
        new = cls(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, **factory
        )
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        if to_gloo:
            new._original_class = type(module)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert(child, to_gloo))
    return module


class SyncBatchNorm(TorchSyncBatchNorm):
    """Lightning plugin (`trainer.plugins`): converts BatchNorm layers when the world has more than one rank.

    Lightning applies it while setting up fit, after the process group exists and before DDP wraps
    the model; it picks torch's SyncBatchNorm on NCCL and GlooSyncBatchNorm otherwise.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def apply(self, model: nn.Module) -> nn.Module:
        if not self.enabled or not dist.is_initialized() or dist.get_world_size() == 1:
            return model
        if dist.get_backend() == "nccl":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return _convert(model, to_gloo=True)

    def revert(self, model: nn.Module) -> nn.Module:
        return super().revert(_convert(model, to_gloo=False))  # Lightning's revert handles torch's kind


def apply_layer_sync(strategy, module: nn.Module) -> None:
    """Apply `trainer.plugins`' LayerSync (SyncBatchNorm) to `module` for strategies Lightning skips.

    Lightning applies it in its DDP and FSDP1 strategies only; FSDP2 (ModelParallelStrategy) and
    DeepSpeed would silently train with per-rank BatchNorm. Lightning hands the plugin to the strategy
    as the private attribute `_layer_sync`: this is the one place we read it, and
    tests/test_deepspeed.py fails if Lightning renames it.
    """
    plugin = strategy._layer_sync
    if plugin is not None:
        plugin.apply(module)  # converts the layers in place (their parent modules get the new ones)
