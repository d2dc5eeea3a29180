"""The model FLOPs of a GPT-2 training step: the numerator of MFU, with its convention stated once.

Model FLOPs (PaLM, appendix B): the work the model needs, not what the hardware happens to do, so
gradient checkpointing's recomputation and the padding of a batch are not counted. Exactly:

- Matmuls only, 2 FLOPs per multiply-add. Embedding lookups (wte, wpe), LayerNorms, biases, GELU,
  softmax and the loss are left out: O(d) per token, under 1% of GPT-2 small.
- N is the matmul weights each token goes through: every block's attn.c_attn, attn.c_proj, mlp.c_fc
  and mlp.c_proj (12·d² a layer), LoRA adapters' A and B, and the LM head (V·d). The head is real
  compute though its weight is the tied token embedding, so N is Kaplan's non-embedding count minus
  biases and LayerNorms, plus the head (nanoGPT's count, all parameters minus wpe, is the same plus
  those biases and LayerNorms).
- Forward 2 per weight. Backward: 2 per weight for the gradient of the matmul's input, when that
  input depends on a trainable parameter (activation gradients flow through frozen layers, but
  nothing is computed below the lowest trainable one), and 2 per weight for the weight gradient,
  when the weight trains. Full training is 6N; LoRA on a frozen base is 2N forward, about 2N of
  activation gradients and the adapters' own 6 per weight: about 4N.
- Attention (Q·Kᵀ and A·V): 4·d per layer per token per token of context forward, 8·d backward when
  the layer's q, k, v need gradients; full training is PaLM's 12·L·d·T per token. T is the sequence's
  own real length (every key, as PaLM and nanoGPT: causal masking is not halved).
- Tokens are the real ones (attention_mask); packed text has no mask, so every position is real and
  T = seq_len. Prompt tuning's virtual tokens go through the whole model and are counted as tokens;
  prefix tuning's learned keys are counted as a trainable input below the first layer, their extra
  attention context is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from transformers.pytorch_utils import Conv1D

Lengths = Union[torch.Tensor, list[int]]


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs of a sequence of T tokens: per_token·T + per_context·T²."""

    per_token: int  # matmuls, forward + backward, per token
    per_context: int  # attention, per token and per token of its context
    virtual_tokens: int = 0  # prompt tuning: prepended to every sequence

    def of_lengths(self, lengths: Lengths) -> Union[torch.Tensor, int]:
        """FLOPs of sequences of these real lengths; a device tensor stays on the device (no sync)."""
        t = torch.as_tensor(lengths, dtype=torch.int64) + self.virtual_tokens
        return self.per_token * t.sum() + self.per_context * (t * t).sum()

    def of_batch(self, batch: dict) -> Union[torch.Tensor, int]:
        return self.of_lengths(real_lengths(batch))


def real_lengths(batch: dict) -> torch.Tensor:
    """Each sequence's real tokens: its attention_mask's ones, or every position without a mask."""
    mask = batch.get("attention_mask")
    if mask is None:
        ids = batch["input_ids"]
        return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64, device=ids.device)
    return mask.sum(dim=1)


def _trains(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def count_gpt2(hf_model: torch.nn.Module, trainable_input: bool = False, virtual_tokens: int = 0) -> FlopCount:
    """Walk a GPT2LMHeadModel in forward order (its residual stream makes every later matmul depend on
    every earlier one), counting each matmul's backward by what trains below and at it.
    `trainable_input`: something trainable outside the model feeds it (a peft prompt or prefix)."""
    t = hf_model.transformer
    grad_below = trainable_input or _trains(t.wte) or _trains(t.wpe)
    per_token = per_context = 0

    def matmuls(module: torch.nn.Module) -> None:
        nonlocal grad_below, per_token
        # A LoRA layer yields base_layer, lora_A, lora_B in this order: A and the base share the input.
        for leaf in (m for m in module.modules() if isinstance(m, (torch.nn.Linear, Conv1D))):
            weights = leaf.weight.numel()
            per_token += 2 * weights * (1 + grad_below + leaf.weight.requires_grad)
            grad_below = grad_below or _trains(leaf)

    d = hf_model.config.n_embd
    for block in t.h:
        grad_below = grad_below or _trains(block.ln_1)
        matmuls(block.attn.c_attn)
        per_context += 4 * d + 8 * d * grad_below
        matmuls(block.attn.c_proj)
        grad_below = grad_below or _trains(block.ln_2)
        matmuls(block.mlp.c_fc)
        matmuls(block.mlp.c_proj)
    grad_below = grad_below or _trains(t.ln_f)
    matmuls(hf_model.lm_head)
    return FlopCount(per_token, per_context, virtual_tokens)
