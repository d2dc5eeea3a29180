"""The LM module's compile options: model.compile (the network, whole or per block: src/parallel/parallelize.py),
model.compile_mode, activation checkpointing (model.gradient_checkpointing), each checked when the module is made, not
once the ranks have started; and model.compile_loss, the token loss compiled or not, chosen at its first call, when
the device and the run's length are known (src/objectives/loss.py, token_loss_function)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from src.models.probe import trainer_of
from src.objectives.loss import run_logits, summed_token_loss, token_loss_function
from src.parallel.parallelize import check_compile_mode, compile_region

log = logging.getLogger(__name__)


class Compiling:
    def __init__(self, compile: Any, compile_mode: Optional[str], compile_loss: Any, checkpointing: bool) -> None:
        token_loss_function(compile_loss, 0, torch.device("cpu"))  # a bad value fails here, not at the first step
        compile_region(compile, whole_model=True)
        check_compile_mode(compile_mode, compile)
        self.compile, self.compile_mode, self.compile_loss = compile, compile_mode, compile_loss
        self.checkpointing = checkpointing
        self.token_loss: Optional[Callable] = None

    def wrappers(self) -> dict[str, Any]:
        """What src/parallel/parallelize.py applies per block or to the whole network."""
        return {"activation_checkpointing": self.checkpointing, "compile": self.compile,
                "compile_mode": self.compile_mode}  # fmt: skip

    def loss_function(self, module: Any, chunk: Optional[int]) -> Callable:
        """summed_token_loss or its compiled form, chosen once for the module's run (model.compile_loss)."""
        if self.token_loss is None:
            in_run = run_logits(trainer_of(module), module.seq_len, module.config.vocab_size)
            self.token_loss = token_loss_function(self.compile_loss, in_run, module.device, bool(self.compile))
            chunks = f", {chunk} tokens at a time (model.loss_chunk)" if chunk else ""
            log.info(
                f"Token loss: {'compiled' if self.token_loss is not summed_token_loss else 'eager'} "
                f"(model.compile_loss={str(self.compile_loss).lower()}){chunks}"
            )
        return self.token_loss
