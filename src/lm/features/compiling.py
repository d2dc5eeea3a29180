"""The LM module's compile options: model.compile (the network, whole or per block: src/parallel/parallelize.py),
model.compile_mode, activation checkpointing (model.gradient_checkpointing), each checked when the module is made, not
once the ranks have started; and model.compile_loss, the token loss compiled or not, chosen at its first call, when
the device and the run's length are known (src/lm/objectives/loss.py, token_loss_function)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from src.core.probe import trainer_of
from src.lm.objectives.loss import run_logits, summed_token_loss, token_loss_function
from src.lm.options import Compile
from src.parallel.parallelize import check_compile_mode, compile_region

log = logging.getLogger(__name__)


# model.compile=auto compiles a training run of at least this many optimizer steps on a GPU (docs/performance.md): on
# an H200 the whole compiled GPT-2 124M saves 42.3 ms of its 81.4 ms step, so 5000 steps repay up to 3.5 min of
# compiling (the GPU lane's compiled tiny GPT-2 took ~50 s; GPT-2 124M's own compile time is not measured yet:
# scripts/gpu_check.sh bench prints it as the warm-up's extra seconds)
AUTO_MIN_STEPS = 5000


def auto_compile(
    on_gpu: bool, steps: Optional[int], compile_mode: Optional[str], loss_chunk: Any, accepts: Callable[[Any], bool]
) -> Any:
    """What model.compile=auto is for a run: the largest region the run's strategy `accepts` (true, the whole network,
    where no model.loss_chunk is set; else blocks), for a training run of `steps` optimizer steps (-1: bounded by
    epochs) on a GPU from AUTO_MIN_STEPS on, or wherever model.compile_mode asks for a compiled mode; else false
    (a CPU: compiling measured not to repay the default run, docs/performance.md; evaluation: `steps` None)."""
    wanted = compile_mode is not None or (on_gpu and steps is not None and (steps == -1 or steps >= AUTO_MIN_STEPS))
    if not wanted:
        return False
    regions = (True, "blocks") if loss_chunk is None else ("blocks",)  # chunked_loss.check_loss_chunk's rule
    return next((region for region in regions if accepts(region)), False)


class Compiling:
    def __init__(self, options: Compile) -> None:
        token_loss_function(options.loss, 0, torch.device("cpu"))  # a bad value fails here, not at the first step
        compile_region(options.compile, whole_model=True)
        check_compile_mode(options.mode, options.compile)
        self.compile, self.compile_mode, self.compile_loss = options.compile, options.mode, options.loss
        self.checkpointing = options.gradient_checkpointing
        self.token_loss: Optional[Callable] = None

    def wrappers(self) -> dict[str, Any]:
        """What src/parallel/parallelize.py applies per block or to the whole network."""
        return {"activation_checkpointing": self.checkpointing, "compile": self.compile,
                "compile_mode": self.compile_mode}  # fmt: skip

    def loss_function(self, module: Any, chunk: Optional[int]) -> Callable:
        """summed_token_loss or its compiled form, chosen once for the module's run (model.compile_loss)."""
        if self.token_loss is None:
            in_run = run_logits(trainer_of(module), module.seq_len, module.config.vocab_size)
            compiled = self.compile in (True, "blocks")  # ("auto" here: a module made outside a run, not compiled)
            self.token_loss = token_loss_function(self.compile_loss, in_run, module.device, compiled)
            chunks = f", {chunk} tokens at a time (model.loss_chunk)" if chunk else ""
            log.info(
                f"Token loss: {'compiled' if self.token_loss is not summed_token_loss else 'eager'} "
                f"(model.compile_loss={str(self.compile_loss).lower()}){chunks}"
            )
        return self.token_loss
