"""Any Hugging Face decoder-only language model as a LightningModule: `AutoModelForCausalLM` built from a model
type and config fields (`model=llama`, `model=qwen2`, `model=mistral`) or loaded pretrained
(`model=causal_lm model.pretrained=DIR`); optionally with LoRA or another peft adapter, gradient
checkpointing and torch.compile. GPT-2 (`model=gpt2`) is one instance of it (src/models/gpt2.py).

The model knows nothing about ranks: strategies shard it from outside, over `blocks()`.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from src.models import chunked_loss, hf, init, padded_vocab
from src.models import dropout as keyed
from src.models.base import LitModule
from src.models.flops import FlopCount, count_flops
from src.objectives import moe
from src.objectives.base import Objective
from src.objectives.loss import run_logits, summed_token_loss, token_loss_function
from src.objectives.sft import SFT
from src.parallel import capabilities, compiled_attention
from src.parallel.parallelize import check_compile_mode, compile_region, parallelize, parallelized
from src.utils.config import ArchitectureRefused, ConfigError, check_number
from src.utils.labels import IGNORE_INDEX

log = logging.getLogger(__name__)


def check_choices(
    model_type: Optional[str], pretrained: Optional[str], size_for: Optional[str], objective: Any, lora: bool, peft: Any
) -> None:
    """One sentence for a combination of model options that cannot work."""
    if size_for and not pretrained and size_for != model_type:  # set by a model/size preset (conf/model/size/)
        raise ConfigError(
            f"The model/size preset is a {size_for} shape and this is model={model_type}: use "
            f"model={size_for} with it, or a {model_type} size (conf/model/size/)."
        )
    if not isinstance(objective, Objective):  # model.objective=dpo (before objectives were a config group)
        raise ConfigError(
            f"model.objective={objective!r} is not an objective: choose one with model/objective=sft|dpo|reward|grpo "
            "(conf/model/objective/) and set its options as model.objective.<option>."
        )
    if lora and peft is not None:
        raise ConfigError("Set either model.lora.enabled=true or model/peft=..., not both.")
    if not pretrained and not model_type:
        raise ConfigError(
            "model.model_type is not set: name an architecture (model=llama, model=qwen2, ...) "
            "or load one with model.pretrained=DIR_OR_HUB_NAME."
        )


def check_loss_chunk(chunk: Any, objective: Objective, compile: Any) -> Optional[int]:
    """model.loss_chunk: null, or a number of tokens for an objective that trains on the token loss, the network not
    compiled whole."""
    if chunk is None:
        return None
    check_number("model.loss_chunk", chunk, lambda v: v >= 1, "a number of tokens >= 1, or null for the plain loss",
                 integer=True)  # fmt: skip
    if not objective.trains_token_loss:
        raise ConfigError(
            f"model.loss_chunk={chunk}: model/objective={objective.name} reads the model's logits itself, not the "
            "token loss; set model.loss_chunk=null."
        )
    if compile is True:
        raise ConfigError(
            f"model.loss_chunk={chunk} with model.compile=true: a network compiled whole would trace its head's "
            "chunks and the backward each takes inside the forward; set model.compile=blocks (each chunk's loss is "
            "compiled by model.compile_loss) or model.loss_chunk=null."
        )
    return chunk


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


def flops_of(model: torch.nn.Module, peft: Any) -> FlopCount:
    """FLOPs per token, counted before a strategy shards the parameters (a ZeRO-3 parameter has numel 0)."""
    base = model.get_base_model() if peft is not None else model
    inside = {id(p) for p in base.parameters()}
    prompt = any(p.requires_grad and id(p) not in inside for p in model.parameters())  # peft prompt / prefix
    virtual = peft.num_virtual_tokens if type(peft).__name__ == "PromptTuningConfig" else 0
    return count_flops(base, hf.decoder_layers(base), prompt, virtual)


class CausalLMLitModule(LitModule):
    exact_by_itself = (
        True  # dropout keyed by each row's sample (row_keys), attention's too; metrics updated, not forward
    )

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        model_type: Optional[str] = None,
        config: Optional[dict[str, Any]] = None,
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
        compile_mode: Optional[str] = None,
        attn_implementation: str = "auto",
        resize_embeddings: bool = False,
        tokenizer: Optional[str] = None,
        objective: Optional[Objective] = None,
        size_for: Optional[str] = None,
        compile_loss: Any = "auto",
        fastest_attention: str = "sdpa",
        router_aux_loss: bool = True,
        dropout: Optional[float] = None,
        loss_chunk: Optional[int] = None,
        pad_vocab_multiple: Optional[int] = None,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        lora = dict(lora or {})
        use_lora = bool(lora.pop("enabled", False))
        objective = SFT() if objective is None else objective
        check_choices(model_type, pretrained, size_for, objective, use_lora, peft)
        self.objective = objective  # what the step optimises (src/objectives/base.py)
        adapter = use_lora or peft is not None
        # Under a sharding strategy (train.py's deferred_init) the model stays on the meta device here and
        # the strategy materialises only this rank's part (see materialize); adapters are built eagerly.
        self._deferred = init.init_is_deferred() and not adapter
        self.base_seed = init.draw_base_seed()  # seeds every parameter's init (src/models/init.py)
        kind = hf.pretrained_config(pretrained).model_type if pretrained else model_type
        self.attn_implementation = hf.choose_attention(kind, attn_implementation, fastest_attention)
        self._pretrained, self._vocab_size = pretrained, vocab_size
        self._resize_embeddings, self._tokenizer = resize_embeddings, tokenizer
        self._gradient_checkpointing, self._compile = gradient_checkpointing, compile  # src/parallel/parallelize.py
        token_loss_function(compile_loss, 0, torch.device("cpu"))  # a bad value fails here, not at the first step
        compile_region(compile, whole_model=True)  # likewise model.compile, not once the ranks have started
        check_compile_mode(compile_mode, compile)
        self._compile_mode = compile_mode
        self._compile_loss, self._token_loss = compile_loss, None  # the loss function, chosen at its first call
        self._loss_chunk = check_loss_chunk(loss_chunk, objective, compile)
        self._head_checked = False  # model.loss_chunk's probe (chunked_loss.check_head), once, before the first step
        if dropout is not None:
            check_number("model.dropout", dropout, lambda v: 0 <= v < 1, "a probability in [0, 1), or null")
        self._dropout = dropout
        self._pad_vocab = check_pad_vocab(pad_vocab_multiple, pretrained, loss_chunk)
        # the tokenizer's vocabulary where model.pad_vocab_multiple pads the model's (what export-hf writes), else None
        self.unpadded_vocab = vocab_size if padded_vocab.padded(vocab_size, self._pad_vocab) != vocab_size else None
        self._padding_checked = False
        # plain lists and dicts: transformers' config validation rejects OmegaConf's (e.g. layer_types=[...])
        fields = OmegaConf.to_container(config) if isinstance(config, DictConfig) else dict(config or {})
        model = self._build(seq_len, model_type, fields)
        self.config: PretrainedConfig = model.config
        self.seq_len = seq_len
        self.reference = self._reference_of(model, adapter)
        self.n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
        model = self._prepare(model)
        if use_lora:
            peft = hf.lora_config(**lora, model=model)
        if peft is not None:
            model = self._add_adapter(model, peft, seq_len)
        self.dropouts = self._key_dropout(model)  # its dropouts with p > 0, keyed per sample
        self.flop_count: FlopCount = flops_of(model, peft)
        self.model = model
        # an MoE model's load-balancing loss (src/objectives/moe.py), read before a strategy wraps the model's class
        self.router_balance = moe.balance_loss_function(self.hf_model) if router_aux_loss else None
        objective.check(self)
        if self.router_balance is not None and not objective.adds_router_loss:
            raise ConfigError(
                f"model/objective={objective.name} does not add {type(self.hf_model).__name__}'s router "
                f"load-balancing loss: set model.router_aux_loss=false to train the {objective.name} loss alone."
            )

    def _build(self, seq_len: int, model_type: Optional[str], fields: dict[str, Any]) -> PreTrainedModel:
        """The transformers model: pretrained (the checkpoint's shape wins over the config fields) or from a
        config; on the meta device when a strategy materialises it later."""
        if self._pretrained:
            config = self.check_pretrained(hf.pretrained_config(self._pretrained, self.attn_implementation), seq_len)
            self._set_dropout(config)
            if not self._deferred:
                return self._set_dropout(self._load_pretrained(config))
            config.vocab_size = max(self._vocab_size, config.vocab_size)  # rank 0 reads the weights later
            return self._set_dropout(hf.build_on_meta(config))
        config = self.new_config(self._vocab_size, seq_len, model_type, fields, self.attn_implementation)
        model = self._set_dropout(hf.build_on_meta(self._set_dropout(config)))
        if not self._deferred:
            init.materialize_full(model, self.fill(model), self.base_seed, torch.device("cpu"))
        return model

    def _key_dropout(self, model: torch.nn.Module) -> int:
        """Every dropout of `model` keyed per sample (src/models/dropout.py): its dropout modules, and where its config
        holds a dropout probability, its attention's; the number of dropouts with p > 0 (modules or attention)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        functional = 0
        if any(keyed.config_fields(base.config).values()):  # the forward may draw dropout itself
            functional = keyed.key_attention(base, self.attn_implementation) + keyed.key_functional_dropouts(base)
        return keyed.key_dropouts(model) + functional

    def _set_dropout(self, built: Any) -> Any:
        """model.dropout (when set) in a config, before its model is built, or in a built model's dropout modules:
        every dropout probability of the architecture (its adapter's is model.lora.dropout)."""
        if self._dropout is not None:
            if isinstance(built, PretrainedConfig):
                keyed.set_probabilities(built, self._dropout)
            for module in built.modules() if isinstance(built, torch.nn.Module) else ():
                if isinstance(module, torch.nn.Dropout):
                    module.p = self._dropout
        return built

    def _reference_of(self, model: PreTrainedModel, adapter: bool) -> Optional[PreTrainedModel]:
        """A frozen copy of the starting policy where the objective asks for one (DPO's reference)."""
        if not self.objective.needs_reference(adapter):
            return None
        # Lightning warns of modules in eval mode at the start of fit: the reference's are, on purpose
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=PossibleUserWarning)
        return init.frozen(copy.deepcopy(model))

    # ---- what an architecture may decide (src/models/gpt2.py overrides these) ----

    def new_config(
        self, vocab_size: int, seq_len: int, model_type: str, fields: dict[str, Any], attn_implementation: str
    ) -> PretrainedConfig:
        """A config built from `model.model_type` and `model.config` (any field of that architecture's config);
        the vocabulary comes from the tokenizer and the context from data.seq_len unless the fields set it."""
        fields = {
            "max_position_embeddings": seq_len,
            "bos_token_id": vocab_size - 1,
            "eos_token_id": vocab_size - 1,
            **fields,
            "vocab_size": padded_vocab.padded(vocab_size, self._pad_vocab),  # rows never scored: padded_vocab.py
        }
        config = hf.new_config(model_type, attn_implementation, **fields)
        if seq_len > hf.context_length(config):
            raise ConfigError(
                f"data.seq_len={seq_len} exceeds model.config.max_position_embeddings="
                f"{hf.context_length(config)}: raise it or lower data.seq_len."
            )
        return config

    def check_pretrained(self, config: PretrainedConfig, seq_len: int) -> PretrainedConfig:
        """One sentence for a pretrained model that cannot take this data."""
        if seq_len > hf.context_length(config):
            raise ConfigError(
                f"data.seq_len={seq_len} exceeds {self._pretrained}'s context of {hf.context_length(config)}."
            )
        if self._vocab_size < config.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self._vocab_size} tokens but {self._pretrained} was trained with "
                f"{config.vocab_size}: use its own tokenizer (data.tokenizer={self._pretrained})."
            )
        if self._vocab_size > config.vocab_size and not self._resize_embeddings:
            raise ConfigError(
                f"The tokenizer has {self._vocab_size} tokens and {self._pretrained}'s embeddings "
                f"{config.vocab_size}: set model.resize_embeddings=true to add rows for the new tokens, "
                f"or use the model's own tokenizer (data.tokenizer={self._pretrained})."
            )
        return config

    def fill(self, model: torch.nn.Module) -> init.Fill:
        """Initial values of a model built from a config (src/models/init.py): the architecture's own rule
        (hf.architecture_fill); what the architecture does not hold (a reward head) transformers' default rule at
        the config's standard deviation (`initializer_range`; OPT names it `init_std`)."""
        config = model.config
        key = config.to_json_string()
        if getattr(self, "_fill", (None,))[0] != key:  # one meta copy per config, made in __init__ (outside any
            # strategy's context: DeepSpeed's zero.Init would partition the copy's parameters too)
            std = getattr(config, "initializer_range", None) or getattr(config, "init_std", None) or 0.02
            self._fill = (key, hf.architecture_fill(model, hf.standard_fill(model, std)))
        return self._fill[1]

    # ---- building ----

    @torch.no_grad()
    def _prepare(self, model: PreTrainedModel) -> PreTrainedModel:
        """What the objective changes in the model; a parameter it adds gets the value src/models/init.py gives it
        on any layout (on meta or partitioned by ZeRO-3, it is filled with the others when materialised)."""
        model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus its warning
        self._mask_padding(model)
        self._added = self.objective.prepare(model)
        fill = self.fill(model)
        for name in self._added:
            param = model.get_parameter(name)
            if not param.is_meta and not hasattr(param, "ds_shape"):
                param.copy_(init.full_value(fill, self.base_seed, name, param.shape))
        return model

    def _mask_padding(self, model: PreTrainedModel) -> None:
        """model.pad_vocab_multiple: the padded columns of `model`'s head output at the dtype's minimum."""
        if self.unpadded_vocab is not None:
            padded_vocab.mask_padding(model.get_output_embeddings(), self.unpadded_vocab)

    def _add_adapter(self, model: PreTrainedModel, peft: Any, seq_len: int) -> torch.nn.Module:
        """Only the adapter trains; the base weights are frozen."""
        from peft import get_peft_model

        virtual = getattr(peft, "num_virtual_tokens", 0) or 0  # prompt tuning prepends these to the input
        if virtual and seq_len + virtual > hf.context_length(model.config):
            raise ConfigError(
                f"data.seq_len={seq_len} + {virtual} virtual tokens exceed the model's context of "
                f"{hf.context_length(model.config)}; lower data.seq_len."
            )
        model = get_peft_model(model, peft)
        for name in self._added:  # what the objective added (a reward head) is new: it trains
            model.get_base_model().get_parameter(name).requires_grad_(True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        log.info(f"{type(peft).__name__}: {trainable:,} trainable and {frozen:,} frozen parameters")
        return model

    def _load_pretrained(self, config: Optional[PretrainedConfig] = None) -> PreTrainedModel:
        """The whole pretrained model (with `config`, that instead of the checkpoint's: model.dropout), its embeddings
        resized to the tokenizer's vocabulary."""
        model = hf.load_pretrained(self._pretrained, self.attn_implementation, config)
        if self._vocab_size > model.config.vocab_size:  # special tokens added to the tokenizer
            hf.resize_vocab(model, self._vocab_size, self.base_seed, self._tokenizer)
        return model

    def materialize(self, device: torch.device, sharded: bool) -> None:
        """Give the meta-device model (deferred init) its values: sharded, after fully_shard, each rank makes
        only its shards, one parameter at a time; pretrained weights are read by rank 0 alone and broadcast."""
        if not init.has_meta(self.model):
            return
        state = None
        if self._pretrained and (not sharded or torch.distributed.get_rank() == 0):
            state = self._prepare(self._load_pretrained()).state_dict()
        for network in self.networks():  # the policy, and a reference: the same starting values
            if self._pretrained and sharded:
                init.load_full_state_sharded(network, state, device)
            elif self._pretrained:
                init.allocate(network, device)
                network.load_state_dict(state)
            elif sharded:
                init.materialize_sharded(network, self.fill(network), self.base_seed, device)
            else:
                init.materialize_full(network, self.fill(network), self.base_seed, device)

    def configure_model(self) -> None:
        """Deferred init (the FSDP2 strategy instead calls `materialize` after fully_shard). Under DeepSpeed ZeRO-3
        Lightning runs this hook inside deepspeed.zero.Init: the model is built again there, each parameter
        partitioned as its module is made, then filled one gathered parameter at a time. Elsewhere the whole
        model is materialised here. Then, where the strategy does not call src/parallel/parallelize.py itself
        (DDP, one device, DeepSpeed), that function's per-block activation checkpointing and compile."""
        strategy = capabilities.of(self.trainer.strategy)
        if init.has_meta(self.model) and not strategy.materializes_shards:
            self._materialize_here(strategy)
        if not strategy.parallelizes and not parallelized(self):  # DDP, one device, DeepSpeed
            # no mesh: activation checkpointing and compile (each whole network; per block under ZeRO-3's hooks)
            parallelize(self, **self.wrappers(), whole_model=not strategy.zero_stage_3)

    def _materialize_here(self, strategy: Any) -> None:
        if strategy.zero_stage_3 and not self._pretrained:
            from transformers.initialization import no_init_weights

            for name in ("model", "reference") if self.reference is not None else ("model",):
                # transformers' own init would run on the partitioned (empty) parameters: it cannot (OLMoE's and
                # Gemma's padding row: IndexError) and is overwritten below; buffers keep what __init__ computes.
                # Skipping it skips its tie_weights too: tied here (DPO's reference: the same, partitioned alike)
                with no_init_weights():
                    model = AutoModelForCausalLM.from_config(self.config)
                model.tie_weights()
                if name == "model":  # what the objective adds is filled below
                    self.dropouts = self._key_dropout(self._prepare(self._set_dropout(model)))
                else:  # built with the keyed attention and the padding's mask, as the model
                    self._mask_padding(model)
                    if any(keyed.config_fields(model.config).values()):
                        keyed.key_attention(model, self.attn_implementation)
                init.materialize_zero3(model, self.fill(model), self.base_seed)
                setattr(self, name, model if name == "model" else init.frozen(model))
        else:
            self.materialize(torch.device("cpu"), sharded=False)

    # ---- what strategies, callbacks and tools read ----

    def wrappers(self) -> dict[str, Any]:
        return {
            "activation_checkpointing": self._gradient_checkpointing,
            "compile": self._compile,
            "compile_mode": self._compile_mode,
        }

    @property
    def hf_model(self) -> PreTrainedModel:
        """The transformers model itself, also when a peft adapter wraps it."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def network(self) -> torch.nn.Module:
        return self.model

    def networks(self) -> list[torch.nn.Module]:
        return [self.model] if self.reference is None else [self.model, self.reference]

    def blocks(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
        hf_models = [self.hf_model] + ([self.reference] if self.reference is not None else [])
        return [
            (layers, str(i), block) for layers in map(hf.decoder_layers, hf_models) for i, block in enumerate(layers)
        ]

    def train(self, mode: bool = True) -> "CausalLMLitModule":
        super().train(mode)
        if self.reference is not None:  # the reference policy never trains: no dropout, ever
            self.reference.eval()
        return self

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token of a full seq_len sequence; the convention is in src/models/flops.py."""
        return self.flop_count.per_token + self.flop_count.per_context * self.seq_len

    def flops_of_batch(self, batch: dict) -> torch.Tensor:
        """Read by the throughput callback for FLOP/s and MFU: the batch's real tokens only."""
        return self.flop_count.of_batch(batch)

    # ---- steps ----

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """summed_token_loss, compiled or not as model.compile_loss says (src/objectives/loss.py); also what the
        pipeline schedule computes on its last stage."""
        return self._loss_function()(logits, labels)

    def _loss_function(self) -> Callable:
        """summed_token_loss, or its compiled form: chosen at the first call (model.compile_loss), when the device
        and the run's length are known; under model.loss_chunk, what each chunk's logits go through."""
        if self._token_loss is None:
            in_run = run_logits(self._trainer_or_none(), self.seq_len, self.config.vocab_size)
            self._token_loss = token_loss_function(self._compile_loss, in_run, self.device, bool(self._compile))
            chunks = f", {self._loss_chunk} tokens at a time (model.loss_chunk)" if self._loss_chunk else ""
            log.info(
                f"Token loss: {'compiled' if self._token_loss is not summed_token_loss else 'eager'} "
                f"(model.compile_loss={str(self._compile_loss).lower()}){chunks}"
            )
        return self._token_loss

    def forward_loss(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(the model's output, sum of the batch's token losses, number of targets): lm_forward and token_loss, or
        under model.loss_chunk=N the same sums from the head's input, N tokens at a time, the logits of every token
        never made (src/models/chunked_loss.py; the output's `logits` then None)."""
        if self._loss_chunk is None:
            out = self.lm_forward(batch, **kwargs)
            return out, *self.token_loss(out.logits, batch["labels"])
        self.check_head()  # a module used on its own (not by a Trainer) has had no on_fit_start
        labels, head = batch["labels"], chunked_loss.output_head(self.hf_model, self._loss_chunk)
        with chunked_loss.head_computes_loss(head, labels, self._loss_chunk, self._loss_function()):
            out = self.lm_forward(batch, **kwargs)
        loss_sum, out.logits = out.logits, None
        return out, loss_sum, (labels != IGNORE_INDEX).sum()

    def check_head(self) -> None:
        """model.loss_chunk: once, before the first step, on every rank alike, the probe that the model's logits are
        its head's output and its head maps each token alone (chunked_loss.check_head), or one sentence."""
        if self._loss_chunk is None or self._head_checked:
            return
        was_training = self.training
        self.eval()
        try:
            with torch.compiler.set_stance("force_eager"):  # model.compile's graphs are for the run's shapes
                chunked_loss.check_head(
                    self.hf_model, self.lm_forward, self._loss_chunk, self._loss_function(), self._vocab_size,
                    self.device,
                )  # fmt: skip
        finally:
            self.train(was_training)
        self._head_checked = True

    def _trainer_or_none(self) -> Optional[Any]:
        try:
            return self.trainer
        except RuntimeError:  # the module used on its own (not attached to a Trainer)
            return None

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ):
        """The model's output; with `labels` (already shifted, see summed_token_loss) its `.loss` is their
        token mean. Training normalises differently: by the whole optimizer step's targets."""
        out = self.lm_forward(
            {"input_ids": input_ids, **({} if attention_mask is None else {"attention_mask": attention_mask})}
        )
        if labels is not None:
            loss_sum, n_targets = self.token_loss(out.logits, labels)
            out.loss = loss_sum / n_targets
        return out

    def lm_forward(self, batch: dict[str, torch.Tensor], network: Optional[torch.nn.Module] = None, **kwargs: Any):
        """A training or evaluation forward of `network` (the trained model by default; or the reference) on a batch's
        input ids with its attention mask, or a packed batch's position ids (src/datamodules/packing.py: no mask,
        so transformers keeps its records apart). Never a KV cache, on any device: a cache serves generation, and in
        any other forward transformers would fill one that nothing reads (torch.compile recompiling on it).
        A training forward of the trained model keys its dropout masks by the batch's sample indices
        (src/models/dropout.py)."""
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}
        if self.dropouts and self.training and (network is None or network is self.model):
            keyed.set_keys(self.row_keys(batch))
        network = network if network is not None else self.model
        with compiled_attention.plain_causal(network, inputs):  # a whole compiled network's SDPA told is_causal
            return network(**inputs, use_cache=False, **kwargs)

    def row_keys(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dropout keys of a training batch's rows: the run's seed, the optimizer step and each row's sample."""
        rows = batch["input_ids"].shape[0]
        index = batch.get("sample_index")
        if index is None or rows % index.numel():
            raise ConfigError(
                f"{type(self.hf_model).__name__} has dropout and this batch does not say which sample each row is "
                f"(the data's train loader gives `sample_index`; {self.objective.name}'s rows are its own): "
                "set model.dropout=0."
            )
        step = self.trainer.global_step if self._trainer_or_none() is not None else 0
        return keyed.row_keys(index.to(batch["input_ids"].device), rows, step, self.base_seed)

    @torch.no_grad()
    def check_dropout(self) -> None:
        """Before step 1, on every rank alike: a training forward draws nothing from torch's generator (two forwards
        under different generator states give the same logits), or the run stops in one sentence. Its dropout modules
        are keyed per sample (src/models/dropout.py); what a forward draws itself (functional attention dropout,
        router jitter) would give each layout other masks. Under a strategy that splits a row's forward (tensor
        parallel, pipeline stages: `keys_dropout` false) any dropout is refused."""
        fields = {k: v for k, v in keyed.config_fields(self.config).items() if v}
        if not capabilities.of(self.trainer.strategy).keys_dropout:
            if keyed.has_dropout(self.model) or fields:
                raise ArchitectureRefused(
                    f"{type(self.hf_model).__name__} has dropout ({self._dropout_names(fields)}), which "
                    f"{type(self.trainer.strategy).__name__} would draw per rank: {self._dropout_fix(fields)}."
                )
            return
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self._vocab_size, (1, 8), generator=generator).to(self.device)
        batch = {"input_ids": ids, "sample_index": torch.zeros(1, dtype=torch.long)}
        was_training, outs = self.training, []
        gpus = [self.device] if self.device.type == "cuda" else []  # the generators the probe must not advance
        self.train()
        with torch.compiler.set_stance("force_eager"), torch.random.fork_rng(devices=gpus):
            for seed in (1, 2):
                torch.manual_seed(seed)
                outs.append(self.lm_forward(batch).logits.float())
        self.train(was_training)
        fp32 = next(self.model.parameters()).dtype == torch.float32
        gap, scale = (outs[0] - outs[1]).abs().max().item(), outs[0].abs().max().item()
        if not gap <= (1e-4 if fp32 else 3e-2) * scale + 1e-6:
            raise ArchitectureRefused(
                f"{type(self.hf_model).__name__}'s training forward draws random numbers of its own "
                f"({self._dropout_names(fields)}; logits {gap:.3g} apart under two generator states), which would "
                f"differ with the number of devices: {self._dropout_fix(fields)}."
            )

    @torch.no_grad()
    def check_padding(self) -> None:
        """model.pad_vocab_multiple: once, before step 1, on every rank alike, a probe forward's padded columns are at
        the minimum (the model does not scale or cap its head's output), or one sentence."""
        if self.unpadded_vocab is None or self._padding_checked:
            return
        trainer = self._trainer_or_none()  # the pipeline's stages (no whole forward) are refused by src/run/checks.py
        if trainer is not None and not capabilities.of(trainer.strategy).can_generate:
            return
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                ids = torch.zeros(1, 8, dtype=torch.long, device=self.device)
                logits = self.lm_forward({"input_ids": ids}).logits
            padded_vocab.check_masked(logits, self.unpadded_vocab, type(self.hf_model).__name__, self._pad_vocab)
        finally:
            self.train(was_training)
        self._padding_checked = True

    def check_router(self) -> None:
        """Before step 1, where each rank runs the whole model: an MoE model whose load-balancing loss is trained
        returns its router logits from a forward with output_router_logits=True, or the run stops in one sentence
        (flint's forward fails so at a small size, inside transformers' own loss)."""
        if self.router_balance is None or not capabilities.of(self.trainer.strategy).keys_dropout:
            return
        ids = torch.zeros(1, 8, dtype=torch.long, device=self.device)
        was_training = self.training
        self.eval()
        try:
            with torch.compiler.set_stance("force_eager"):
                logits = self.lm_forward({"input_ids": ids}, output_router_logits=True).router_logits
            problem = None if logits else "returns no router logits"
        except Exception as error:  # noqa: BLE001 - any failure of that forward is the refusal, said
            problem = f"fails ({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]})"
        finally:
            self.train(was_training)
        if problem:
            raise ArchitectureRefused(
                f"{type(self.hf_model).__name__}'s forward with output_router_logits=True {problem}, and its router "
                "load-balancing loss reads them: set model.router_aux_loss=false."
            )

    def _dropout_fix(self, fields: dict[str, float]) -> str:
        """What turns off every random draw named in a refusal: model.dropout, the config's other random fields (router
        jitter: model.config.X), LoRA's dropout."""
        fix = []
        probabilities = [k for k in fields if keyed.PROBABILITY_FIELD.search(k)]
        if probabilities or not fields:
            fix.append("model.dropout=0")
        fix += [f"model.config.{k}=0" for k in fields if not keyed.PROBABILITY_FIELD.search(k)]
        if any(isinstance(m, keyed.KeyedDropout) and m.p > 0 and "lora_" in m.name for m in self.model.modules()):
            fix.append("model.lora.dropout=0")
        return "set " + " and ".join(fix)

    def _dropout_names(self, fields: dict[str, float]) -> str:
        named = [f"{k}={v}" for k, v in fields.items()]
        return ", ".join(named) if named else "its dropout modules"

    @torch.no_grad()
    def check_packing(self) -> None:
        """data.packing=true: before step 1, on every rank alike, two random records packed in one row give the
        logits each gives alone, or the run stops in one sentence (a model whose forward ignores the position ids'
        boundaries would let packed conversations see each other)."""
        if self.router_balance is not None:
            raise ConfigError(
                "data.packing=true and a mixture-of-experts router loss: the load-balancing loss is taken per row, "
                "which would mix packed conversations; set model.router_aux_loss=false or data.packing=false."
            )
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randint(0, self._vocab_size, (1, n), generator=generator).to(self.device) for n in (6, 5))
        positions = torch.cat([torch.arange(6), torch.arange(5)])[None].to(self.device)
        was_training = self.training
        self.eval()
        with torch.compiler.set_stance("force_eager"):  # model.compile's graphs are for the run's shapes
            packed = self.lm_forward({"input_ids": torch.cat([a, b], 1), "position_ids": positions}).logits.float()
            alone = torch.cat([self.lm_forward({"input_ids": x}).logits.float() for x in (a, b)], 1)
        self.train(was_training)
        fp32 = next(self.model.parameters()).dtype == torch.float32
        gap, scale = (packed - alone).abs().max().item(), alone.abs().max().item()
        if not gap <= (1e-4 if fp32 else 3e-2) * scale + 1e-6:
            raise ConfigError(
                f"data.packing=true: {self.config.model_type}'s forward ({self.attn_implementation} attention) lets "
                f"packed conversations see each other (packed logits {gap:.3g} apart from each alone): set "
                "data.packing=false, or another model.attn_implementation."
            )

    def loss_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the batch's token losses, number of targets)."""
        return self.forward_loss(batch)[1:]

    # ---- the objective's (src/objectives/base.py) ----

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss_for_backward(self.objective.training_step(self, batch, batch_idx))

    def train_metrics(self, loss: torch.Tensor, sums: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        return self.objective.train_metrics(loss, sums)

    @property
    def val_metrics(self) -> torch.nn.ModuleDict:
        return self.objective.val_metrics

    @property
    def test_metrics(self) -> torch.nn.ModuleDict:
        return self.objective.test_metrics

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.objective.evaluation_step(self, batch, self.val_metrics)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.objective.evaluation_step(self, batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.objective.epoch_metrics("val", self.val_metrics), prog_bar=True, sync_dist=False)

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.objective.epoch_metrics("test", self.test_metrics), sync_dist=False)

    def on_fit_start(self) -> None:
        self.check_dropout()
        self.check_router()
        self.check_padding()
        self.check_head()
        if getattr(self.trainer.datamodule, "packing", False):
            self.check_packing()
        self.objective.on_fit_start(self)

    def on_validation_start(self) -> None:
        self.check_head()  # eval.py: no on_fit_start

    def on_test_start(self) -> None:
        self.check_head()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.objective.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.objective.on_load_checkpoint(checkpoint)
