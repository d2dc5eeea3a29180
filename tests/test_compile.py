"""model.compile=true compiles and stays compiled: through torch's own dynamo counters, on a CPU with inductor, each
block's forward is compiled once for training and once for evaluation (grad mode is a guard), with no graph break,
and no step after the first compiles again. (A KV cache in the training forward made every block recompile on a
guard of transformers' DynamicCache until dynamo's limit, then run eagerly: seen on an H200, ../shared/gpu/.)"""

from __future__ import annotations

import pytest
import torch
from conftest import FULL_MATRIX_ONLY

from tests.helpers.architectures import SAMPLE, tiny_config

pytestmark = pytest.mark.slow  # inductor compiles C++ kernels: 15-40 s an architecture on 2 cores


def compiled_module(arch: str):
    from src.models.causal_lm import CausalLMLitModule
    from src.models.gpt2 import GPT2LitModule
    from src.parallel.parallelize import parallelize

    torch.manual_seed(0)
    if arch == "gpt2":
        module = GPT2LitModule(vocab_size=100, seq_len=32, n_layer=2, n_head=2, n_embd=16, compile=True,
                               compile_loss=False)  # fmt: skip
    else:
        from transformers import AutoConfig

        defaults = AutoConfig.for_model(arch).to_dict()  # the fields tiny_config changes, as the matrix passes them
        config = {k: v for k, v in tiny_config(arch).to_dict().items() if k in defaults and v != defaults[k]}
        config.pop("vocab_size", None)
        module = CausalLMLitModule(vocab_size=100, seq_len=32, model_type=arch, config=config, compile=True,
                                   compile_loss=False)  # fmt: skip
    return parallelize(module, **module.wrappers())  # as configure_model applies it under DDP and one device


@pytest.mark.parametrize("arch", ["gpt2"] + [pytest.param(a, marks=FULL_MATRIX_ONLY) for a in SAMPLE])
def test_compiled_blocks_compile_once_for_training_and_once_for_evaluation(arch, monkeypatch):
    from torch._dynamo.utils import counters

    from src.models.causal_lm import CausalLMLitModule

    torch._dynamo.reset()
    counters.clear()
    module = compiled_module(arch)
    # as on a GPU: the forward's choices must not depend on the device (a KV cache was kept on accelerators)
    monkeypatch.setattr(CausalLMLitModule, "device", property(lambda self: torch.device("cuda")))
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    graphs = []
    for _ in range(3):
        module.train()
        loss, _ = module.loss_and_count(batch)
        loss.backward()
        module.eval()
        with torch.no_grad():
            module.loss_and_count(batch)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs == [2, 2, 2], graphs  # one graph for training, one for evaluation, none after the first step
