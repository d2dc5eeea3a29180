"""model.pad_vocab_multiple=N: the embedding and the LM head get the vocabulary rounded up to a multiple of N rows
(64: the widths GPU matmuls run fastest at; nanoGPT trains GPT-2's 50257 tokens as 50304), and the model computes
what the unpadded one does.

The head's output has its padded columns set to the dtype's minimum (a forward hook on the head), so the softmax
gives them probability 0: the loss, its gradients and sampling are the unpadded model's, and nothing trains the
padded rows (their gradient is 0). `export-hf` writes the unpadded vocabulary (`unpad`). Refused, before step 1, for a
model whose logits are not its head's output (Gemma 2's soft-capping, Granite's and Cohere's logit scales: the padded
columns would leave the minimum), and for a pretrained model (its vocabulary is its checkpoint's)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from src.core.probe import probing, trainer_of
from src.parallel import capabilities
from src.utils.config import ArchitectureRefused, ConfigError, check_number


def check_pad_vocab(multiple: Any, pretrained: Optional[str], loss_chunk: Optional[int]) -> Optional[int]:
    """model.pad_vocab_multiple: null, or a row multiple for a model built from a config, its loss not chunked."""
    if multiple is None:
        return None
    check_number("model.pad_vocab_multiple", multiple, lambda v: v >= 1, "a number of rows >= 1, or null",
                 integer=True)  # fmt: skip
    if pretrained:
        raise ConfigError(
            f"model.pad_vocab_multiple={multiple} with model.pretrained={pretrained}: a pretrained model keeps its "
            "checkpoint's vocabulary; set model.pad_vocab_multiple=null."
        )
    if loss_chunk is not None:
        raise ConfigError(
            f"model.pad_vocab_multiple={multiple} with model.loss_chunk={loss_chunk}: the chunks call the head without "
            "the padding's mask; set one of them to null."
        )
    return multiple


def check_strategy(multiple: Optional[int], declared: Any, name: str) -> None:
    """model.pad_vocab_multiple where no rank runs the whole model (the strategy's capabilities, before any rank
    starts): the probe that the padded columns stay masked needs a whole forward (the pipeline's stages)."""
    if multiple is not None and declared.generation is None:
        raise ConfigError(
            f"model.pad_vocab_multiple={multiple} with {name}: no rank runs the whole model, "
            "so the padding's mask is not checked there; set model.pad_vocab_multiple=null."
        )


class PaddedVocab:
    """The LM module's model.pad_vocab_multiple: the rows the model is built with, the mask on its head's output, and
    the probe that the mask holds in the logits, run once before step 1 on every rank alike."""

    def __init__(self, multiple: Optional[int], vocab: int) -> None:
        self.multiple, self.checked = multiple, False
        self.rows = padded(vocab, multiple)
        self.unpadded = vocab if self.rows != vocab else None  # what export-hf writes; None: nothing padded

    def mask(self, model: nn.Module) -> None:
        """The padded columns of `model`'s head output at the dtype's minimum."""
        if self.unpadded is not None:
            mask_padding(model.get_output_embeddings(), self.unpadded)

    def probe(self, module: Any) -> None:
        """A probe forward's padded columns are at the minimum (the model does not scale or cap its head's output)."""
        if self.unpadded is None or self.checked:
            return
        trainer = trainer_of(module)  # the pipeline's stages (no whole forward) are refused by src/run/checks.py
        if trainer is not None and capabilities.of(trainer.strategy).generation is None:
            return
        with probing(module):
            logits = module.lm_forward({"input_ids": torch.zeros(1, 8, dtype=torch.long, device=module.device)}).logits
        check_masked(logits, self.unpadded, type(module.hf_model).__name__, self.multiple)
        self.checked = True


def padded(vocab: int, multiple: Optional[int]) -> int:
    """`vocab` rounded up to a multiple of `multiple` (unchanged for None)."""
    return vocab if not multiple else -(-vocab // multiple) * multiple


def mask_padding(head: nn.Module, vocab: int) -> RemovableHandle:
    """Set the columns of `head`'s output from `vocab` on to the dtype's minimum."""

    from torch.distributed.tensor import DTensor, Replicate

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if isinstance(out, DTensor):  # tensor parallel's replicated head (src/parallel/tensor/plan.py)
            columns = torch.arange(out.shape[-1], device=out.device) >= vocab
            columns = DTensor.from_local(
                columns, out.device_mesh, [Replicate()] * out.device_mesh.ndim, run_check=False
            )
            return out.masked_fill(columns, torch.finfo(out.dtype).min)
        # In place, the padded columns alone (a linear's backward does not read its output), and outside autograd:
        # whatever reads the logits through a softmax hands those columns a gradient of exactly 0 (their probability
        # underflows to 0), so no backward pass over the whole logits is needed. Through autograd (CopySlices copies
        # the logits' gradient) a CPU step with GPT-2's vocabulary ran 0.95x as fast, with a masked copy 0.73x.
        with torch.no_grad():
            out[..., vocab:] = torch.finfo(out.dtype).min
        return out

    return head.register_forward_hook(hook)


def check_masked(logits: torch.Tensor, vocab: int, kind: str, multiple: int) -> None:
    """A probe forward's `logits` keep every padded column at the minimum, or one sentence."""
    rest = logits[..., vocab:]
    if not bool((rest == torch.finfo(rest.dtype).min).all()):
        raise ArchitectureRefused(
            f"model.pad_vocab_multiple={multiple}: {kind}'s logits are not its head's output (it scales or caps "
            "them), so the padded columns would not stay out of its softmax; set model.pad_vocab_multiple=null."
        )


def unpad(model: nn.Module, vocab: int) -> None:
    """`model` (a transformers model) with `vocab` embedding and head rows, as it would have been built unpadded."""
    if model.config.vocab_size != vocab:
        model.resize_token_embeddings(vocab)
