"""Any Hugging Face decoder-only language model as a LightningModule: `AutoModelForCausalLM` built from a model type
and config fields (`model=llama`, `qwen2`, `mistral`) or loaded pretrained (`model=causal_lm model.pretrained=DIR`).
GPT-2 (`model=gpt2`) is one instance of it (src/lm/models/gpt2_module.py).

The module composes three things. Its model spec (src/lm/models/spec.py) builds the model and gives it its initial
values. Its objective (src/lm/objectives/) says what a step optimises. Its features each own their option, their probe
before step 1 (src/core/probe.py) and their refusals: keyed dropout (src/core/dropout.py), and in src/lm/features/
adapters (peft_adapters.py, bottleneck.py), frozen parts (frozen.py), the MoE router loss (router.py), the chunked loss
(chunked_loss.py), the padded vocabulary (padded_vocab.py), compile and checkpointing (compiling.py), packing.py.

The module knows nothing about ranks: strategies shard it from outside, over `blocks()`, and have the spec materialise
each rank's share; where a strategy does not parallelize it (DDP, 1 device, DeepSpeed), configure_model asks
src/parallel/parallelize.py for activation checkpointing and compile.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from transformers import PretrainedConfig, PreTrainedModel

from src.core import dropout as keyed
from src.core.module import LitModule
from src.lm import hf, init, options
from src.lm.features import chunked_loss, compiling, frozen, packing, padded_vocab, peft_adapters, router
from src.lm.features.dropout import check_draws, key_model, keys_of
from src.lm.features.flops import FlopCount
from src.lm.models.spec import ModelSpec
from src.lm.objectives import sft
from src.lm.objectives.base import Objective
from src.parallel import capabilities, compiled_attention
from src.parallel.parallelize import parallelize, parallelized


class CausalLMLitModule(LitModule):
    exact_by_itself = True  # dropout keyed by each row's sample (keys_of), metrics updated, not forward
    spec_type = ModelSpec  # how the model is built: an architecture with its own rules subclasses it (gpt2_module.py)

    def __init__(  # the flat model.* keys (conf/model/causal_lm.yaml) in their groups; src/utils/config.py reads them
        self, vocab_size: int, seq_len: int, model_type: Optional[str] = None, config: Optional[dict[str, Any]] = None,
        objective: Optional[Objective] = None,
        # what the model is: options.Architecture
        pretrained: Optional[str] = None, attn_implementation: str = "auto", fastest_attention: str = "sdpa",
        size_for: Optional[str] = None, dropout: Optional[float] = None,
        # its vocabulary: options.Vocabulary
        tokenizer: Optional[str] = None, resize_embeddings: bool = False, pad_vocab_multiple: Optional[int] = None,
        # compiling: options.Compile
        compile: bool = False, compile_mode: Optional[str] = None, compile_loss: Any = "auto",
        gradient_checkpointing: bool = False,
        # what trains: options.Adapters; the loss: options.Loss
        lora: Optional[dict[str, Any]] = None, peft: Optional[Any] = None, freeze: Optional[Any] = None,
        loss_chunk: Optional[int] = None, router_aux_loss: bool = True,
        # the optimizer: src/core/module.py
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None, weight_decay: float = 0.1,
        scheduler: Optional[Callable[..., Any]] = None, lr_scaling: str = "none", base_batch_size: int = 32,
    ) -> None:  # fmt: skip
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        self.objective = objective = sft.chosen(objective)  # what the step optimises
        architecture = options.Architecture(model_type=model_type, fields=config, pretrained=pretrained,
                                            size_for=size_for, dropout=dropout, attn_implementation=attn_implementation,
                                            fastest_attention=fastest_attention)  # fmt: skip
        adapters = options.Adapters(lora=lora, peft=peft, freeze=freeze)
        compile_options = options.Compile(compile=compile, mode=compile_mode, loss=compile_loss,
                                          gradient_checkpointing=gradient_checkpointing)  # fmt: skip
        loss = options.Loss(chunk=loss_chunk, router_aux_loss=router_aux_loss)
        vocabulary = options.Vocabulary(size=vocab_size, tokenizer=tokenizer, resize_embeddings=resize_embeddings,
                                        pad_multiple=pad_vocab_multiple)  # fmt: skip
        self._stat_sums: Optional[torch.Tensor] = None  # the objective's other sums of the step (log_train_loss)
        lora, peft, self.freezing = peft_adapters.choose(adapters)  # the frozen part: applied in _prepare
        self.compiling = compiling.Compiling(compile_options)
        chunk = chunked_loss.check_loss_chunk(loss.chunk, objective, compile)
        self.chunked = chunked_loss.ChunkedLoss(chunk) if chunk is not None else None
        multiple = padded_vocab.check_pad_vocab(vocabulary.pad_multiple, pretrained, loss.chunk)
        self.padding = padded_vocab.PaddedVocab(multiple, vocab_size)
        keyed.check_probability(dropout)
        deferred = init.init_is_deferred() and lora is None and peft is None  # an adapter is built eagerly
        self.spec = self.spec_type(architecture, vocabulary, seq_len=seq_len, rows=self.padding.rows, deferred=deferred)
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.base_seed, self.attn_implementation = self.spec.base_seed, self.spec.attn_implementation
        model = self.spec.build()
        self.config: PretrainedConfig = model.config
        self.reference = self._reference_of(model, lora is not None or peft_adapters.is_peft(peft))  # peft: its own
        self.n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
        model, peft = peft_adapters.add(self._prepare(model), lora, peft, seq_len, self._added)
        self.dropouts = key_model(model, self.attn_implementation)  # its dropouts with p > 0, keyed per sample
        self.flop_count: FlopCount = peft_adapters.flops_of(model, peft)
        self.model = model
        self.router_balance = router.balance_loss(loss.router_aux_loss, self.hf_model)  # before a strategy wraps it
        objective.check(self)
        router.check_objective(self.router_balance, objective, self.hf_model)

    def _reference_of(self, model: PreTrainedModel, adapted: bool) -> Optional[PreTrainedModel]:
        """A frozen copy of the starting policy where the objective asks for one (DPO's reference)."""
        if not self.objective.needs_reference(adapted):
            return None
        # Lightning warns of modules in eval mode at the start of fit: the reference's are, on purpose
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=PossibleUserWarning)
        return init.frozen(copy.deepcopy(model))

    @torch.no_grad()
    def _prepare(self, model: PreTrainedModel) -> PreTrainedModel:
        """What the objective changes in the model; a parameter it adds gets the value src/lm/init.py gives it
        on any layout (on meta or partitioned by ZeRO-3, it is filled with the others when materialised)."""
        model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus its warning
        self.padding.mask(model)
        self._added = self.objective.prepare(model)
        fill = self.spec.fill(model)
        for name in self._added:
            param = model.get_parameter(name)
            if not param.is_meta and not hasattr(param, "ds_shape"):
                param.copy_(init.full_value(fill, self.base_seed, name, param.shape))
        return frozen.apply(model, self.freezing, self._added)

    # ---- materialising and wrapping: what strategies call ----

    def materialize(self, device: torch.device, sharded: bool) -> None:
        if init.has_meta(self.model):
            self.spec.materialize(self.networks(), device, sharded, self._prepare)

    def configure_model(self) -> None:
        """Deferred init where the strategy does not materialise shards itself (FSDP2 calls `materialize` after
        fully_shard): under DeepSpeed ZeRO-3 each network built again, partitioned (ModelSpec.rebuilt), elsewhere
        materialised whole. Then, where the strategy does not parallelize (DDP, one device, DeepSpeed), activation
        checkpointing and compile: each whole network, or per block under ZeRO-3's hooks."""
        strategy = capabilities.of(self.trainer.strategy)
        if init.has_meta(self.model) and not strategy.materializes_shards:
            if strategy.meta_init and not self.spec.pretrained:  # ZeRO-3
                for name in ("model", "reference") if self.reference is not None else ("model",):
                    setattr(self, name, self._partitioned(name))
            else:
                self.materialize(torch.device("cpu"), sharded=False)
        if not strategy.parallelizes and not parallelized(self):
            parallelize(self, **self.wrappers(), whole_model=not strategy.meta_init)

    def _partitioned(self, name: str) -> torch.nn.Module:
        """The policy (or the reference) rebuilt under ZeRO-3, with the features the eager build gave it."""
        model = self.spec.rebuilt(self.config)
        if name == "model":  # what the objective adds is filled below
            self.dropouts = key_model(self._prepare(self.spec.set_dropout(model)), self.attn_implementation)
        else:  # the reference: the keyed attention and the padding's mask, as the model
            self.padding.mask(model)
            if any(keyed.config_fields(model.config).values()):
                keyed.key_attention(model, self.attn_implementation)
        init.materialize_zero3(model, self.spec.fill(model), self.base_seed)
        return model if name == "model" else init.frozen(model)

    def wrappers(self) -> dict[str, Any]:
        return self.compiling.wrappers()

    # ---- what strategies, callbacks, objectives and tools read ----

    @property
    def hf_model(self) -> PreTrainedModel:
        """The transformers model itself, also when a peft adapter wraps it."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def unpadded_vocab(self) -> Optional[int]:
        """The tokenizer's vocabulary where model.pad_vocab_multiple pads the model's (what export-hf writes)."""
        return self.padding.unpadded

    def network(self) -> torch.nn.Module:
        return self.model

    def networks(self) -> list[torch.nn.Module]:
        return [self.model] if self.reference is None else [self.model, self.reference]

    def blocks(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
        hf_models = [self.hf_model] + ([self.reference] if self.reference is not None else [])
        return [(layers, str(i), b) for layers in map(hf.decoder_layers, hf_models) for i, b in enumerate(layers)]

    def train(self, mode: bool = True) -> "CausalLMLitModule":
        super().train(mode)
        if self.reference is not None:  # the reference policy never trains: no dropout, ever
            self.reference.eval()
        return self

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token of a full seq_len sequence; the convention is in src/lm/features/flops.py."""
        return self.flop_count.per_token + self.flop_count.per_context * self.seq_len

    def flops_of_batch(self, batch: dict) -> torch.Tensor:
        """Read by the throughput callback for FLOP/s and MFU: the batch's real tokens only."""
        return self.flop_count.of_batch(batch)

    # ---- forwards and losses ----

    def loss_function(self) -> Callable:
        """summed_token_loss, compiled or not (model.compile_loss); under model.loss_chunk, each chunk's."""
        return self.compiling.loss_function(self, self.chunked.chunk if self.chunked else None)

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the token losses, number of targets); also what the pipeline schedule computes on its last stage."""
        return self.loss_function()(logits, labels)

    def forward_loss(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(the model's output, sum of the batch's token losses, number of targets); under model.loss_chunk the
        logits of every token are never made (the output's `logits` None: src/lm/features/chunked_loss.py)."""
        if self.chunked is not None:
            return self.chunked.forward_loss(self, batch, **kwargs)
        out = self.lm_forward(batch, **kwargs)
        return out, *self.token_loss(out.logits, batch["labels"])

    def loss_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_loss(batch)[1:]

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, attention_mask=None):
        """The model's output; with `labels` (already shifted, see summed_token_loss) its `.loss` is their
        token mean. Training normalises differently: by the whole optimizer step's targets."""
        mask = {} if attention_mask is None else {"attention_mask": attention_mask}
        out = self.lm_forward({"input_ids": input_ids, **mask})
        if labels is not None:
            loss_sum, n_targets = self.token_loss(out.logits, labels)
            out.loss = loss_sum / n_targets
        return out

    def lm_forward(self, batch: dict[str, torch.Tensor], network: Optional[torch.nn.Module] = None, **kwargs: Any):
        """A training or evaluation forward of `network` (the trained model by default; or the reference) on a batch's
        input ids with its attention mask, or a packed batch's position ids (src/lm/data/packing.py: no mask,
        so transformers keeps its records apart). Never a KV cache: a cache serves generation, and in any other
        forward transformers would fill one that nothing reads (torch.compile recompiling on it). A training forward
        of the trained model keys its dropout masks by the batch's sample indices (src/core/dropout.py)."""
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}
        if self.dropouts and self.training and (network is None or network is self.model):
            keyed.set_keys(keys_of(self, batch))
        network = network if network is not None else self.model
        with compiled_attention.plain_causal(network, inputs):  # a whole compiled network's SDPA told is_causal
            return network(**inputs, use_cache=False, **kwargs)

    # ---- the objective's steps and metrics (src/lm/objectives/base.py) ----

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss_for_backward(self.objective.training_step(self, batch, batch_idx))

    def log_train_loss(self, loss: torch.Tensor, batch_idx: int, sums: Optional[torch.Tensor] = None) -> None:
        """`sums`: the objective's other statistics of the micro-batch (a vector, a count last: DPO's rewards, ...),
        added over the step and logged as means by train_metrics."""
        if sums is not None:
            self._stat_sums = sums if self._stat_sums is None else self._stat_sums + sums
        super().log_train_loss(loss, batch_idx)

    def take_step_sums(self) -> Optional[torch.Tensor]:
        sums, self._stat_sums = self._stat_sums, None
        return sums

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if not router.clip_over_meshes(self, optimizer, gradient_clip_val):  # experts on their own ranks: there
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

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

    # ---- the features' probes, before the first step on every rank alike ----

    def on_fit_start(self) -> None:
        check_draws(self)
        router.check_router_logits(self)
        self.padding.probe(self)
        self.on_validation_start()
        if getattr(self.trainer.datamodule, "packing", False):
            packing.check_packing(self)
        self.objective.on_fit_start(self)

    def on_validation_start(self) -> None:  # eval.py: no on_fit_start
        if self.chunked is not None:
            self.chunked.probe(self)

    on_test_start = on_validation_start

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.objective.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.objective.on_load_checkpoint(checkpoint)
