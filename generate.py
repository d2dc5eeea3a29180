"""Sample from a checkpoint: python generate.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt prompt="..."

Rebuilds the model as eval.py does (the config stored in the checkpoint, every form it is written in: a file, an
FSDP2 DCP dir, a ZeRO dir; LoRA and prompt-learning adapters included) and completes one prompt, streamed to
stdout; `prompts_file=` (a .txt, one prompt a line, or a .jsonl of {"prompt": ...}) completes each into a JSONL in
prompt order, on any number of ranks (trainer=ddp, trainer=fsdp) with the same text for each prompt (its randomness
keyed by seed and prompt number: src/run/sampling.py); `chat=true` holds a conversation on stdin/stdout
(src/run/chat.py).
"""

import json
import logging
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

import src.launch.resolvers  # noqa: F401
from eval import choose_precision, consolidated_once, stored_config, trained_config
from src.checkpoint import safe_load
from src.checkpoint.convert import is_sharded, read_stored
from src.launch.choices import check_choices
from src.launch.timeouts import distributed_errors
from src.lm.callbacks import harness as benchmarks
from src.parallel import capabilities
from src.parallel.gather import gathered
from src.run import chat, sampling
from src.run.always_on import always_on
from src.run.job import check_export_and_seed
from src.utils.config import ConfigError, instantiate_group, register_schemas
from src.utils.errors import CheckpointError, user_errors

register_schemas()
log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    with user_errors(cfg), distributed_errors():
        generate(cfg)


def language_model(module: Any, cfg: DictConfig) -> None:
    """A checkpoint generate.py can sample from: a causal LM that writes text (not a classifier, not a reward model)."""
    writes = getattr(getattr(module, "objective", None), "generates", True)
    if not (writes and hasattr(getattr(module, "model", None), "generate")):
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {type(module).__name__}"
            f"{'' if writes else ' scoring text (a reward model)'}, not a language model that writes text: "
            "generate.py samples from causal LM checkpoints (model=gpt2, llama, qwen2, mistral, causal_lm)."
        )


def prompts_of(cfg: DictConfig) -> list[str]:
    given = [k for k in ("prompt", "prompts_file", "tasks") if cfg.get(k) is not None] + (
        ["chat=true"] if cfg.chat else []
    )
    if len(given) != 1:
        raise ConfigError(
            f'generate.py got {" and ".join(given) or "nothing to complete"}: give one of prompt="...", '
            "prompts_file=FILE (.txt or .jsonl), chat=true or tasks=[...]."
        )
    if cfg.chat or cfg.tasks is not None:
        return [""]  # one item on each rank: the conversation, the benchmarks
    return [cfg.prompt] if cfg.prompt is not None else sampling.read_prompts(cfg.prompts_file)


def generate(cfg: DictConfig) -> None:
    from torch.utils.data import DataLoader

    safe_load.trust(cfg.get("trust_checkpoint", False))
    sampling.check_sampling(cfg)
    prompts = prompts_of(cfg)
    stored = stored_config(cfg)
    choose_precision(cfg, stored)
    check_export_and_seed(cfg)
    trained = trained_config(cfg, stored)
    datamodule = instantiate(trained.data)
    module = instantiate(trained.model, **getattr(datamodule, "model_kwargs", {}))
    language_model(module, cfg)
    tokenizer = datamodule.tokenizer
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, callbacks=always_on("generate", cfg))
    check_layout(cfg, trainer)
    render = chat.template(tokenizer, trained.data, cfg.chat_template) if cfg.chat else None
    synced = capabilities.of(trainer.strategy).generation == "lockstep"  # every forward gathers: all ranks run as many
    stops = sampling.stop_ids(tokenizer)

    def predict_step(batch: list[int], batch_idx: int) -> list[tuple[int, Any]]:
        number = batch[0]
        if cfg.chat:
            return [(0, chat.chat(module.model, tokenizer, render, cfg, synced))]
        if cfg.tasks is not None:  # every rank: each scores its share of the requests
            return [(number, benchmarks.evaluate(module.model, tokenizer, cfg))]
        ids = tokenizer.encode_batch([prompts[max(number, 0)]])[0].tolist()
        stream = sampling.Printer(tokenizer, stops) if cfg.prompt is not None and number == 0 else None
        tokens = sampling.complete(module.model, ids, cfg, max(number, 0), stops, synced, stream)
        return [] if number < 0 else [(number, {"prompt": prompts[number], "completion": tokenizer.decode(tokens),
                                                "tokens": tokens})]  # fmt: skip

    module.predict_step = predict_step
    ckpt_path = cfg.ckpt_path
    if is_sharded(ckpt_path) and capabilities.of(trainer.strategy).checkpoint_form == "file":
        ckpt_path = consolidated_once(ckpt_path, Path(cfg.paths.output_dir) / "consolidated.ckpt")
    loader = DataLoader(
        [*range(len(prompts)), -1], batch_size=1, sampler=sampling.RankShare(len(prompts)), collate_fn=list
    )
    module.eval()
    batches = trainer.predict(module, dataloaders=loader, ckpt_path=ckpt_path, return_predictions=True)
    results = gathered([row for batch in batches or [] for row in batch])
    if cfg.tasks is not None and trainer.is_global_zero:
        report_scores(cfg, results[0])
    if cfg.prompts_file is not None and trainer.is_global_zero:
        write_generations(cfg, results)


def check_layout(cfg: DictConfig, trainer: Any) -> None:
    """What the trainer's ranks and strategy cannot do: chat on several ranks, sample without the whole model on a
    rank, lm-eval's tasks with the parameters sharded."""
    if cfg.chat and trainer.world_size > 1:
        raise ConfigError(
            "chat=true runs in one process: drop trainer=ddp / trainer.devices (or set trainer.devices=1)."
        )
    if capabilities.of(trainer.strategy).generation is None:
        raise ConfigError(
            f"trainer={type(trainer.strategy).__name__} cannot generate (no rank holds the whole model): sample under "
            "trainer=default, ddp or fsdp, which read its checkpoint too (consolidated once into the run dir)."
        )
    if cfg.tasks is not None and capabilities.of(trainer.strategy).generation == "lockstep":
        raise ConfigError(
            "tasks= runs where every rank holds the whole model: use trainer=default or trainer=ddp, not a strategy "
            "that shards the parameters (its ranks would run different numbers of forwards)."
        )


def report_scores(cfg: DictConfig, scores: dict[str, Any]) -> None:
    """lm-eval's scores (rank 0): written to output (benchmarks.json), logged at the checkpoint's step, printed."""
    out = Path(cfg.output or Path(cfg.paths.output_dir) / "benchmarks.json")
    out.write_text(json.dumps(scores, indent=1, default=str))
    loggers = instantiate_group(cfg.logger, "logger") if cfg.logger else benchmarks.run_loggers(cfg.ckpt_path)
    benchmarks.log_scores(loggers, scores, read_stored(cfg.ckpt_path, "global_step"))
    for task, metrics in sorted(scores["results"].items()):
        print(f"BENCH {task} " + " ".join(f"{k}={v:.6f}" for k, v in sorted(metrics.items()) if isinstance(v, float)))


def write_generations(cfg: DictConfig, results: list[dict[str, Any]]) -> None:
    """The prompts_file's completions (rank 0), in prompt order, as JSONL to output (generations.jsonl)."""
    out = Path(cfg.output or Path(cfg.paths.output_dir) / "generations.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results), encoding="utf-8")
    print(f"GENERATED {len(results)} completions -> {out}")


if __name__ == "__main__":
    check_choices()
    main()
