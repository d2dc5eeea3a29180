"""Pre-flight probes: the forwards a feature of a module runs before step 1 to prove that the model does what the
feature assumes (the language model's keyed dropout, chunked loss, padded vocabulary, ...). Each runs on every rank
alike, eager (model.compile's graphs are for the run's shapes), outside autograd, and leaves the module in the
mode it found it in, whatever happens."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn


@contextmanager
def probing(module: nn.Module, training: bool = False) -> Iterator[None]:
    """`module` in eval mode (training=True: train mode), eager and without autograd; its mode restored on exit."""
    was_training = module.training
    module.train(training)
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        module.train(was_training)


def gap_beyond_rounding(logits: torch.Tensor, expected: torch.Tensor, fp32: bool) -> Optional[float]:
    """The largest difference between two computations' logits of the same inputs where it is more than rounding
    explains (1e-4 of `expected`'s scale in fp32, 3e-2 in a 16-bit dtype); None where it is within."""
    gap, scale = (logits - expected).abs().max().item(), expected.abs().max().item()
    return None if gap <= (1e-4 if fp32 else 3e-2) * scale + 1e-6 else gap


def trainer_of(module: Any) -> Optional[Any]:
    """The module's Trainer, or None for a module used on its own (Lightning's `trainer` raises there)."""
    try:
        return module.trainer
    except RuntimeError:
        return None
