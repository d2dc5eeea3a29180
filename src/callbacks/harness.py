"""generate.py tasks=[...]: lm-evaluation-harness benchmarks on the template's model (lm-eval, optional: not installed
by the lock; 0.4.13 tested).

The model stands behind lm-eval's LM API (its TemplateLM: the same context/continuation encoding as its `hf` backend):
loglikelihood, loglikelihood_rolling (the same rolling windows) and generate_until (greedy, cut at the first `until`
string). lm-eval sees one process; the requests are split here, request i on rank i mod N, each scored alone (a batch
of one: its numbers do not depend on the split) and gathered back in request order on every rank, so the scores on
N ranks are 1 process's. Every rank holds the whole model (trainer=default or ddp): sharded parameters would need
every rank to run as many forwards, which requests of different lengths do not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from src.parallel.gather import gathered
from src.utils.config import ConfigError


def spread(items: list[Any], score: Callable[[Any], Any]) -> list[Any]:
    """score(item) for every item, item i on rank i mod N, gathered in item order on every rank."""
    up = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if up else (1, 0)
    return gathered([(i, score(items[i])) for i in range(rank, len(items), world)])


def harness_lm(model: torch.nn.Module, tokenizer: Any) -> Any:
    """An lm-eval LM over `model` (a transformers causal LM, peft adapters included) and the template's tokenizer."""
    from lm_eval import utils
    from lm_eval.api.model import TemplateLM

    class TemplateModel(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.max_length = model, model.config.max_position_embeddings

        @property
        def eot_token_id(self) -> int:
            return tokenizer.eos_id

        def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
            return tokenizer.encode_batch([string])[0].tolist()

        @torch.no_grad()
        def score(self, request) -> tuple[float, bool]:
            _, context, continuation = request
            whole = (context + continuation)[-(self.max_length + 1) :]
            logits = self.model(input_ids=torch.tensor([whole[:-1]], device=self.device)).logits[
                0, -len(continuation) :
            ]
            logp, target = logits.float().log_softmax(-1), torch.tensor(whole[-len(continuation) :], device=self.device)
            return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

        @property
        def device(self) -> torch.device:
            return next(self.model.parameters()).device

        def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
            return spread(list(requests), self.score)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owner = [], []
            for number, (string,) in enumerate(req.args for req in requests):
                for window in map(
                    utils.make_disjoint_window,
                    utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1,
                    ),
                ):  # fmt: skip
                    windows.append((None, *window))
                    owner.append(number)
            totals = [0.0] * len(requests)
            for number, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
                totals[number] += logprob
            return totals

        @torch.no_grad()
        def complete(self, request) -> str:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok_encode(context)
            room = kwargs.get("max_gen_toks", 256)
            ids = ids[-(self.max_length - room) :] if len(ids) + room > self.max_length else ids
            out = self.model.generate(
                input_ids=torch.tensor([ids], device=self.device), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=room, do_sample=False, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id,
            )[0, len(ids) :].tolist()  # fmt: skip
            text = tokenizer.decode(out[: out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            return text

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return spread(list(requests), self.complete)

    return TemplateModel()


def evaluate(model: torch.nn.Module, tokenizer: Any, cfg: Any) -> dict[str, Any]:
    """lm-eval's results of cfg.tasks (names, or YAMLs under cfg.include_path), the same on every rank (`answers`)."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError(
            f"tasks= needs lm-evaluation-harness, which is not installed ({e}): pip install -e '.[bench]' (lm-eval 0.4.13 tested)."
        ) from None
    tasks = list(cfg.tasks)
    manager = None
    if cfg.include_path:  # your tasks alone first: indexing lm-eval's own thousands of YAMLs takes ~8 s a process
        manager = TaskManager(include_path=cfg.include_path, include_defaults=False)
        if any(t not in manager.all_tasks for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=cfg.include_path or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"tasks={unknown} are not lm-eval tasks: name one that `lm-eval ls tasks` lists, or a task YAML's `task:` "
            "under include_path=DIR."
        )
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # lm-eval returns results only where LOCAL_RANK is 0: it sees one process here
    try:
        results = simple_evaluate(
            model=harness_lm(model, tokenizer), tasks=tasks, task_manager=manager, num_fewshot=cfg.num_fewshot,
            limit=cfg.limit, random_seed=cfg.seed or 0, numpy_random_seed=cfg.seed or 0, torch_random_seed=cfg.seed or 0,
            fewshot_random_seed=cfg.seed or 0, log_samples=True,
        )  # fmt: skip
    finally:
        if local_rank is None:
            os.environ.pop("LOCAL_RANK")
        else:
            os.environ["LOCAL_RANK"] = local_rank
    return answers(results)


def answers(results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's scores and, per task, each document's responses (log-likelihoods, texts) in document order."""
    samples = {
        task: [s["filtered_resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
        for task, rows in results["samples"].items()
    }
    return {"results": results["results"], "samples": samples}


def scalars(scores: dict[str, Any]) -> dict[str, float]:
    """`bench/<task>/<metric>` -> value for each number lm-eval reports (a filter other than `none` named after it)."""
    out = {}
    for task, metrics in sorted(scores["results"].items()):
        for key, value in sorted(metrics.items()):
            name, _, kept = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "alias":
                out[f"bench/{task}/{name}" + ("" if kept in ("", "none") else f"/{kept}")] = float(value)
    return out


def run_loggers(ckpt_path: str) -> list[Any]:
    """The TensorBoard logger of the run that wrote `ckpt_path` (<run>/checkpoints/...), if it logged to one."""
    from lightning.pytorch.loggers import TensorBoardLogger

    runs = [p.parent for p in Path(ckpt_path).resolve().parents if p.name == "checkpoints"][:1]
    dirs = [run / "tensorboard" for run in runs if (run / "tensorboard").is_dir()]
    return [TensorBoardLogger(d, name="", version="", default_hp_metric=False) for d in dirs]


def log_scores(loggers: list[Any], scores: dict[str, Any], step: Optional[int]) -> None:
    """Each score to each logger at `step` (the checkpoint's global step), written out now."""
    for logger in loggers:
        logger.log_metrics(scalars(scores), step=step)
        logger.save()
        logger.finalize("success")
