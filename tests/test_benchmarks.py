"""generate.py tasks=[...] (lm-evaluation-harness, optional): a local multiple-choice task, a rolling
log-likelihood task and a generate-until task, written here, score the same on 1 process, on 2 DDP ranks, and under
lm-eval's own `hf` backend on the export-hf of the same checkpoint, document by document, and are logged to the
checkpoint's run's TensorBoard (or to logger=csv); an unknown task is one sentence. Skipped where lm-eval is not
installed."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import FULL_MATRIX_ONLY, path_overrides, read_events, run_script, shared
from test_generate import SHORT, generate, one_sentence, train_run
from test_parity import GPT2, QUIET

from bench.compare.harness import write_task

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -e '.[bench]'")
pytestmark = pytest.mark.slow
TASKS = ["tiny_mc", "tiny_roll", "tiny_gen"]


def write_tasks(root: Path) -> Path:
    """Three lm-eval task YAMLs and their JSONL documents in `root`."""

    def task(name: str, data: list[dict], body: str) -> None:
        write_task(root, name, data, body)  # the bench's writer: one task's JSONL and YAML

    words = ["mat", "dog", "tree", "sky"]
    task("tiny_mc", [{"q": f"Q{i}: the cat sat on the", "choices": words, "answer": i % 4} for i in range(6)],
         'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
         "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")  # fmt: skip
    task("tiny_roll", [{"text": "The quick brown fox jumps over the lazy dog. " * k} for k in (1, 3, 30)],
         'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
         "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")  # fmt: skip
    task("tiny_gen", [{"q": f"Say {w}:", "a": w} for w in ("yes", "no", "cat")],
         'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
         'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
         "metric_list:\n  - metric: exact_match\n")  # fmt: skip
    return root


def close(ours, theirs, where: str = "") -> None:
    """Equal, numbers within 1e-4 (lm-eval's hf backend batches and pads; ours scores each request alone)."""
    if isinstance(ours, (int, float)) and not isinstance(ours, bool):
        assert abs(ours - theirs) <= 1e-4 * max(1.0, abs(theirs)), (where, ours, theirs)
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            close(a, b, f"{where}[{i}]")
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            close(ours[key], theirs[key], f"{where}.{key}")
    else:
        assert ours == theirs, (where, ours, theirs)


def test_scores_on_two_ranks_and_under_lm_evals_hf_backend_are_one_process(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from src.checkpoint.convert import export_hf
    from src.lm.callbacks.harness import answers

    tasks = write_tasks(tmp_path)
    ckpt = train_run(tmp_path, [*GPT2, *SHORT, f"data.tokenizer={shared('gpt2-tokenizer')}", "data.seq_len=64"])
    runs = {}
    for name, args in {"one": [], "two": ["trainer=ddp", "trainer.devices=2", "logger=csv"]}.items():
        out = tmp_path / f"{name}.json"
        proc = generate(tmp_path, ckpt, [f"tasks=[{','.join(TASKS)}]", f"include_path={tasks}", f"output={out}", *args])
        assert proc.stdout.count("BENCH ") == 3
        runs[name] = json.loads(out.read_text())
    assert runs["two"] == runs["one"]
    events = read_events(ckpt.parent.parent / "tensorboard")  # the scores at the checkpoint's step, in its run's
    acc = runs["one"]["results"]["tiny_mc"]["acc,none"]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("bench/tiny_mc/acc")] == [(2, acc)]
    assert "bench/tiny_roll/word_perplexity" in events.Tags()["scalars"]
    (table,) = (tmp_path / "gen").rglob("metrics.csv")  # logger=csv: the named logger's instead
    (row,) = list(csv.DictReader(table.open()))
    assert (row["step"], float(row["bench/tiny_mc/acc"])) == ("2", acc)
    hf = simple_evaluate(
        model="hf", model_args=f"pretrained={export_hf(ckpt, tmp_path / 'hf')},device=cpu,dtype=float32", tasks=TASKS,
        task_manager=TaskManager(include_path=str(tasks)), batch_size=2, log_samples=True, random_seed=42,
        numpy_random_seed=42, torch_random_seed=42, fewshot_random_seed=42,
    )  # fmt: skip
    theirs = json.loads(json.dumps(answers(hf), default=str))
    close(runs["one"]["samples"], theirs["samples"], "samples")
    for task in TASKS:
        close(
            {k: v for k, v in runs["one"]["results"][task].items() if "stderr" not in k},
            {k: v for k, v in theirs["results"][task].items() if "stderr" not in k},
            task,
        )
    assert len(theirs["samples"]["tiny_roll"]) == 3 and len(theirs["samples"]["tiny_mc"][0]) == 4


@FULL_MATRIX_ONLY  # suite time, 14 s: two refusals of generate.py's (tests/test_generate.py's bad input stays)
def test_an_unknown_task_or_a_sharded_strategy_is_one_sentence(tmp_path):
    ckpt = train_run(tmp_path, [*GPT2, *SHORT])
    line = one_sentence(generate(tmp_path, ckpt, ["tasks=[no_such_task]"], check=False))
    assert "tasks=['no_such_task'] are not lm-eval tasks" in line
    line = one_sentence(generate(tmp_path, ckpt, ["tasks=[tiny_mc]", "trainer=fsdp", "trainer.devices=2"], check=False))
    assert "tasks= runs where every rank holds the whole model" in line


def bench_series(tmp: Path, name: str, tasks: Path, args: list[str]) -> dict[str, list[list]]:
    """callbacks.benchmarks' logged scores of a tiny run, tag -> [(step, value)], read back from its csv/metrics.csv."""
    bench = ["callbacks=[default,benchmarks]", "callbacks.benchmarks.tasks=[tiny_mc,tiny_roll]", "logger=csv",
             "callbacks.benchmarks.every_n_steps=2", f"callbacks.benchmarks.include_path={tasks}", "data.seq_len=64",
             "trainer.max_steps=4", "trainer.val_check_interval=4", f"data.tokenizer={shared('gpt2-tokenizer')}"]  # fmt: skip
    run_script(
        "train.py", QUIET + path_overrides({"log_dir": tmp / name, "cache_dir": tmp / "cache"}) + GPT2 + bench + args
    )
    (table,) = (tmp / name).rglob("metrics.csv")
    rows = list(csv.DictReader(table.open()))
    tags = [t for t in rows[0] if t.startswith("bench/")]
    return {t: [[int(r["step"]), float(r[t])] for r in rows if r[t]] for t in tags}


@FULL_MATRIX_ONLY  # suite time, 76 s: the LM it runs is proven on 2 ranks by the test above
def test_the_callback_logs_the_same_scores_on_one_process_and_two_ranks(tmp_path):
    """The same global batch on 1 process and 2 DDP ranks trains the same weights to fp32 rounding (test_parity);
    accuracies are then equal and log-likelihood metrics within 1e-4 relative (the same bound as against hf)."""
    tasks = write_tasks(tmp_path)
    one = bench_series(tmp_path, "one", tasks, [])
    two = bench_series(tmp_path, "two", tasks, ["trainer=ddp", "trainer.devices=2"])
    assert {"bench/tiny_mc/acc", "bench/tiny_mc/acc_norm", "bench/tiny_roll/word_perplexity"} <= one.keys()
    assert [s for s, _ in one["bench/tiny_mc/acc"]] == [2, 4]
    close(two, one, "bench")
    fsdp = run_script("train.py", [*QUIET, *GPT2, "callbacks=[default,benchmarks]", "callbacks.benchmarks.tasks=[x]",
                                   "trainer=fsdp", "trainer.devices=2"], check=False, env={"HYDRA_FULL_ERROR": "0"})  # fmt: skip
    assert "callbacks.benchmarks runs where every rank holds the whole model" in one_sentence(fsdp)


@pytest.mark.parametrize("adapter", [None, "prefix", "prompt"])
def test_batched_requests_score_and_complete_as_each_alone(adapter):
    """The harness's batches (longest first, right-padded for scoring with shared rows for shared inputs, left-padded
    for generation, prompt learning's virtual tokens in front) give each request what it gets alone: float64, so
    the bound is rounding's (1e-9 on sums of a few log-probabilities)."""
    import peft
    import torch
    import transformers

    from src.lm.callbacks.harness import harness_lm, length_batches

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    if adapter:
        kind = peft.PrefixTuningConfig if adapter == "prefix" else peft.PromptTuningConfig
        model = peft.get_peft_model(model, kind(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
        torch.nn.init.normal_(model.prompt_encoder.default.embedding.weight)
    tokenizer = type("Tok", (), {"eos_id": 99, "decode": staticmethod(lambda ids: " ".join(map(str, ids)))})()
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 99, (n,), generator=g).tolist() for n in (3, 80 if not adapter else 50, 17, 17, 9)]
    requests = [(None, c, [t]) for c in contexts for t in (3, 7, 11)] + [(None, c, [5, 6, 7]) for c in contexts]
    batched = harness_lm(model, tokenizer, 4)._loglikelihood_tokens(requests)
    alone = [harness_lm(model, tokenizer, 1)._loglikelihood_tokens([r])[0] for r in requests]
    assert [b for _, b in batched] == [b for _, b in alone]
    assert max(abs(a - b) for (a, _), (b, _) in zip(batched, alone)) < 1e-9
    with torch.no_grad():  # and each equals the model's own full forward of that request
        for (logprob, _), (_, context, continuation) in zip(batched[:3], requests[:3]):
            whole = torch.tensor([(context + continuation)[:-1]])
            full = model(input_ids=whole).logits[0, -1].log_softmax(-1)[continuation[0]]
            assert abs(logprob - float(full)) < 1e-9
    from src.lm.callbacks.harness import Until, complete

    prompts = [c[:12] for c in contexts]
    each = [complete(model, [p], 6, 99, Until(0, [], tokenizer.decode))[0] for p in prompts]
    assert complete(model, prompts, 6, 99, Until(0, [], tokenizer.decode)) == each
    assert length_batches([3, 5, 5, 1, 7], 2) == [[4, 1], [2, 0], [3]]
    assert length_batches([3, 5, 5, 1, 7], 2, ["a", "b", "a", "a", "b"]) == [[2, 0], [3], [4, 1]]
