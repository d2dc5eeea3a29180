"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) as an objective: `model/objective=grpo` with
`data=prompts`. Each step samples `num_generations` (G) completions of every prompt from the current policy, scores
them with reward functions, normalises each reward within its prompt's group (the advantage), and takes the clipped
policy-gradient loss, plus `beta` x a KL penalty to the frozen starting policy; named as in TRL's GRPOTrainer
(`loss_type=grpo`: each completion's token mean, then the mean over completions; `dr_grpo`: token sums over
`max_new_tokens`; one update per generation, so the ratio is 1 and the clip does not act, as TRL's default).

Exact from 1 device to N, which TRL does not promise:
- a completion's randomness comes from (the run's seed, the step, the prompt's number, the sample's index): each
  token is the Gumbel-max sample of its row's logits with noise from that row's own generator, never from a rank's;
- a prompt's G samples are generated and trained together, on one rank, as one batch of the same shape on any
  number of ranks (no padding: they share the prompt), so its group statistics never depend on the split;
- the loss is the mean over the optimizer step's prompts (LitModule.token_mean_loss, one target per prompt).
So 1 process x 8 prompts = 2 ranks x 4 = 1 x 4 x accumulation 2: the same samples, rewards, losses and weights.

Generation runs `max_new_tokens` forwards for every prompt, also after its EOS (tokens after the first EOS are
masked out): FSDP2 and ZeRO-3 gather parameters in every forward, so every rank must run as many.

Reward functions take TRL's signature, `f(prompts=[...], completions=[...], **columns) -> list[float]` (the data's
other fields by name, one value per completion): `_target_` any importable function (src/lm/objectives/verifiers.py has
exact-match and format rewards), weighted and summed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from src.core.metrics import epoch_values
from src.lm.objectives.base import MeanStats, Objective, TrainedModule, disable_dropout
from src.utils.config import ConfigError, check_number
from src.utils.precision import at_least_fp32

log = logging.getLogger(__name__)

LOSS_TYPES = ("grpo", "dr_grpo")
SCALE_REWARDS = ("group", "none")


def function_name(f: Callable) -> str:
    return getattr(f, "__name__", None) or getattr(getattr(f, "func", None), "__name__", type(f).__name__)


def sample_seed(base_seed: int, step: int, prompt: int, sample: int) -> int:
    digest = hashlib.sha256(f"{base_seed}:{step}:{prompt}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def keyed_pick(
    logits: torch.Tensor, generators: list[torch.Generator], temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """One token per row: the Gumbel-max sample of softmax(logits / temperature) after top-k and top-p (HF's
    filters), each row's noise drawn from its own generator (also generate.py's sampling)."""
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = logits.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    noise = torch.stack([torch.rand(logits.shape[-1], generator=g, dtype=torch.float64) for g in generators])
    gumbel = -torch.log(-torch.log(noise.clamp(min=1e-300))).to(logits.device, logits.dtype)
    return (logits + gumbel).argmax(dim=-1)


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including each row's first EOS (TRL's rule), 0 after it."""
    is_eos = completions == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), completions.shape[1])
    return (torch.arange(completions.shape[1], device=completions.device)[None] <= first[:, None]).long()


def group_advantages(rewards: torch.Tensor, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, the group's standard deviation) of one prompt's G rewards: minus their mean, over their
    (unbiased) standard deviation + 1e-4 when scale=group, as TRL's scale_rewards."""
    std = rewards.std()
    advantages = rewards - rewards.mean()
    return (advantages / (std + 1e-4) if scale == "group" else advantages), std


def checked_rewards(rewards: Sequence[Callable], reward_weights: Optional[Sequence[float]]) -> tuple[list, list]:
    """(the reward functions, their weights: all 1 where none are given), or one sentence."""
    rewards = list(rewards)
    if not rewards or not all(callable(f) for f in rewards):
        raise ConfigError(
            "model.objective.rewards needs at least one reward function: a list of {_target_: module.function, "
            "_partial_: true} (src/lm/objectives/verifiers.py has exact_match and format_match)."
        )
    weights = [1.0] * len(rewards) if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != len(rewards):
        raise ConfigError(
            f"model.objective.reward_weights has {len(weights)} weights for {len(rewards)} reward functions: "
            "give one per function, or none (all 1)."
        )
    return rewards, weights


def check_sampling(num_generations: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    check_number(
        "model.objective.num_generations", num_generations, lambda v: v >= 2,
        "2 or more samples per prompt (a group of one has no spread to learn from)", integer=True,
    )  # fmt: skip
    check_number("model.objective.max_new_tokens", max_new_tokens, lambda v: v >= 1, "a positive number of tokens",
                 integer=True)  # fmt: skip
    if not temperature > 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ConfigError(
            f"model.objective sampling: temperature={temperature!r} must be > 0, top_p={top_p!r} in (0, 1], "
            f"top_k={top_k!r} >= 0 (0: off)."
        )


def check_loss(loss_type: str, scale_rewards: str, beta: float, epsilon: float) -> None:
    if loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"model.objective.loss_type={loss_type!r}: use one of {', '.join(LOSS_TYPES)} (TRL's bnpo and dapo "
            "normalise by the tokens of a batch that is not known before sampling, which would change with N)."
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(
            f"model.objective.scale_rewards={scale_rewards!r}: use group or none (batch scaling would mix "
            "the prompts of a step, which N ranks hold apart)."
        )
    if not beta >= 0 or not epsilon >= 0:
        raise ConfigError(f"model.objective: beta={beta!r} and epsilon={epsilon!r} must be >= 0.")


class GRPO(Objective):
    name = "grpo"
    batch_kind = "prompts"
    refused_under = ("own_loss", "no_sampling")

    def __init__(
        self,
        rewards: Sequence[Callable] = (),
        reward_weights: Optional[Sequence[float]] = None,
        num_generations: int = 4,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        loss_type: str = "grpo",
        scale_rewards: str = "group",
        disable_dropout: bool = True,
    ) -> None:
        super().__init__()
        rewards, weights = checked_rewards(rewards, reward_weights)
        check_sampling(num_generations, max_new_tokens, temperature, top_p, top_k)
        check_loss(loss_type, scale_rewards, beta, epsilon)
        self.rewards, self.reward_weights = rewards, torch.tensor(weights, dtype=torch.float64)
        self.G, self.max_new_tokens = num_generations, max_new_tokens
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.beta, self.epsilon_low, self.kl_correction = float(beta), float(epsilon), use_bias_correction_kl
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.loss_type, self.scale_rewards, self.disable_dropout = loss_type, scale_rewards, disable_dropout
        self.names = [function_name(f) for f in rewards]
        self.STATS = (
            "loss",
            "reward",
            "reward_std",
            "completion_length",
            "kl",
            "clip_ratio",
            *(f"rewards/{n}" for n in self.names),
        )
        self.EVAL_STATS = ("reward", "reward_std", "completion_length", *(f"rewards/{n}" for n in self.names))
        self.val_metrics = nn.ModuleDict({"prompts": MeanStats(self.EVAL_STATS)})
        self.test_metrics = nn.ModuleDict({"prompts": MeanStats(self.EVAL_STATS)})
        self.samples: list[tuple[str, str, float]] = []  # the last group scored: prompt, completions, rewards
        self.sampling_seconds = 0.0  # wall time sampling since the module was built (read by bench/compare/grpo.py)

    # ---- the model ----

    def prepare(self, model: nn.Module) -> list[str]:
        if self.disable_dropout:
            disable_dropout(model)
        return []

    def needs_reference(self, adapter: bool) -> bool:
        return self.beta > 0 and not adapter

    def on_fit_start(self, module: TrainedModule) -> None:
        datamodule = module.trainer.datamodule
        for f in self.rewards:  # a reward model reads the policy's tokens as its own (src/lm/objectives/reward.py)
            if hasattr(f, "check_tokenizer"):
                f.check_tokenizer(datamodule.tokenizer)
        room = datamodule.max_prompt_len + self.max_new_tokens
        if room > module.seq_len:
            raise ConfigError(
                f"data.max_prompt_len={datamodule.max_prompt_len} + model.objective.max_new_tokens="
                f"{self.max_new_tokens} exceed data.seq_len={module.seq_len}, the model's context here: lower one "
                "or raise data.seq_len."
            )

    # ---- sampling ----

    def pick(self, logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        return keyed_pick(logits, generators, self.temperature, self.top_k, self.top_p)

    @torch.no_grad()
    def sample(self, module: TrainedModule, prompt: torch.Tensor, step: int, number: int) -> torch.Tensor:
        """(G, max_new_tokens) completions of one prompt (1-D ids), G rows in one batch, with a KV cache."""
        generators = [
            torch.Generator().manual_seed(sample_seed(module.base_seed, step, number, g)) for g in range(self.G)
        ]
        ids, tokens, cache = prompt.expand(self.G, -1), [], None
        with torch.compiler.set_stance("force_eager"):  # model.compile's graphs are the training forward's
            for _ in range(self.max_new_tokens):
                out = module.model(input_ids=ids, cache=cache, use_cache=True)
                ids, cache = self.pick(out.logits[:, -1], generators)[:, None], out.cache
                tokens.append(ids)
        return torch.cat(tokens, dim=1)

    def score(self, module: TrainedModule, number: int, completions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(G, functions) each reward function's value for each completion (decoded up to its EOS)."""
        datamodule = module.trainer.datamodule
        tokenizer = datamodule.tokenizer
        texts = [
            tokenizer.decode([t for t in row[: int(n)].tolist() if t != tokenizer.eos_id])
            for row, n in zip(completions, mask.sum(dim=1))
        ]
        columns = {k: [v] * self.G for k, v in datamodule.columns[number].items()}
        prompts = [datamodule.texts[number]] * self.G
        scores = []
        for f, name in zip(self.rewards, self.names):
            values = f(prompts=prompts, completions=texts, **columns)
            if not isinstance(values, (list, tuple, torch.Tensor)) or len(values) != self.G:
                raise ConfigError(
                    f"The reward function {name} returned {type(values).__name__} "
                    f"{'of length ' + str(len(values)) if hasattr(values, '__len__') else ''} for {self.G} "
                    "completions: return one number per completion (a list)."
                )
            scores.append(torch.as_tensor(values, dtype=torch.float64))
        scores = torch.stack(scores, dim=1)
        self.samples = [(prompts[0], t, float(r)) for t, r in zip(texts, scores @ self.reward_weights)]
        return scores

    # ---- the loss ----

    def token_logps(
        self, network: nn.Module, module: TrainedModule, sequences: torch.Tensor, n_prompt: int
    ) -> torch.Tensor:
        """(G, T) the completion tokens' log-probabilities under softmax(logits / temperature), as TRL computes them."""
        logits = module.lm_forward({"input_ids": sequences}, network=network).logits[:, n_prompt - 1 : -1]
        logps = (at_least_fp32(logits) / self.temperature).log_softmax(dim=-1)
        return logps.gather(-1, sequences[:, n_prompt:, None]).squeeze(-1)

    def reference_logps(self, module: TrainedModule, sequences: torch.Tensor, n_prompt: int) -> torch.Tensor:
        with torch.no_grad():
            if module.reference is None:  # an adapter: the reference is the model without it
                with module.model.disable_adapter():
                    return self.token_logps(module.model, module, sequences, n_prompt)
            return self.token_logps(module.reference, module, sequences, n_prompt)

    def group_loss(
        self,
        module: TrainedModule,
        prompt: torch.Tensor,
        completions: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the mean over the group's completions of each one's loss, its mean KL, its clipped fraction) for fixed
        completions (G, T) of `prompt` and their advantages (G,)."""
        sequences = torch.cat([prompt.expand(completions.shape[0], -1), completions], dim=1)
        logps = self.token_logps(module.model, module, sequences, prompt.shape[0])
        mask = mask.to(logps.dtype)
        ratio = torch.exp(logps - logps.detach())  # one update per generation: the sampling policy is this one
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        a = advantages.to(logps.dtype)[:, None]
        per_token = -torch.min(ratio * a, clipped * a)
        kl = torch.zeros_like(logps)
        if self.beta:
            delta = self.reference_logps(module, sequences, prompt.shape[0]) - logps
            kl = torch.exp(delta) - delta - 1
            # times the ratio (1, but not its gradient): the unbiased reverse-KL gradient, TRL's default
            per_token = per_token + self.beta * (kl * ratio if self.kl_correction else kl)
        tokens = mask.sum(dim=1).clamp(min=1)
        if self.loss_type == "grpo":
            loss = ((per_token * mask).sum(dim=1) / tokens).mean()
        else:  # dr_grpo
            loss = ((per_token * mask).sum(dim=1) / self.max_new_tokens).mean()
        kl_mean = ((kl.detach() * mask).sum(dim=1) / tokens).mean()
        was_clipped = ((ratio * a) > (clipped * a)).to(logps.dtype)
        return loss, kl_mean, ((was_clipped * mask).sum() / mask.sum().clamp(min=1)).detach()

    def prompt_stats(
        self, module: TrainedModule, prompt: torch.Tensor, step: int, number: int, train: bool
    ) -> torch.Tensor:
        """One prompt's row of STATS (train) or EVAL_STATS: sample, score, and (train) the loss with its gradient."""
        start = time.perf_counter()
        completions = self.sample(module, prompt, step, number)
        self.sampling_seconds += time.perf_counter() - start  # no device sync: a CPU's figure (or a lower bound)
        mask = completion_mask(completions, module.trainer.datamodule.tokenizer.eos_id)
        per_function = self.score(module, number, completions, mask)  # (G, functions), float64 on the CPU
        rewards = per_function @ self.reward_weights
        advantages, std = group_advantages(rewards, self.scale_rewards)
        common = [rewards.mean(), std, mask.sum(dim=1).double().mean().cpu()]
        means = list(per_function.mean(dim=0))
        if not train:
            return torch.stack([*common, *means]).float().to(module.device)
        loss, kl, clip = self.group_loss(module, prompt, completions, mask, advantages.to(module.device))
        stats = torch.stack([*common, kl.double().cpu(), clip.double().cpu(), *means]).to(loss)
        return torch.cat([loss[None], stats])

    def prompt_sums(self, module: TrainedModule, batch: dict[str, torch.Tensor], step: int, train: bool):
        """The sums over the batch's prompts of each statistic and the number of prompts (evaluation's padding
        prompts, numbered -1, are sampled, so every rank runs as many forwards, and counted nowhere)."""
        rows, real = [], []
        for ids, n, number in zip(batch["prompt_ids"], batch["prompt_lengths"], batch["prompt_index"].tolist()):
            rows.append(self.prompt_stats(module, ids[: int(n)], step, max(number, 0), train))
            real.append(number >= 0)
        real = torch.tensor(real, device=module.device)
        return (torch.stack(rows) * real[:, None].to(rows[0].dtype)).sum(dim=0), real.sum()

    # ---- the objective (src/lm/objectives/base.py) ----

    def training_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        trainer = module.trainer
        sums, prompts = self.prompt_sums(module, batch, trainer.global_step, train=True)
        loss = module.token_mean_loss(sums[0], prompts, batch_idx)
        module.log_train_loss(loss, batch_idx, torch.cat([sums[1:].detach(), prompts[None].to(sums.dtype)]))
        if trainer.is_global_zero and (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self.log_samples(trainer)
        return loss

    def log_samples(self, trainer: Any) -> None:
        """The step's last prompt on rank 0 and its completions with their rewards, in TensorBoard's text tab."""
        prompt = self.samples[0][0] if self.samples else ""
        rows = "\n".join(f"| {reward:.3g} | {text!r:.300} |" for _, text, reward in self.samples)
        for logger in trainer.loggers:
            if hasattr(logger.experiment, "add_text"):
                text = f"prompt: `{prompt!r:.300}`\n\n| reward | completion |\n|---|---|\n{rows}"
                logger.experiment.add_text("samples/grpo", text, trainer.global_step)

    def train_metrics(self, loss: torch.Tensor, sums: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        return {"train/loss": loss, **{f"train/{name}": s / sums[-1] for name, s in zip(self.STATS[1:], sums[:-1])}}

    def evaluation_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], metrics: nn.ModuleDict) -> None:
        metrics["prompts"].update(*self.prompt_sums(module, batch, -1, train=False))

    def epoch_metrics(self, stage: str, metrics: nn.ModuleDict) -> dict[str, torch.Tensor]:
        """The held-out prompts' mean reward and the rest; `loss` is minus the mean reward, so the best-checkpoint
        rule (the lowest val/loss, conf/callbacks/model_checkpoint.yaml) keeps the highest reward."""
        values = epoch_values(stage, metrics)
        return {f"{stage}/loss": -values[f"{stage}/reward"], **values}
