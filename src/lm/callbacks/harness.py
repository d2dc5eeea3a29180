"""generate.py tasks=[...]: lm-evaluation-harness benchmarks on the template's model (lm-eval, optional: not installed
by the lock; 0.4.13 tested).

The model stands behind lm-eval's LM API (its TemplateLM: the same context/continuation encoding as its `hf` backend):
loglikelihood, loglikelihood_rolling (the same rolling windows) and generate_until (greedy, cut at the first `until`
string). lm-eval sees one process; the requests are put in batches here, longest first (`batch_size` each, one
forward a batch: right-padded for scoring, left-padded for generation), the same batches for any number of ranks;
batch b runs on rank b mod N and the results are gathered back in request order on every rank, so the scores on N
ranks are 1 process's, bit for bit. Every rank holds the whole model (trainer=default or ddp): sharded parameters
would need every rank to run as many forwards.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from src.lm.callbacks.generate_text import prompt_learning_inputs
from src.parallel.gather import gathered
from src.utils.config import ConfigError


def length_batches(lengths: list[int], size: int, kinds: Optional[list[str]] = None) -> list[list[int]]:
    """Item numbers in batches of at most `size` of one kind (generation settings), longest first (ties in item
    order): a batch's items pad to similar lengths, and the batches do not depend on the number of ranks."""
    kinds = kinds or [""] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (kinds[i], -lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < size and kinds[batches[-1][0]] == kinds[i]:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def spread(batches: list[list[int]], items: list[Any], run: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """run(its items) for each batch, batch b on rank b mod N, the results gathered in item order on every rank."""
    up = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if up else (1, 0)
    rows = []
    for batch in batches[rank::world]:
        rows += zip(batch, run([items[i] for i in batch]))
    return gathered(rows)


@torch.no_grad()
def score(model: torch.nn.Module, rows: list[tuple[tuple[int, ...], list[list[int]]]], pad: int) -> list[list[tuple]]:
    """For each (input ids, continuations that follow them): each continuation's (log-likelihood, whether it is the
    greedy one), from one right-padded forward of the batch (a causal model's logits at a position do not see the
    padding after it). Requests with the same input (one-token choices of one question) share a row, as lm-eval's
    hf backend shares them."""
    device = next(model.parameters()).device
    width = max(len(row) for row, _ in rows)
    ids = torch.tensor([list(row) + [pad] * (width - len(row)) for row, _ in rows], device=device)
    needed = sorted({p for row, conts in rows for p in range(len(row) - max(map(len, conts)), len(row))})
    at = {p: i for i, p in enumerate(needed)}
    base, inputs, virtual = prompt_learning_inputs(model, ids, torch.ones_like(ids))
    shift = virtual if "inputs_embeds" in inputs else 0  # prompt tuning's virtual tokens come first in the logits
    if keeps_logits(base):  # the head on the scored positions alone: ~1/3 of GPT-2's FLOPs on short rows
        logits = base(**inputs, logits_to_keep=torch.tensor(needed, device=device) + shift).logits
    else:
        logits, at = base(**inputs).logits, {p: p + shift for p in needed}
    out = []
    for k, (row, continuations) in enumerate(rows):
        scored = []
        for cont in continuations:
            logp = logits[k, at[len(row) - len(cont)] : at[len(row) - 1] + 1]
            logp = logp.to(torch.promote_types(logp.dtype, torch.float32)).log_softmax(-1)
            target = torch.tensor(cont, device=device)
            scored.append((float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
        out.append(scored)
    return out


def keeps_logits(model: torch.nn.Module) -> bool:
    """The transformers model (under a peft adapter too) takes `logits_to_keep`: positions whose logits it computes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


class Until:
    """A `generate` stopping criterion: a row is done once its new text holds one of the `until` strings (the batch
    stops when every row is done, as lm-eval's hf backend does)."""

    def __init__(self, start: int, until: list[str], decode: Callable[[list[int]], str]) -> None:
        self.start, self.until, self.decode = start, [u for u in until if u], decode

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = [any(u in self.decode(row[self.start :].tolist()) for u in self.until) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def complete(model: torch.nn.Module, prompts: list[list[int]], room: int, eos: int, until: Until) -> list[list[int]]:
    """Each prompt's greedy new tokens (up to `room`, cut before EOS) from one left-padded `generate` call."""
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    base, inputs, _ = prompt_learning_inputs(model, ids, mask)
    until.start = 0 if "inputs_embeds" in inputs else width  # from embeddings, generate's ids are the new tokens
    out = base.generate(**inputs, max_new_tokens=room, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                        stopping_criteria=StoppingCriteriaList([until]))  # fmt: skip
    out = out[:, until.start :]
    return [row[: row.index(eos)] if eos in row else row for row in out.tolist()]


def harness_lm(model: torch.nn.Module, tokenizer: Any, batch_size: int = 8) -> Any:
    """An lm-eval LM over `model` (a transformers causal LM, peft adapters included) and the template's tokenizer,
    `batch_size` requests a forward."""
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

        def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
            rows: dict[tuple[int, ...], list[list[int]]] = {}  # input ids -> the continuations scored on them
            keys = []
            for _, context, continuation in requests:
                keys.append(tuple((context + continuation)[-(self.max_length + 1) : -1]))
                rows.setdefault(keys[-1], []).append(continuation)
            items = list(rows.items())
            batches = length_batches([len(row) for row, _ in items], batch_size)
            scored = dict(zip(rows, spread(batches, items, lambda batch: score(self.model, batch, tokenizer.eos_id))))
            return [scored[key].pop(0) for key in keys]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owner = [], []
            for number, (string,) in enumerate(req.args for req in requests):
                for window in rolling_windows(self.tok_encode(string), self.prefix_token_id, self.max_length):
                    windows.append((None, *window))
                    owner.append(number)
            totals = [0.0] * len(requests)
            for number, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
                totals[number] += logprob
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            asks = [generation_ask(req.args, self.tok_encode, self.max_length) for req in requests]
            batches = length_batches([len(a[0]) for a in asks], batch_size, [repr(a[1:]) for a in asks])
            return spread(batches, asks, lambda batch: self.complete_batch(batch))

        def complete_batch(self, asks: list[tuple]) -> list[str]:
            _, room, until = asks[0]
            stop = Until(0, until, tokenizer.decode)
            texts = [
                tokenizer.decode(ids)
                for ids in complete(self.model, [a[0] for a in asks], room, tokenizer.eos_id, stop)
            ]
            return [cut(text, until) for text in texts]

    return TemplateModel()


def rolling_windows(tokens: list[int], prefix: int, context: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows over a document's tokens (its hf backend's): (context, continuation) pairs."""
    from lm_eval import utils

    windows = utils.get_rolling_token_windows(
        token_list=tokens, prefix_token=prefix, max_seq_len=context, context_len=1
    )
    return list(map(utils.make_disjoint_window, windows))


def generation_ask(args: tuple, encode: Callable[[str], list[int]], context: int) -> tuple[list[int], int, list[str]]:
    """A generate_until request's (prompt ids, room for new tokens, until strings), the prompt's start cut to fit."""
    text, kwargs = args
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    room = kwargs.get("max_gen_toks", 256)
    ids = encode(text)
    ids = ids[-(context - room) :] if len(ids) + room > context else ids
    return ids, room, until


def cut(text: str, until: list[str]) -> str:
    """`text` up to the first of the `until` strings."""
    for stop in until:
        text = text.split(stop)[0] if stop else text
    return text


def evaluate(model: torch.nn.Module, tokenizer: Any, cfg: Any) -> dict[str, Any]:
    """lm-eval's results of cfg.tasks (names, or YAMLs under cfg.include_path), the same on every rank (`answers`)."""
    try:
        from lm_eval import simple_evaluate
    except ImportError as e:
        raise ConfigError(
            f"tasks= needs lm-evaluation-harness, which is not installed ({e}): pip install -e '.[bench]' (lm-eval 0.4.13 tested)."
        ) from None
    tasks, manager = list(cfg.tasks), task_manager(cfg)
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # lm-eval returns results only where LOCAL_RANK is 0: it sees one process here
    try:
        results = simple_evaluate(
            model=harness_lm(model, tokenizer, cfg.batch_size), tasks=tasks, task_manager=manager, num_fewshot=cfg.num_fewshot,
            limit=cfg.limit, random_seed=cfg.seed or 0, numpy_random_seed=cfg.seed or 0, torch_random_seed=cfg.seed or 0,
            fewshot_random_seed=cfg.seed or 0, log_samples=True,
        )  # fmt: skip
    finally:
        if local_rank is None:
            os.environ.pop("LOCAL_RANK")
        else:
            os.environ["LOCAL_RANK"] = local_rank
    return answers(results)


def task_manager(cfg: Any) -> Any:
    """lm-eval's TaskManager for cfg.tasks: the tasks under cfg.include_path alone where they are all there (indexing
    lm-eval's own thousands of YAMLs takes ~8 s a process), else with lm-eval's; an unknown task is one sentence."""
    from lm_eval.tasks import TaskManager

    tasks, manager = list(cfg.tasks), None
    if cfg.include_path:
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
    return manager


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
