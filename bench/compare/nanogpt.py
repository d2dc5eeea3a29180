"""A nanoGPT-style GPT and training loop, written for the benchmark (no outside code is run), so that the
template can be compared with nanoGPT (github karpathy/nanoGPT, model.py and train.py) on one machine.

It mirrors what nanoGPT's train.py does on a CPU (`--device=cpu --compile=False`): fp32 (nanoGPT's
autocast context is a nullcontext on CPU), no bias in Linear/LayerNorm (its `bias = False` default),
exact GELU, attention through torch's `scaled_dot_product_attention(is_causal=True)` ("flash"),
tied embeddings, its weight init, AdamW with decay on >= 2-D weights and torch's default
implementation (nanoGPT asks for fused only on CUDA), its warm-up + cosine LR set by hand each step,
gradient clipping at 1.0, `zero_grad(set_to_none=True)`, and batches drawn at random offsets of the
memory-mapped token file. Used by `python -m bench.compare.throughput` as the way `nanogpt`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd, bias=bias),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def lr_at(it: int, lr: float, warmup: int = 100, decay_iters: int = 5000, min_lr: float = 6e-5) -> float:
    """nanoGPT's get_lr: linear warm-up, then cosine decay to min_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay_iters - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def train(
    tokens: np.ndarray,
    vocab_size: int,
    shape: tuple[int, int, int, int, int],
    steps: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    clip: float,
    clock,
    bias: bool = False,
) -> list[float]:
    """nanoGPT's loop (gradient_accumulation_steps=1, fp32); the time at the end of each optimizer step.
    bias=True: nanoGPT's `--bias=True`, GPT-2's own architecture (biases in every Linear and LayerNorm)."""
    layers, heads, width, ctx, batch = shape
    torch.manual_seed(1337)
    model = GPT(vocab_size, ctx, layers, heads, width, bias=bias)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas)  # fused only on CUDA in nanoGPT

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(tokens) - ctx - 1, (batch,))
        x = torch.stack([torch.from_numpy(tokens[i : i + ctx].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + ctx].astype(np.int64)) for i in ix])
        return x, y

    model.train()
    X, Y = get_batch()
    times = []
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, lr)
        _, loss = model(X, Y)
        X, Y = get_batch()  # nanoGPT prefetches the next batch while the device works
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(clock())
    return times
