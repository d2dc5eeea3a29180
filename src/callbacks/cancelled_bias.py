"""A bias a normalisation cancels: PyTorch's default `nn.Linear(bias=True)` (or a Conv's) straight into a BatchNorm.

In training BatchNorm subtracts each feature's batch mean, and the bias with it: the loss does not depend on the bias
and its true gradient is exactly zero. The computed one is zero but for rounding, and the rounding differs between 1
process and N ranks (other sums in another order). Adam divides a gradient by its own running scale, so a gradient
of 1e-9 steps the bias by about lr as one of 1: the biases drift apart by about lr a step, the running means with
them, and evaluation differs (val/loss 3e-4 to 1e-3 off after 20 steps) while every training loss agrees.

Found from the data's path (`CancelledBiases.watch`, forward hooks on the first batch of a fit, before step 1: the
sanity validation's or the first training batch's): a module with a trained bias whose output tensor is the input of
a BatchNorm, an InstanceNorm or a GroupNorm of one channel a group. Each such gradient is then held at its exact zero
(`hold`, before every optimizer step), on 1 process as on N, and named in one line with the fix (bias=False): the
function the module computes is the same for any value of that bias, so holding it changes nothing but the noise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

log = logging.getLogger(__name__)


def cancels_a_bias(module: nn.Module) -> bool:
    """Whether `module` subtracts each channel's own mean over the batch (and positions): a bias added per channel
    before it cancels."""
    if isinstance(module, nn.GroupNorm):
        return module.num_groups == module.num_channels
    return isinstance(module, (_BatchNorm, _InstanceNorm))


class CancelledBiases:
    """Watches one forward of a module for biases a normalisation cancels (module doc), then holds their gradients."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.outputs: dict[int, tuple[str, torch.Tensor]] = {}  # id(output) -> (the biased module's name, output)
        self.held: dict[str, nn.Parameter] = {}
        self.announce = True

    def watch(self, model: nn.Module, announce: bool = True) -> None:
        """Hooks on `model` until stop_watching; `announce`: this process logs what it finds (rank 0)."""
        self.announce = announce
        for name, module in model.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter) and bias.requires_grad and not cancels_a_bias(module):
                self.handles.append(module.register_forward_hook(self._produced(name)))
            if cancels_a_bias(module):
                self.handles.append(module.register_forward_pre_hook(self._consumed(name, model)))

    def _produced(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                self.outputs[id(output)] = (name, output)  # the tensor kept alive: its id stays its own

        return hook

    def _consumed(self, norm_name: str, model: nn.Module):
        def hook(module: nn.Module, args: Any) -> None:
            found = self.outputs.get(id(args[0])) if args else None
            if found is not None and found[1] is args[0]:
                name = found[0]
                self.held[f"{name}.bias"] = model.get_submodule(name).bias
                if not self.announce:
                    return
                log.warning(
                    f"{name}.bias feeds {norm_name} ({type(module).__name__}), which cancels it: its gradient is zero "
                    "but for rounding, which Adam would turn into steps of about lr that differ between 1 process and "
                    f"N ranks; it is held at exactly 0 (build {name} with bias=False to drop it)."
                )

        return hook

    def stop_watching(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.outputs = [], {}

    def hold(self) -> None:
        """The held biases' gradients set to exactly zero (after their all-reduce, before the optimizer reads them)."""
        for parameter in self.held.values():
            if parameter.grad is not None:
                parameter.grad.zero_()
