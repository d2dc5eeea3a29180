"""SDPA's `is_causal` in a whole compiled network, for the batches that need no mask.

Eagerly, transformers hands SDPA no mask and `is_causal` for an unpadded, unpacked batch, and SDPA takes its fastest
(flash) kernels. While torch (before 2.14) compiles a whole network, transformers cannot tell that a batch is not
packed (it would read the position ids), so it builds an explicit causal mask and SDPA takes a slower kernel
(docs/performance.md). The module knows its batch: `plain_causal` says, around a forward, that it has no attention
mask and no position ids. Then each attention module that an eager forward of the run's whole context was handed no
mask (`probe`, before the first compiled call) drops the mask it is handed. Sliding windows shorter than the
context, and any pattern a model's own forward adds, were handed a mask in the probe and keep it.

`route` sets it up for one network (parallelize, step 3); nothing changes for another attention implementation
than sdpa (and keyed sdpa, src/core/dropout.py) or in a network that is not compiled whole."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

ROUTED = ("sdpa", "keyed_sdpa")  # the implementations that skip the mask eagerly (eager attention never does)
_plain = [False]  # the forward in flight has a plain causal batch (a dynamo guard: read while tracing)
_seen: list[Optional[dict[nn.Module, bool]]] = [None]  # the probe's record: module -> handed no mask


def route(network: nn.Module, context: int) -> bool:
    """Route `network`'s attention through `attention` (registered as "plain_<implementation>", with that
    implementation's masks), its probe to run over `context` tokens at the first plain forward; False (nothing
    changed) for an implementation not in ROUTED."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = getattr(getattr(network, "config", None), "_attn_implementation", None)
    if implementation not in ROUTED:
        return False
    inner = ALL_ATTENTION_FUNCTIONS[implementation]

    def attention(module: nn.Module, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        if _seen[0] is not None:  # the probe (eager): what transformers hands each module
            _seen[0][module] = _seen[0].get(module, True) and attention_mask is None
        elif _plain[0] and getattr(module, "plain_causal", False):
            attention_mask = None
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(f"plain_{implementation}", attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(f"plain_{implementation}", ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    network.set_attn_implementation(f"plain_{implementation}")
    network.plain_causal_context = context
    return True


def probe(network: nn.Module) -> dict[nn.Module, bool]:
    """Run `network`'s own forward eagerly (not its compiled call) on one unpadded sequence of its whole context, in
    evaluation mode without gradients, and mark each attention module with whether it was handed no mask."""
    seen: dict[nn.Module, bool] = {}
    ids = torch.zeros(1, network.plain_causal_context, dtype=torch.long, device=next(network.parameters()).device)
    training, _seen[0] = network.training, seen
    network.eval()
    try:
        with torch.no_grad():
            network.forward(input_ids=ids, use_cache=False)
    finally:
        _seen[0] = None
        network.train(training)
    for module, unmasked in seen.items():
        module.plain_causal = unmasked
    network.plain_causal_probed = True
    return seen


@contextmanager
def plain_causal(network: nn.Module, inputs: dict[str, torch.Tensor]) -> Iterator[None]:
    """Around a forward of a routed `network` on `inputs`: a batch with neither attention mask nor position ids is
    a plain causal one (probed first, once)."""
    if not hasattr(network, "plain_causal_context") or "attention_mask" in inputs or "position_ids" in inputs:
        yield
        return
    if not getattr(network, "plain_causal_probed", False):
        probe(network)
    _plain[0] = True
    try:
        yield
    finally:
        _plain[0] = False
