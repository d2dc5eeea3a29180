"""GPT-2 language model as a LightningModule: `transformers.GPT2LMHeadModel` from a `GPT2Config`,
or pretrained weights; optionally with LoRA or another peft adapter, and gradient checkpointing."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch
from torchmetrics import Metric
from transformers import GPT2Config, GPT2LMHeadModel

from src.models import init
from src.models.base import LitModule
from src.models.flops import FlopCount, count_gpt2
from src.utils.config import ConfigError, check_int

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


def load_pretrained(name_or_path: str, attn_implementation: str = "sdpa", config_only: bool = False):
    """The pretrained GPT2LMHeadModel, or with `config_only` just its GPT2Config (no weights read)."""
    try:
        if config_only:
            return GPT2Config.from_pretrained(name_or_path, attn_implementation=attn_implementation)
        return GPT2LMHeadModel.from_pretrained(name_or_path, attn_implementation=attn_implementation)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"model.pretrained={name_or_path!r} could not be loaded ({first}). Pass a local dir with "
                          "config.json + model.safetensors, or a hub name such as gpt2 when online.") from e


def gpt2_fill(config: GPT2Config) -> init.Fill:
    """GPT-2's initialisation scheme (as transformers' GPT2PreTrainedModel._init_weights): N(0, 0.02) for
    embeddings and projections, scaled by 1/sqrt(2 n_layer) for the two residual projections (c_proj),
    ones for LayerNorm gains, zeros for biases; drawn per parameter (src/models/init.py)."""
    std = config.initializer_range
    residual_std = std / math.sqrt(2 * config.n_layer)

    def fill(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith(".bias"):
            tensor.zero_()
        elif ".ln_" in name:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, residual_std if name.endswith("c_proj.weight") else std, generator=generator)

    return fill


def resize_vocab(model: GPT2LMHeadModel, vocab_size: int, base_seed: int) -> None:
    """Embeddings resized for added special tokens; the new rows are drawn from base_seed, so every rank
    and every build path gets the same, and the global RNG is left alone."""
    log.info(f"Resizing the embeddings from {model.config.vocab_size} to {vocab_size} tokens")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base_seed)
        model.resize_token_embeddings(vocab_size)


def lora_config(r: int, alpha: int, dropout: float, target_modules: list[str]):
    from peft import LoraConfig

    # GPT-2's projections are transformers Conv1D layers, whose weights are stored transposed.
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                      fan_in_fan_out=True, task_type="CAUSAL_LM")


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, number of targets), in fp32.

    Labels are already shifted, the convention of all data here: labels[t] is the target of
    position t (the token after input t), -100 where there is none. A batch with no target gives
    exactly (0, 0), never NaN, so it can be added to any sum; a NaN logit still gives NaN.
    """
    logits = logits[:, -labels.shape[1] :]  # prompt tuning prepends virtual tokens to the logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


class TokenMeanLoss(Metric):
    """Σ token losses / Σ targets over all ranks: torchmetrics all-gathers the two sums, not a mean of
    means. Unlike MeanMetric it never drops NaNs (a diverged model must show NaN), and batches
    without targets add exactly 0 to both sums."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("n_targets", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
        self.loss_sum += loss_sum.detach().float()
        self.n_targets += n_targets

    def compute(self) -> torch.Tensor:
        return self.loss_sum / self.n_targets


class GPT2LitModule(LitModule):
    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
        scheduler: Optional[Callable[..., Any]] = None,
        weight_decay: float = 0.1,
        lr_scaling: str = "none",
        base_batch_size: int = 32,
        pretrained: Optional[str] = None,
        gradient_checkpointing: bool = False,
        lora: Optional[dict[str, Any]] = None,
        peft: Optional[Any] = None,
        compile: bool = False,
        attn_implementation: str = "sdpa",
        activation_function: str = "gelu",
    ) -> None:
        for key, value in (("model.n_layer", n_layer), ("model.n_head", n_head), ("model.n_embd", n_embd)):
            check_int(key, value)
        if not pretrained and n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd} does not divide into model.n_head={n_head} heads: pick "
                              "n_embd as a multiple of n_head.")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError(f"model.dropout={dropout!r} is not valid: use a probability in [0, 1).")
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        lora = dict(lora or {})
        if lora.pop("enabled", False):
            if peft is not None:
                raise ConfigError("Set either model.lora.enabled=true or model/peft=..., not both.")
            peft = lora_config(**lora)
        # Under a sharding strategy (train.py's deferred_init) the model stays on the meta device here and
        # the strategy materialises only this rank's part (see materialize); adapters are built eagerly.
        self._deferred = init.init_is_deferred() and peft is None
        self._base_seed = init.draw_base_seed()  # seeds every parameter's init (src/models/init.py)
        self._pretrained, self._attn_implementation, self._vocab_size = pretrained, attn_implementation, vocab_size
        if pretrained:  # the checkpoint's shape wins over n_layer / n_head / n_embd
            config = load_pretrained(pretrained, attn_implementation, config_only=True)
            if seq_len > config.n_positions:
                raise ConfigError(f"data.seq_len={seq_len} exceeds {pretrained}'s context of {config.n_positions}.")
            if vocab_size < config.vocab_size:
                raise ConfigError(f"The tokenizer has {vocab_size} tokens but {pretrained} was trained with "
                                  f"{config.vocab_size}: use its own tokenizer (data.tokenizer={pretrained}).")
            if self._deferred:  # rank 0 reads the weights when the strategy materialises the shards
                config.vocab_size = vocab_size
                with torch.device("meta"):
                    model = GPT2LMHeadModel(config)
            else:
                model = self._load_pretrained()
        else:
            config = GPT2Config(
                vocab_size=vocab_size, n_positions=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
                attn_implementation=attn_implementation, activation_function=activation_function,
            )
            with torch.device("meta"):  # no memory, no RNG: the values come from gpt2_fill
                model = GPT2LMHeadModel(config)
            if not self._deferred:
                init.materialize_full(model, gpt2_fill(config), self._base_seed, torch.device("cpu"))
        self.config = model.config
        self.seq_len = seq_len
        self.n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
        self._gradient_checkpointing, self._compile = gradient_checkpointing, compile
        model = self._prepare(model, compile=compile and peft is None)
        if peft is not None:  # only the adapter trains; the base weights are frozen
            from peft import get_peft_model

            virtual = getattr(peft, "num_virtual_tokens", 0) or 0  # prompt tuning prepends these to the input
            if virtual and seq_len + virtual > model.config.n_positions:
                raise ConfigError(f"data.seq_len={seq_len} + {virtual} virtual tokens exceed the model's context of "
                                 f"{model.config.n_positions}; lower data.seq_len.")

            model = get_peft_model(model, peft)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
            log.info(f"{type(peft).__name__}: {trainable:,} trainable and {frozen:,} frozen parameters")
            if compile:
                model.compile()
        # Counted now, before a strategy shards the parameters (a DeepSpeed stage-3 parameter has numel 0).
        base = model.get_base_model() if peft is not None else model
        inside = {id(p) for p in base.parameters()}
        prompt = any(p.requires_grad and id(p) not in inside for p in model.parameters())  # peft prompt / prefix
        virtual = peft.num_virtual_tokens if type(peft).__name__ == "PromptTuningConfig" else 0
        self.flop_count: FlopCount = count_gpt2(base, prompt, virtual)
        self.model = model
        self.val_metrics = torch.nn.ModuleDict({"loss": TokenMeanLoss()})
        self.test_metrics = torch.nn.ModuleDict({"loss": TokenMeanLoss()})

    def _prepare(self, model: GPT2LMHeadModel, compile: bool) -> GPT2LMHeadModel:
        model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus its warning
        if self._gradient_checkpointing:  # recompute each block's activations in backward: less memory, more compute
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compile:  # in place: parameter names (and so checkpoints) stay those of the plain model
            model.compile()
        return model

    def _load_pretrained(self) -> GPT2LMHeadModel:
        """The whole pretrained model, its embeddings resized to the tokenizer's vocabulary."""
        model = load_pretrained(self._pretrained, self._attn_implementation)
        if self._vocab_size > model.config.vocab_size:  # special tokens added to the tokenizer
            resize_vocab(model, self._vocab_size, self._base_seed)
        return model

    def materialize(self, device: torch.device, sharded: bool) -> None:
        """Give the meta-device model (deferred init) its values: sharded, after fully_shard, each rank makes
        only its shards, one parameter at a time; pretrained weights are read by rank 0 alone and broadcast."""
        if not init.has_meta(self.model):
            return
        if self._pretrained:
            rank0 = not sharded or torch.distributed.get_rank() == 0
            state = self._load_pretrained().state_dict() if rank0 else None
            if sharded:
                init.load_full_state_sharded(self.model, state, device)
            else:
                self.model.to_empty(device=device)
                self.model.tie_weights()
                self.model.load_state_dict(state)
        elif sharded:
            init.materialize_sharded(self.model, gpt2_fill(self.config), self._base_seed, device)
        else:
            init.materialize_full(self.model, gpt2_fill(self.config), self._base_seed, device)

    def configure_model(self) -> None:
        """Deferred init (FSDP2Strategy instead calls `materialize` after fully_shard). Under DeepSpeed ZeRO-3
        Lightning runs this hook inside deepspeed.zero.Init: the model is built again there, each parameter
        partitioned as its module is made, then filled one gathered parameter at a time. Elsewhere the whole
        model is materialised here."""
        strategy = self.trainer.strategy
        if not init.has_meta(self.model) or getattr(strategy, "materializes_shards", False):
            return
        if getattr(strategy, "zero_stage_3", False) and not self._pretrained:
            model = GPT2LMHeadModel(self.config)
            init.materialize_zero3(model, gpt2_fill(self.config), self._base_seed)
            self.model = self._prepare(model, compile=self._compile)
        else:
            self.materialize(torch.device("cpu"), sharded=False)

    @property
    def hf_model(self) -> GPT2LMHeadModel:
        """The GPT2LMHeadModel itself, also when a peft adapter wraps it."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def network(self) -> torch.nn.Module:
        return self.model

    def blocks(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
        layers = self.hf_model.transformer.h
        return [(layers, str(i), block) for i, block in enumerate(layers)]

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token of a full seq_len sequence; the convention is in src/models/flops.py."""
        return self.flop_count.per_token + self.flop_count.per_context * self.seq_len

    def flops_of_batch(self, batch: dict) -> torch.Tensor:
        """Read by the throughput callback for FLOP/s and MFU: the batch's real tokens only."""
        return self.flop_count.of_batch(batch)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        """The model's output; with `labels` (already shifted, see summed_token_loss) its `.loss` is their
        token mean. Training normalises differently: by the whole optimizer step's targets."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        if labels is not None:
            loss_sum, n_targets = summed_token_loss(out.logits, labels)
            out.loss = loss_sum / n_targets
        return out

    def _loss_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the batch's token losses, number of targets)."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                            **self._cache_kwargs()).logits
        return summed_token_loss(logits, batch["labels"])

    def _cache_kwargs(self) -> dict[str, bool]:
        """No KV cache on a CPU: transformers fills one in every forward, training too (GPT2Config.use_cache),
        a copy of each layer's keys and values that nothing reads: 1-3% of a step's wall time on a 2-core CPU
        (docs/performance.md). Without it transformers checks the position ids for packed sequences instead
        (masking_utils.find_packed_sequence_indices): a host sync per forward on an accelerator, and under
        torch.compile, which cannot read the check's result, a full attention mask. So there the cache stays."""
        return {"use_cache": False} if self.device.type == "cpu" and not self._compile else {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.token_mean_loss(*self._loss_and_count(batch), batch_idx)
        self.log_train_loss(loss, batch_idx)
        return self.loss_for_backward(loss)

    def train_metrics(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"train/loss": loss, "train/ppl": torch.exp(loss)}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_metrics["loss"].update(*self._loss_and_count(batch))

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.test_metrics["loss"].update(*self._loss_and_count(batch))

    def _log_epoch(self, stage: str, metrics: torch.nn.ModuleDict) -> None:
        loss = self.log_epoch_metrics(stage, metrics)[f"{stage}/loss"]
        self.log(f"{stage}/ppl", torch.exp(loss), prog_bar=stage == "val")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_metrics)
