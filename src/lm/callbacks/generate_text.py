"""Show what the model writes: completions of fixed prompts, logged to TensorBoard as text at validation end."""

from __future__ import annotations

import inspect
import logging
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from src.parallel import capabilities

log = logging.getLogger(__name__)


class GenerateText(L.Callback):
    def __init__(
        self,
        prompts: list[str],
        max_new_tokens: int = 64,
        do_sample: bool = False,  # false: greedy; true: sample with temperature / top_k / top_p
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 0,
        held_out: int = 0,  # also complete the data's first N held-out conversations (data=chat: sample_prompts)
    ) -> None:
        self.prompts, self.max_new_tokens, self.seed, self.held_out = list(prompts), max_new_tokens, seed, held_out
        self.sampling = {"do_sample": do_sample}
        if do_sample:
            self.sampling.update(temperature=temperature, top_k=top_k, top_p=top_p)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.held_out and hasattr(trainer.datamodule, "sample_prompts") and stage == "fit":
            self.prompts += trainer.datamodule.sample_prompts(self.held_out)  # rendered by the chat template
            self.held_out = 0
        writes = getattr(getattr(pl_module, "objective", None), "generates", True)  # a reward model does not
        if not (
            writes
            and hasattr(trainer.datamodule, "tokenizer")
            and hasattr(getattr(pl_module, "model", None), "generate")
        ):
            rank_zero_warn(
                "callbacks.generate_text is on but this model/data cannot generate text: skipping samples "
                "(switch it off with callbacks.generate_text=null)."
            )
            self.prompts = []
        elif capabilities.of(trainer.strategy).generation is None:  # e.g. pipeline stages: no rank has the whole model
            rank_zero_warn(
                f"callbacks.generate_text is on but {type(trainer.strategy).__name__} cannot generate: "
                "skipping samples (switch it off with callbacks.generate_text=null)."
            )
            self.prompts = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.prompts:
            return
        # Sharded parameters (FSDP, ZeRO-3) are gathered collectively: then every rank generates, in lockstep.
        sharded = capabilities.of(trainer.strategy).generation == "lockstep"
        if not (sharded or trainer.is_global_zero):
            return
        texts = self.generate(pl_module.model, trainer.datamodule.tokenizer, synced=sharded)
        if trainer.is_global_zero and texts:
            self._log(trainer, texts)

    @rank_zero_only
    def _log(self, trainer: L.Trainer, texts: list[tuple[str, str]]) -> None:
        step = trainer.global_step
        for tb in [lg for lg in trainer.loggers if hasattr(lg.experiment, "add_text")]:
            for i, (prompt, completion) in enumerate(texts):
                # Markdown: indent by 4 spaces so TensorBoard shows the text verbatim
                body = "\n".join("    " + line for line in (prompt + completion).splitlines())
                tb.experiment.add_text(f"samples/{i}", body, global_step=step)
        log.info("Samples at step %d:\n%s", step, "\n---\n".join(p + c for p, c in texts))

    def generate(self, model: torch.nn.Module, tokenizer, synced: bool = False) -> list[tuple[str, str]]:
        """(prompt, completion) pairs; each stops at EOS or the context length.

        All prompts go through one `generate` call, left-padded with EOS under an attention mask (the model's
        positions follow the mask, so each completion is what it would be alone): one forward per new token
        for the whole batch, 2.5-3x faster than a call per prompt (docs/performance.md). Under peft's prompt
        learning (prefix and prompt tuning) see `prompt_learning_inputs`."""
        if not self.prompts:
            return []
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        prompts = [ids.tolist() for ids in tokenizer.encode_batch(self.prompts)]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[tokenizer.eos_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        texts = []
        # A private RNG: sampling must not shift the training RNG stream (and with it the data order).
        # eagerly: model.compile's graphs are the training forward's, not generation's (a cache, a new length a step)
        with (
            torch.no_grad(),
            torch.compiler.set_stance("force_eager"),
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            torch.manual_seed(self.seed)
            # A diverged model would make sampling fail ("probability tensor contains either inf, nan").
            # The logits are the same on every rank (also sharded), so all ranks skip together. The last
            # position is a prompt token in every row (left padding; after peft's virtual tokens too).
            logits = model(input_ids=input_ids, attention_mask=mask).logits
            if not torch.isfinite(logits[:, -1]).all():
                rank_zero_warn(
                    "callbacks.generate_text: the model's logits are not finite (NaN/inf: the run "
                    "diverged?); skipping samples."
                )
            else:
                generator, inputs, virtual = prompt_learning_inputs(model, input_ids, mask)
                room = model.config.max_position_embeddings - virtual - width  # virtual tokens take positions too
                out = generator.generate(
                    **inputs,
                    max_new_tokens=max(1, min(self.max_new_tokens, room)),
                    eos_token_id=tokenizer.eos_id,
                    pad_token_id=tokenizer.eos_id,
                    synced_gpus=synced,
                    **self.sampling,
                )
                new_tokens = out if "inputs_embeds" in inputs else out[:, width:]  # with embeddings: only new ones
                for prompt, row in zip(self.prompts, new_tokens.tolist()):
                    completion = row[: row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row
                    texts.append((prompt, tokenizer.decode(completion)))
        model.train(was_training)
        return texts


def prompt_learning_inputs(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor):
    """(the model to call `generate` on, its inputs, the number of virtual tokens before the prompt).

    Under peft's prompt learning the virtual tokens are put in front here, with the public `get_prompt`, and the
    base model generates: prefix tuning's key/value prefix as the starting cache, prompt tuning's embeddings in
    front of the prompt's, both under a mask that covers them, so positions follow the mask and a left-padded
    batch completes as each prompt alone (peft's own generate dropped the positions of prompt tuning).
    Needed since transformers 5.24 renamed generation's cache argument `past_key_values` to `cache`: peft
    0.21.2's `PeftModelForCausalLM.prepare_inputs_for_generation` still looks for `past_key_values`, takes every
    step for the first and injects the virtual tokens again, so its samples ignore the learned prefix
    (tests/test_model.py compares them with a greedy decode by full forwards)."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is None or not peft_config.is_prompt_learning:
        return model, {"input_ids": input_ids, "attention_mask": mask}, 0
    base, virtual, batch = model.get_base_model(), peft_config.num_virtual_tokens, input_ids.shape[0]
    mask = torch.cat([mask.new_ones(batch, virtual), mask], dim=1)
    if peft_config.peft_type == "PREFIX_TUNING":
        cache_name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        return base, {"input_ids": input_ids, "attention_mask": mask, cache_name: model.get_prompt(batch)}, virtual
    embeds = base.get_input_embeddings()(input_ids)
    embeds = torch.cat([model.get_prompt(batch_size=batch).to(embeds.dtype), embeds], dim=1)
    return base, {"inputs_embeds": embeds, "attention_mask": mask}, virtual
