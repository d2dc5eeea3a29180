"""generate.py's sampling: a prompt's completion, its randomness keyed by (seed, prompt number), never a rank's.

Each prompt is completed alone (a batch of one: no padding, so its numbers do not depend on which prompts share a
batch) by transformers' `generate` with its KV cache; a sampled token is the Gumbel-max pick of GRPO
(src/lm/objectives/grpo.py `keyed_pick`: temperature, top-k, top-p) with noise from the prompt's own generator, seeded
by a hash of (seed, prompt number) and drawn once per token position, so the text is the same on any number of
ranks. temperature=0 is greedy search. On N ranks rank r takes prompts r, r + N, ...; every rank runs as many
`generate` calls (a rank short of one repeats prompt 0 and drops it) with `synced_gpus` where the parameters are
sharded (FSDP2, ZeRO-3), whose gathers run in every forward.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from src.lm.callbacks.generate_text import prompt_learning_inputs
from src.lm.objectives.grpo import keyed_pick, sample_seed
from src.utils.config import ConfigError

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def read_prompts(path: str) -> list[str]:
    """The prompts of a .txt file (one a line, blank lines skipped) or a .jsonl of {"prompt": ...}, in file order."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"prompts_file={path!r} does not exist: give a .txt (one prompt a line) or a .jsonl file.")
    lines = file.read_text(encoding="utf-8").splitlines()
    if file.suffix == ".txt":
        prompts = [line for line in lines if line.strip()]
    elif file.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                record = e
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ConfigError(
                    f'prompts_file={path!r}: line {n} is not a JSON object with a "prompt" string; '
                    'write one {"prompt": "..."} a line.'
                )
            prompts.append(record["prompt"])
    else:
        raise ConfigError(f'prompts_file={path!r}: use a .txt (one prompt a line) or a .jsonl of {{"prompt": ...}}.')
    if not prompts:
        raise ConfigError(f"prompts_file={path!r} holds no prompt: write one a line.")
    return prompts


def stop_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS and the end-of-turn tokens its vocabulary has (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>, ...): where a completion or an assistant's turn ends."""
    ids = [tokenizer.eos_id]
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        vocab = hf.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN if t in vocab and vocab[t] not in ids]
    return ids


class RankShare(Sampler):
    """Prompt numbers r, r + N, ... for rank r of N, read when iterated (the ranks exist by then); every rank gets
    ceil(n / N), index n (a dataset's item after the n prompts: a padding item) where it has no prompt left."""

    def __init__(self, n: int) -> None:
        self.n = n

    def share(self) -> list[int]:
        up = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if up else (1, 0)
        return [min(i, self.n) for i in range(rank, math.ceil(self.n / world) * world, world)]

    def __iter__(self):
        return iter(self.share())

    def __len__(self) -> int:
        return len(self.share())


class KeyedSampling:
    """A logits processor for greedy search: every score but the keyed pick's is -inf, so greedy takes the sample."""

    def __init__(self, generator: torch.Generator, temperature: float, top_k: int, top_p: float) -> None:
        self.generator, self.settings = generator, (temperature, top_k, top_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        picked = keyed_pick(scores, [self.generator] * scores.shape[0], *self.settings)
        return torch.full_like(scores, float("-inf")).scatter_(1, picked[:, None], 0.0)


class Printer:
    """A `generate` streamer: the completion's text on stdout as its tokens come (not the prompt, not past EOS)."""

    def __init__(self, tokenizer: Any, stops: list[int], out=None) -> None:
        self.tokenizer, self.stops, self.out = tokenizer, stops, out or sys.stdout
        self.ids: list[int] = []
        self.shown, self.prompt_seen, self.stopped = "", False, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands the prompt over first
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.stopped = self.stopped or token in self.stops
            if not self.stopped:
                self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # a character still incomplete: wait for its next byte
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text

    def end(self) -> None:
        self.out.write(self.tokenizer.decode(self.ids)[len(self.shown) :] + "\n")
        self.out.flush()


def check_sampling(cfg: Any) -> None:
    if not cfg.max_new_tokens >= 1 or not cfg.temperature >= 0 or not 0 < cfg.top_p <= 1 or cfg.top_k < 0:
        raise ConfigError(
            f"max_new_tokens={cfg.max_new_tokens!r} must be >= 1, temperature={cfg.temperature!r} >= 0 (0: greedy), "
            f"top_p={cfg.top_p!r} in (0, 1], top_k={cfg.top_k!r} >= 0 (0: off)."
        )


@torch.no_grad()
def complete(
    model: torch.nn.Module,
    ids: list[int],
    cfg: Any,
    number: int,
    stops: list[int],
    synced: bool = False,
    streamer: Optional[Printer] = None,
) -> list[int]:
    """The new tokens of prompt `number` (token ids `ids`), up to its first stop token (excluded)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    generator_model, inputs, virtual = prompt_learning_inputs(model, input_ids, torch.ones_like(input_ids))
    context = model.config.max_position_embeddings - virtual
    if len(ids) >= context:
        raise ConfigError(
            f"Prompt {number} has {len(ids)} tokens and the model's context is {context}: shorten it, leaving room for "
            "the completion."
        )
    processors = []
    if cfg.temperature > 0:
        generator = torch.Generator().manual_seed(sample_seed(cfg.seed or 0, 0, number, 0))
        processors.append(KeyedSampling(generator, cfg.temperature, cfg.top_k, cfg.top_p))
    with torch.compiler.set_stance("force_eager"):
        out = generator_model.generate(
            **inputs,
            max_new_tokens=min(cfg.max_new_tokens, context - len(ids)),
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=stops[0],
            logits_processor=processors,
            synced_gpus=synced,
            streamer=streamer,
        )
    new = (out[0] if "inputs_embeds" in inputs else out[0, len(ids) :]).tolist()
    first = min((new.index(s) for s in stops if s in new), default=len(new))
    return new[:first]
