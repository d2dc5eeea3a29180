"""A reward model from preference pairs (`model/objective=reward` with `data=preference`): any causal LM with its
output layer replaced by a one-output head, trained with the Bradley-Terry loss -log σ(r(chosen) - r(rejected) -
margin) (the record's margin when the data has one, as TRL's RewardTrainer, else 0), plus `center_rewards` x
(r(chosen) + r(rejected))² (Eisenstein et al. 2023, TRL's center_rewards_coefficient).

A sequence's reward is the head's output at the last token the model reads: the whole prompt and answer but the
answer's closing EOS (the inputs are shifted, as for every objective here). That is the token transformers'
`AutoModelForSequenceClassification` and TRL's RewardTrainer score when the pad token is the EOS (GPT-2's case):
the rightmost token that is not a pad. export-hf writes that sequence-classification model (`score.weight`,
`num_labels=1`, `pad_token_id` = the data's EOS), which gives the same scores.

Why a head of ours in place of the LM's output layer rather than transformers' sequence-classification class: the
model stays the causal LM every part of this template builds, shards and checks (deferred init, FSDP2 units,
ZeRO-3, pretrained loading, adapters, the FLOP count), and no vocabulary-sized logits are computed. The head's
initial values come from src/lm/init.py, the same on any layout.

Exact from 1 device to N as DPO is: every term is per pair, the loss their mean over the optimizer step's pairs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from src.lm.objectives.base import PairObjective, TrainedModule
from src.utils.config import ConfigError, check_number
from src.utils.precision import at_least_fp32


class Reward(PairObjective):
    name = "reward"
    generates = False
    # per pair, summed over pairs and logged as their mean (named as DPO's)
    STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    refused_under = ("own_loss", "split_vocabulary")

    def __init__(self, center_rewards: float = 0.0) -> None:
        super().__init__()
        check_number("model.objective.center_rewards", center_rewards, lambda v: v >= 0,
                     "0 (off) or a positive weight (0.01 is usual)")  # fmt: skip
        self.center_rewards = float(center_rewards)

    # ---- the model ----

    def prepare(self, model: nn.Module) -> list[str]:
        """The output layer becomes a one-output head (untied from the embeddings), on the model's device."""
        old = model.get_output_embeddings()
        if old.out_features == 1:  # prepared already
            return []
        text = model.config.get_text_config()
        text.tie_word_embeddings = False
        # transformers' sequence classifier scores the decoder's last hidden state with its head and nothing more;
        # Gemma 2/3's causal LM soft-caps its logits after the head (8e-6 apart on a tiny Gemma 2, growing with the
        # reward): off, so the export gives the same scores
        if getattr(text, "final_logit_softcapping", None) is not None:
            text.final_logit_softcapping = None
        head = nn.Linear(old.in_features, 1, bias=False, device=old.weight.device, dtype=old.weight.dtype)
        model.set_output_embeddings(head)
        return [next(name for name, p in model.named_parameters() if p is head.weight)]

    def check(self, module: TrainedModule) -> None:
        from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

        config = module.hf_model.config
        if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
            raise ConfigError(
                f"model/objective=reward on {config.model_type}: transformers has no sequence-classification model "
                "for it, so its reward model could not be exported or used as GRPO's reward; use an architecture "
                "that has one (llama, qwen2, mistral, gemma2, gpt2, ...)."
            )

    def export(self, model: nn.Module, pad_id: Optional[int] = None) -> nn.Module:
        """The same weights as transformers' sequence-classification model with one label, which scores the
        rightmost token that is not `pad_id` (the data's EOS): the token `scores` reads."""
        from transformers import AutoModelForSequenceClassification

        config = copy.deepcopy(model.config)
        config.num_labels, config.pad_token_id = 1, pad_id
        config.architectures = None
        classifier = AutoModelForSequenceClassification.from_config(config).to(model.dtype)
        head = next(name for name, p in model.named_parameters() if p is model.get_output_embeddings().weight)
        state = {("score.weight" if k == head else k): v for k, v in model.state_dict().items()}
        classifier.load_state_dict(state, strict=True)
        return classifier

    # ---- the loss ----

    def scores(self, module: TrainedModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(2B,) each row's reward: the head's output at its last real input token, fp32 at least. Read from the
        model's logits (the forward's own output, which FSDP2 backpropagates through); `prepare` switched off what a
        causal LM's forward does to them beyond the head (Gemma's soft-capping)."""
        mask = batch["attention_mask"]
        out = module.lm_forward(batch).logits
        out = at_least_fp32(out[:, -mask.shape[1] :, 0])  # prompt tuning prepends virtual tokens
        last = (mask.sum(dim=1) - 1).clamp(min=0)
        return out[torch.arange(out.shape[0], device=out.device), last]

    def pair_stats(self, rewards: torch.Tensor, margins: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(pairs, len(STATS)) from the (2B,) rewards, chosen rows first; `margins`: the data's, subtracted in the
        loss as TRL does (-log σ(r(c) - r(r) - margin)), not in the logged margins."""
        chosen, rejected = rewards.chunk(2)
        margin = chosen - rejected
        loss = -F.logsigmoid(margin if margins is None else margin - margins.to(margin.dtype))
        if self.center_rewards:
            loss = loss + self.center_rewards * (chosen + rejected) ** 2
        detached = [chosen.detach(), rejected.detach(), (margin > 0).to(loss.dtype), margin.detach()]
        return torch.stack([loss, *detached], dim=1)

    def pair_sums(self, module: TrainedModule, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self.pair_stats(self.scores(module, batch), batch.get("margin"))
        real = (batch["labels"] != -100).any(dim=1).chunk(2)[0]
        return (stats * real[:, None]).sum(dim=0), real.sum()


class RewardModelScore:
    """A trained reward model as a reward function of model/objective=grpo: `{_target_: src.lm.objectives.reward.
    RewardModelScore, path: DIR}`, DIR what export-hf wrote for a `model/objective=reward` checkpoint (transformers'
    sequence-classification model, one label). Each completion's reward is the model's score of prompt + completion
    as text, tokenized by the reward model's own tokenizer (saved beside it; bytes where export-hf wrote
    TOKENIZER.md), which must be the policy's (GRPO checks it before the first step): scored at the last token, as
    the reward model was trained."""

    def __init__(self, path: str, batch_size: int = 64) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        where = Path(path).expanduser()
        if not (where / "config.json").is_file():
            raise ConfigError(
                f"RewardModelScore path={path!r} is not a Hugging Face dir: export the reward model's checkpoint "
                "first (python -m src.tools.checkpoints export-hf CKPT DIR) and name DIR."
            )
        self.model = AutoModelForSequenceClassification.from_pretrained(where).eval()
        if self.model.config.num_labels != 1:
            raise ConfigError(
                f"RewardModelScore path={path!r} has {self.model.config.num_labels} labels: a reward model has one."
            )
        self.tokenizer = None if (where / "TOKENIZER.md").is_file() else AutoTokenizer.from_pretrained(where)
        self.path, self.batch_size, self.__name__ = path, batch_size, "reward_model"

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is None:  # this template's byte tokenizer: UTF-8 bytes
            return [list(text.encode("utf-8")) for text in texts]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def check_tokenizer(self, tokenizer: Any) -> None:
        """One sentence unless the policy's tokenizer gives the reward model's ids and EOS."""
        probe = ["The policy's tokens, 0123 ¿üé 中文 \n\t end"]
        same = [list(map(int, ids)) for ids in tokenizer.encode_batch(probe)] == self.encode(probe)
        if not same or tokenizer.eos_id != self.model.config.pad_token_id:
            raise ConfigError(
                f"The reward model {self.path} has another tokenizer than the policy's (data.tokenizer): train the "
                "reward model with the policy's tokenizer, or use a policy with the reward model's."
            )

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        ids = self.encode([p + c for p, c in zip(prompts, completions)])
        scores = []
        for start in range(0, len(ids), self.batch_size):
            rows = ids[start : start + self.batch_size]
            batch = torch.full((len(rows), max(map(len, rows))), self.model.config.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(batch)
            for i, row in enumerate(rows):
                batch[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
            scores += self.model(input_ids=batch, attention_mask=mask).logits[:, 0].float().tolist()
        return scores
