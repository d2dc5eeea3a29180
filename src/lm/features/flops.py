"""The model FLOPs of a decoder LM's training step (GPT-2, Llama, Qwen2, Mistral, ...): the numerator of
MFU, with its convention stated once.

Model FLOPs (PaLM, appendix B): the work the model needs, not what the hardware happens to do, so
gradient checkpointing's recomputation and the padding of a batch are not counted. Exactly:

- Matmuls only, 2 FLOPs per multiply-add. Embedding lookups (wte, wpe), LayerNorms, biases, GELU,
  softmax and the loss are left out: O(d) per token, under 1% of GPT-2 small.
- N is the matmul weights each token goes through: every block's attn.c_attn, attn.c_proj, mlp.c_fc
  and mlp.c_proj (12·d² a layer; Llama-like: q, k, v, o and the MLP's gate, up and down projections by
  their real shapes, so GQA's narrower k and v count less), LoRA adapters' A and B, and the LM head
  (V·d). The head is real
  compute though its weight is the tied token embedding, so N is Kaplan's non-embedding count minus
  biases and LayerNorms, plus the head (nanoGPT's count, all parameters minus wpe, is the same plus
  those biases and LayerNorms).
- Forward 2 per weight. Backward: 2 per weight for the gradient of the matmul's input, when that
  input depends on a trainable parameter (activation gradients flow through frozen layers, but
  nothing is computed below the lowest trainable one), and 2 per weight for the weight gradient,
  when the weight trains. Full training is 6N; LoRA on a frozen base is 2N forward, about 2N of
  activation gradients and the adapters' own 6 per weight: about 4N.
- Attention (Q·Kᵀ and A·V): 4·d per layer per token per token of context forward (d = query heads x head
  dim), 8·d backward when
  the layer's q, k, v need gradients; full training is PaLM's 12·L·d·T per token. T is the sequence's
  own real length (every key, as PaLM and nanoGPT: causal masking is not halved; a sliding window
  shorter than the sequence, Mistral's, is not taken into account).
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


def _projections(attention: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention module's projections in order (GPT-2: c_attn, c_proj; Llama: q, k, v, o_proj), each
    possibly wrapped by a LoRA layer: its direct children that hold a matmul."""
    return [
        child
        for child in attention.children()
        if any(isinstance(m, (torch.nn.Linear, Conv1D)) for m in child.modules())
    ]


def count_flops(
    hf_model: torch.nn.Module, layers: torch.nn.ModuleList, trainable_input: bool = False, virtual_tokens: int = 0
) -> FlopCount:
    """Walk a decoder-only HF model in forward order, counting each matmul's backward by whether its input
    needs a gradient (something trainable below it) and whether its weight trains. Any architecture: within
    a layer, a child with several projections (attention: GPT-2's c_attn, c_proj; Llama's q, k, v, o_proj;
    MLP: c_fc, c_proj or gate, up, down_proj) has input projections that all read the child's input and a
    last one, its output; the attention is the child whose class is named so. GQA's narrower k/v, SwiGLU's
    three matrices and an untied head count by their real shapes.
    `trainable_input`: something trainable outside the model feeds it (a peft prompt or prefix)."""
    body = next(m for m in hf_model.modules() if any(c is layers for c in m.children()))  # owns the layer list
    children = list(body.children())
    before, after = children[: children.index(layers)], children[children.index(layers) + 1 :]
    grad = trainable_input or any(_trains(m) for m in before)  # embeddings (GPT-2: and positions)
    per_token = per_context = 0
    config = hf_model.config

    def project(module: torch.nn.Module, grad_in: bool) -> bool:
        """Count `module`'s matmuls for an input that needs a gradient or not; whether its output needs one.
        A LoRA layer yields base_layer, lora_A, lora_B in this order: A and the base share the input."""
        nonlocal per_token
        needs = grad_in
        for leaf in (m for m in module.modules() if isinstance(m, (torch.nn.Linear, Conv1D))):
            per_token += 2 * leaf.weight.numel() * (1 + needs + leaf.weight.requires_grad)
            needs = needs or _trains(leaf)
        return needs

    for layer in layers:
        for child in layer.children():
            projections = _projections(child)
            if not projections:  # a norm: its gain may train
                grad = grad or _trains(child)
                continue
            inputs = [project(p, grad) for p in projections[:-1]]
            if "Attention" in type(child).__name__ and inputs:
                # Q·Kᵀ and A·V run over every query head, of the layer's own width (per layer in a heterogeneous
                # config, Gemma-4's, whose global head_dim refuses to be read)
                head_dim = getattr(child, "head_dim", None) or getattr(config, "head_dim", None)
                width = config.num_attention_heads * (head_dim or config.hidden_size // config.num_attention_heads)
                q, k, v = inputs if len(inputs) == 3 else [any(inputs)] * 3  # GPT-2: one fused q/k/v projection
                # forward Q·Kᵀ and A·V; backward: dQ, dK, dA (when Q or K needs it) and dV, each 2·width
                per_context += 4 * width + 2 * width * (q + k + (q or k) + v)
            out = project(projections[-1], any(inputs) if inputs else grad)
            grad = grad or out
    grad = grad or any(_trains(m) for m in after)
    project(hf_model.get_output_embeddings(), grad)
    return FlopCount(per_token, per_context, virtual_tokens)
