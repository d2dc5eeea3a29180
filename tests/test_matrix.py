"""Every data kind x objective x strategy through every phase of a run, against one process.

The cells are generated from the config groups: each language-model data option in conf/data/ (both ways for a
datamodule with a `packing` option) with each objective in conf/model/objective/ whose `batch_kind` is the data's,
under each strategy of STRATEGIES. A cell runs, on 2 gloo ranks, through train.py:

- fit for 6 steps, validating every 3 (check_val_every_n_epoch=null) over an evaluation split that does not divide
  over 2 ranks (one rank gets the padding item), the run crossing an epoch's end (its tail dropped), then test;
- a resume of its step-3 checkpoint on 1 process (another number of ranks; ZeRO's on its own 2);
- eval.py on its final checkpoint on 1 process (against eval.py of the 1-process checkpoint on 2 ranks), and
  `src.tools.checkpoints export-hf`;

and compares with the same run on 1 process: every logged value at every step, the test metrics, the final
weights, eval.py's metrics and the exported model's outputs, within 1e-5 (fp32). A combination that cannot be
equal is refused before step 1 in one sentence (exit 2, no traceback): the cell asserts that sentence.

The default suite runs SAMPLE; TEST_ALL_ARCHITECTURES=1 runs every cell. docs/matrix.md is generated from the
cells (`python -m tests.test_matrix > docs/matrix.md`, checked by test_the_docs_table_is_the_generated_one).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml

if __name__ == "__main__":  # python -m tests.test_matrix RESULTS: the tests' own imports, as under pytest
    sys.path.insert(0, str(Path(__file__).parent))
from conftest import ALL, ROOT, once_per_session, path_overrides, read_events, run_script, shared
from test_parity import QUIET

from src.lm.data.tokens import LANGUAGE_KINDS
from tests.helpers.margins import within

# from scratch (dropout 0): 2 heads and 2 layers, so tensor parallel and 2 pipeline stages can split it
MODEL = ["model=gpt2", "model.n_layer=2", "model.n_embd=32", "model.n_head=2"]
RUN = [
    "data.global_batch_size=8",
    "seed=7",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.check_val_every_n_epoch=null",
    "test=true",
    "model.scheduler.num_warmup_steps=1",
    "model.optimizer.lr=1e-3",
    # Adam's eps 1e-6 (the config's 1e-8): Adam divides each gradient by its own root mean square, so where a gradient
    # is at eps's scale (the rows of tokens no sample holds get only the softmax's faint pull) the fp32 rounding of
    # the sum over ranks moves the update by up to lr x rounding / eps. The GRPO cells ended 1.13e-5 apart with 1e-8
    # on a Xeon (family 6 model 207), 6.9e-8 with 1e-6, against the 1e-5 below; a different model moves a weight
    # by ~lr (1e-3) a step.
    "model.optimizer.eps=1e-6",
    # the step-3 checkpoint beside last.ckpt, for the resume
    "+callbacks.mid={_target_:lightning.pytorch.callbacks.ModelCheckpoint,dirpath:${paths.output_dir}/checkpoints,"
    "filename:'mid_{step}',auto_insert_metric_name:false,every_n_train_steps:3,save_top_k:-1,monitor:null}",
]

# The test inputs of each data kind: a small real file (`data_file`: its first RECORDS records) and what keeps it
# tiny. The sizes give each kind an epoch of 3-5 optimizer steps with a tail that does not fill a global batch (6
# steps cross an epoch's end) and val/test splits of an odd number of samples
# (test_every_data_kind_has_uneven_evaluation_splits checks both).
SPLITS = ["data.val_fraction=0.1", "data.test_fraction=0.1"]
DATA = {
    "text": ["data.seq_len=128", *SPLITS],
    "instruct": ["data.seq_len=128", *SPLITS],
    "instruct-packed": ["data.seq_len=512", *SPLITS],  # about 2 records a row
    "chat": ["data.seq_len=512", "data.chat_template=chatml", *SPLITS],
    # bytes as tokens: the default suite's cell, and a 257-wide head instead of GPT-2's 50257 (suite time)
    "chat-packed": ["data.seq_len=1024", "data.chat_template=chatml", "data.tokenizer=bytes", *SPLITS],
    "preference": ["data.seq_len=48", "data.max_prompt_len=24", *SPLITS],
    "prompts": ["data.seq_len=32", *SPLITS],
}
RECORDS = {"instruct": 51, "instruct-packed": 70, "chat": 51, "chat-packed": 80, "preference": 51, "prompts": 51}
OBJECTIVE_ARGS = {  # what keeps an objective's run short
    "grpo": ["model.objective.num_generations=2", "model.objective.max_new_tokens=4", "model.objective.beta=0.04"],
    "reward": ["model.objective.center_rewards=0.01", "callbacks.generate_text=null"],
}
# data options outside the matrix, and why
NOT_LANGUAGE = {
    "mnist": "images for model=convnet (test_parity.py)",
    "digits": "images for model=convnet (test_parity.py)",
    "litdata": "pre-optimized litdata shards of a text corpus: data=text's datamodule over another reader "
    "(test_shards.py: 1 process = N ranks)",
}

CPU_DS = [
    "trainer=deepspeed",
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.accelerator=cpu",
]
STRATEGIES = {  # name: (2-rank args, the args its step-3 checkpoint resumes under: 1 process where it can)
    "ddp": (["trainer=ddp", "trainer.devices=2"], []),
    "fsdp": (["trainer=fsdp", "trainer.devices=2", "trainer.strategy.save_distributed_checkpoint=true"], []),
    # a ZeRO checkpoint resumes on its own number of ranks (DeepSpeed repartitions no optimizer state: train.py
    # refuses another in one sentence, test_deepspeed.py), so the resume is on 2 ranks; eval.py reads it on 1
    "zero2": ([*CPU_DS, "trainer.devices=2", "trainer.strategy.stage=2"], [*CPU_DS, "trainer.devices=2"]),
    "tp": (["trainer=tp", "trainer.devices=2"], []),
    "pipeline": (["trainer=pipeline", "trainer.devices=2"], []),
}
SAMPLE = {("chat-packed", "sft", "ddp")}  # the default suite's cells; the rest under TEST_ALL_ARCHITECTURES=1


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


def target_class(path: Path) -> type:
    import importlib

    module, _, name = yaml.safe_load(path.read_text())["_target_"].rpartition(".")
    return getattr(importlib.import_module(module), name)


def language(option: str) -> bool:
    """Whether conf/data/<option>.yaml's datamodule holds a language model's batches (tokens, pairs or prompts, its
    `batch_kind`): the matrix's rows. Images, tables and a user's own data (`samples`) are proved by their own tests
    and the parity check of their experiment (test_experiments.py)."""
    from hydra.utils import get_object

    target = yaml.safe_load((ROOT / "conf" / "data" / f"{option}.yaml").read_text()).get("_target_")
    return getattr(get_object(target), "batch_kind", None) in LANGUAGE_KINDS


def data_kinds() -> dict[str, tuple[str, bool]]:
    """name -> (data option, packing): every language-model data option, packed and not where it can pack."""
    kinds = {}
    for option in options("data"):
        if option in NOT_LANGUAGE or not language(option):
            continue
        if "packing" in yaml.safe_load((ROOT / "conf" / "data" / f"{option}.yaml").read_text()):
            kinds[option] = (option, False)
            kinds[f"{option}-packed"] = (option, True)
        else:
            kinds[option] = (option, False)
    return kinds


def cells() -> list[tuple[str, str, str]]:
    """(data kind, objective, strategy) for every objective whose batch kind is the data's."""
    out = []
    for kind, (option, _) in data_kinds().items():
        batch_kind = target_class(ROOT / "conf" / "data" / f"{option}.yaml").batch_kind
        for objective in options("model/objective"):
            if target_class(ROOT / "conf" / "model" / "objective" / f"{objective}.yaml").batch_kind == batch_kind:
                out += [(kind, objective, strategy) for strategy in STRATEGIES]
    return out


def data_file(kind: str, directory: Path) -> Path:
    """The small real file of a data kind (from ../shared/data, or the tests' own corpus)."""
    option, _ = data_kinds()[kind]
    if option == "text":
        return ROOT / "tests" / "data" / "tiny_corpus.txt"
    if option == "prompts":
        from test_grpo import arithmetic

        return arithmetic(directory / "sums.jsonl", n=RECORDS[kind])
    source = {
        "instruct": ("alpaca", "alpaca_en_demo.json"),
        "chat": ("chat", "glaive_toolcall_en_demo.json"),
        "preference": ("preference", "dpo_en_demo.json"),
    }[option]
    records = json.loads(shared(*source).read_text())[: RECORDS[kind]]
    path = directory / f"{kind}.json"
    path.write_text(json.dumps(records))
    return path


def cell_args(kind: str, objective: str, directory: Path) -> list[str]:
    option, packing = data_kinds()[kind]
    can_pack = "packing" in yaml.safe_load((ROOT / "conf" / "data" / f"{option}.yaml").read_text())
    packing_args = [f"data.packing={str(packing).lower()}"] if can_pack else []
    return [
        f"data={option}",
        f"model/objective={objective}",
        f"data.path={data_file(kind, directory)}",
        *DATA[kind],
        *packing_args,
        *(
            []
            if any(a.startswith("data.tokenizer=") for a in DATA[kind])
            else [f"data.tokenizer={shared('gpt2-tokenizer')}"]
        ),
        *MODEL,
        *RUN,
        *OBJECTIVE_ARGS.get(objective, []),
    ]


def train(tmp: Path, name: str, args: list[str], check: bool = True):
    """train.py with `args`; (its run dir, the finished process)."""
    dirs = {"log_dir": tmp / name, "cache_dir": tmp / "cache"}
    # HYDRA_FULL_ERROR=0: a refusal as a user sees it (one line); a bug still shows its traceback
    proc = run_script("train.py", QUIET + path_overrides(dirs) + args, check=check, env={"HYDRA_FULL_ERROR": "0"})
    runs = list((dirs["log_dir"] / "train" / "runs").glob("*")) if proc.returncode == 0 else []
    return (runs[0] if runs else None), proc


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = read_events(run / "tensorboard")
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from src.checkpoint.convert import load_checkpoint

    return load_checkpoint(ckpt)["state_dict"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def close(tag: str, a: float, b: float, where: str, scale: float = 1.0) -> None:
    """a and b within 1e-5, relative above `scale` (1, or what the value is a difference of); a perplexity (exp
    of a loss) as its log, the loss it stands for."""
    if tag.endswith("ppl"):
        a, b = math.log(a), math.log(b)
    within(abs(a - b), 1e-5 * max(scale, abs(a)), f"{tag} {where}")


def reward_scale(metrics: dict[str, float]) -> float:
    """DPO's rewards are beta x (log pi - log pi_ref), differences of answers' summed log-probs: two checkpoints a
    rounding apart (1e-6 in the weights) move each sum by a relative 1e-5 of |log pi|, not of the reward (beta <= 1)."""
    return max([1.0] + [abs(v) for tag, v in metrics.items() if "/logps/" in tag])


def assert_same_scalars(one: dict, run: dict, steps_from: int = 0) -> None:
    """Every tag the 1-process run logged, at every step (from `steps_from`), within 1e-5 (relative above 1)."""
    for tag, series in one.items():
        if tag in ("epoch",):
            continue
        expected = [(s, v) for s, v in series if s >= steps_from]
        got = [(s, v) for s, v in run.get(tag, []) if s >= steps_from]
        assert [s for s, _ in got] == [s for s, _ in expected], f"{tag}: steps {got} vs {expected}"
        for (step, a), (_, b) in zip(expected, got):
            close(tag, a, b, f"at step {step}")


def evaluate(tmp: Path, ckpt: Path, args: list[str]) -> dict[str, float]:
    proc = run_script(
        "eval.py",
        [
            f"ckpt_path={ckpt}",
            *QUIET[:3],
            "trainer.precision=32-true",
            f"paths.log_dir={tmp / 'eval'}",
            f"paths.cache_dir={tmp / 'cache'}",
            *args,
        ],  # fmt: skip
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("EVAL "))
    return {k: float(v) for k, v in (kv.split("=") for kv in line[5:].split())}


def exported_outputs(directory: Path) -> torch.Tensor:
    """The exported model's outputs on fixed ids, in float64, with the class its config names."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    model = getattr(transformers, config.architectures[0]).from_pretrained(directory).double().eval()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def refusal(proc) -> Optional[str]:
    """The one-sentence refusal of a run that stopped before step 1 (exit 2, one [ERROR] line on stderr, no
    traceback), or None for a run that finished."""
    if proc.returncode == 0:
        return None
    out = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "[ERROR] - " in line]
    assert proc.returncode == 2 and "Traceback" not in out and len(errors) == 1, out[-3000:]
    return errors[0].split("[ERROR] - ", 1)[1]


def one_process(tmp_path_factory, kind: str, objective: str) -> dict:
    """The cell's 1-process run, made once per session: scalars, final weights, checkpoints."""

    def make(tmp: Path) -> dict:
        run, _ = train(tmp, "one", cell_args(kind, objective, tmp))
        ckpts = run / "checkpoints"
        export = tmp / "hf"
        from src.checkpoint.convert import export_hf

        export_hf(ckpts / "last.ckpt", export)
        return {
            "scalars": scalars(run),
            "weights": weights(ckpts / "last.ckpt"),
            "exported": exported_outputs(export),
            # eval.py of its final checkpoint on 2 ranks (train.py's own test read the best checkpoint)
            "evaluated": evaluate(tmp, ckpts / "last.ckpt", ["trainer=ddp", "trainer.devices=2"]),
        }

    return once_per_session(tmp_path_factory, f"matrix-{kind}-{objective}", make)


def documented(text: Optional[str] = None) -> dict[tuple[str, str, str], str]:
    """docs/matrix.md's outcome of each cell: EQUAL, or the sentence that refuses it (its numbered note)."""
    text = (ROOT / "docs" / "matrix.md").read_text() if text is None else text
    notes = dict(re.findall(r"^(\d+)\. (.+)$", text, re.MULTILINE))
    header, outcomes = None, {}
    for line in text.splitlines():
        cells_ = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| data |"):
            header = cells_
        elif header and line.startswith("| ") and not line.startswith("| ---"):
            for strategy, outcome in zip(header[2:], cells_[2:]):
                note = re.fullmatch(r"refused \((\d+)\)", outcome)
                outcomes[(cells_[0], cells_[1], strategy)] = notes[note.group(1)] if note else outcome
    return outcomes


def test_every_cell_has_a_documented_outcome():
    """What test_cell_equals_one_process_through_every_phase holds each cell to: docs/matrix.md names every cell's
    outcome, equal or a refusal's sentence."""
    outcomes = documented()
    assert set(cells()) <= set(outcomes), sorted(set(cells()) - set(outcomes))
    assert all(o == EQUAL or o.endswith(".") for o in outcomes.values()), outcomes
    assert outcomes[("chat-packed", "sft", "pipeline")].startswith("data.packing=true with trainer=pipeline")


def checked_before_any_rank(kind: str, objective: str, strategy: str, tmp: Path, monkeypatch) -> Optional[str]:
    """What train.py's checks before any rank starts (src/run/job.py check_export_and_seed) say of a cell's 2-rank config: None,
    or the sentence that refuses it."""
    from test_configs import compose_cfg

    from src.run.job import check_export_and_seed
    from src.utils.config import ConfigError

    for seeded in (
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
    ):  # check_export_and_seed seeds: the test process gets its own back
        monkeypatch.delenv(seeded, raising=False)
    args = QUIET + [f"paths.cache_dir={tmp / 'cache'}"] + cell_args(kind, objective, tmp) + STRATEGIES[strategy][0]
    cfg = compose_cfg(args, tmp=tmp)  # the cell's 2-rank run, as train() starts it
    try:
        with torch.random.fork_rng():
            check_export_and_seed(cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind,objective,strategy", cells(), ids=["-".join(cell) for cell in cells()])
def test_every_documented_outcome_holds_at_the_checks_before_any_rank(kind, objective, strategy, tmp_path, monkeypatch):
    """docs/matrix.md's outcome of every cell, in the default suite (the full tier alone runs the cells): an `equal`
    cell passes the checks train.py runs before any rank starts, a refused one is refused there with its sentence. A
    cell made refused by mistake (one more entry in an objective's `refused_under`) fails here."""
    expected = documented()[(kind, objective, strategy)]
    sentence = checked_before_any_rank(kind, objective, strategy, tmp_path, monkeypatch)
    if expected == EQUAL:
        assert sentence is None, f"docs/matrix.md says equal, and the checks refuse the cell: {sentence}"
    else:
        assert sentence == expected, f"docs/matrix.md says {expected!r}; the checks said {sentence!r}"


def record(cell: tuple[str, str, str], outcome: str) -> None:
    """TEST_MATRIX_RESULTS=FILE: one JSON line per finished cell, what docs/matrix.md is generated from."""
    path = os.environ.get("TEST_MATRIX_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"cell": list(cell), "outcome": outcome}) + "\n")


def params(cells_: list[tuple[str, str, str]]) -> list:
    return [
        pytest.param(*cell, id="-".join(cell), marks=[] if cell in SAMPLE or ALL else [pytest.mark.skip(reason=(
            "in the full matrix only: TEST_ALL_ARCHITECTURES=1 runs it"))])
        for cell in cells_
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind,objective,strategy", params(cells()))
def test_cell_equals_one_process_through_every_phase(tmp_path, tmp_path_factory, kind, objective, strategy):
    args = cell_args(kind, objective, tmp_path)
    two_ranks, resume_args = STRATEGIES[strategy]
    run, proc = train(tmp_path, "two", args + two_ranks, check=False)
    sentence, expected = refusal(proc), documented().get((kind, objective, strategy))
    if sentence is not None:
        assert not list(tmp_path.glob("two/train/runs/*/checkpoints/*")), "refused after training began"
        record((kind, objective, strategy), sentence)
        assert sentence == expected, f"docs/matrix.md says {expected!r}, and the cell was refused: {sentence}"
        pytest.xfail(f"refused in one sentence, as docs/matrix.md says: {sentence}")
    assert expected == EQUAL, f"docs/matrix.md says {expected!r}, and the cell ran: regenerate docs/matrix.md"
    one = one_process(tmp_path_factory, kind, objective)
    assert one["scalars"]["val/loss" if objective != "grpo" else "val/reward"], "no validation logged"
    ran = scalars(run)
    assert_same_scalars(one["scalars"], ran)  # fit: train and both validations; then test
    assert {t for t in one["scalars"] if t.startswith("test/")}, "no test metric logged"
    last = run / "checkpoints" / "last.ckpt"
    within(max_diff(one["weights"], weights(last)), 1e-5, "final weights")

    # resume the 2-rank run's step-3 checkpoint on 1 process: steps 3-5 and the final weights as 1 process
    (mid,) = (run / "checkpoints").glob("mid_3*")
    resumed, _ = train(tmp_path, "resumed", args + resume_args + [f"ckpt_path={mid}"])
    assert_same_scalars(one["scalars"], scalars(resumed), steps_from=3)
    within(max_diff(one["weights"], weights(resumed / "checkpoints" / "last.ckpt")), 1e-5, "resumed weights")

    # eval.py of the 2-rank checkpoint on 1 process: that of the 1-process checkpoint on 2 ranks, and its validation
    # the 1-process run's last (train.py's own test read the best checkpoint, eval.py reads the last)
    evaluated = evaluate(tmp_path, last, [])
    assert evaluated.keys() == one["evaluated"].keys()
    for tag, value in evaluated.items():
        scale = reward_scale(one["evaluated"]) if "/rewards/" in tag else 1.0
        close(tag, one["evaluated"][tag], value, "from eval.py", scale)
        if tag.startswith("val/"):
            close(tag, one["scalars"][tag][-1][1], value, "from eval.py against fit's last", scale)

    # export-hf of the 2-rank checkpoint: the 1-process model's outputs
    run_script("-m", ["src.tools.checkpoints", "export-hf", str(last), str(tmp_path / "hf")])
    exported = exported_outputs(tmp_path / "hf")
    within((exported - one["exported"]).abs().max().item(), 1e-5 * max(1.0, one["exported"].abs().max().item()),
           "exported outputs")  # fmt: skip
    record((kind, objective, strategy), EQUAL)


def test_every_data_and_objective_option_is_in_the_matrix():
    """A new data option or objective enters the matrix (or is named outside it, with a reason): never silently."""
    kinds = data_kinds()
    covered = (
        {option for option, _ in kinds.values()} | set(NOT_LANGUAGE) | {o for o in options("data") if not language(o)}
    )
    assert covered == set(options("data"))
    assert set(DATA) == set(kinds), "give a new data option its test inputs in DATA"
    assert {objective for _, objective, _ in cells()} == set(options("model/objective"))
    assert SAMPLE <= set(cells())


EQUAL = "equal"  # a cell's outcome: every phase equal to 1 process, or the sentence that refused it


def table(results: dict[tuple[str, str, str], str]) -> str:
    """docs/matrix.md: each cell's outcome, data kind x objective down, strategy across."""
    lines = [
        "# The data x objective x strategy matrix",
        "",
        "Generated by `python -m tests.test_matrix RESULTS.jsonl > docs/matrix.md` from a full run of",
        "`TEST_ALL_ARCHITECTURES=1 TEST_MATRIX_RESULTS=RESULTS.jsonl python -m pytest tests/test_matrix.py`",
        "(tests/test_matrix.py says what a cell runs). **equal**: 2 ranks trained, validated (twice, over an",
        "uneven split), tested, resumed from the step-3 checkpoint on 1 process (ZeRO: on 2), evaluated by eval.py on",
        "1 process and exported, every value within 1e-5 of 1 process (fp32, AdamW's eps at 1e-6: tests/test_matrix.py",
        "says why). A numbered cell was refused before step 1; its sentence is below the table. The default suite runs "
        + ", ".join("-".join(c) for c in sorted(SAMPLE))
        + ".",
        "",
        "| data | objective | " + " | ".join(STRATEGIES) + " |",
        "| --- | --- |" + " --- |" * len(STRATEGIES),
    ]
    sentences: list[str] = []
    rows: dict[tuple[str, str], list[str]] = {}
    for kind, objective, strategy in cells():
        outcome = results.get((kind, objective, strategy))
        if outcome is None:
            text = "not run yet"
        elif outcome == EQUAL:
            text = "equal"
        else:
            if outcome not in sentences:
                sentences.append(outcome)
            text = f"refused ({sentences.index(outcome) + 1})"
        rows.setdefault((kind, objective), []).append(text)
    lines += [f"| {kind} | {objective} | " + " | ".join(texts) + " |" for (kind, objective), texts in rows.items()]
    lines += ["", "Refusals:", ""] + [f"{i}. {sentence}" for i, sentence in enumerate(sentences, 1)]
    return "\n".join(lines) + "\n"


def read_results(path: str) -> dict[tuple[str, str, str], str]:
    results = {}
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        results[tuple(entry["cell"])] = entry["outcome"]
    return results


def test_the_docs_table_lists_every_cell():
    """docs/matrix.md has a row for each (data kind, objective) of the matrix and no cell left unrun."""
    text = (ROOT / "docs" / "matrix.md").read_text()
    for kind, objective, _ in cells():
        assert f"| {kind} | {objective} |" in text, (
            f"docs/matrix.md has no row for {kind} x {objective}: run the matrix"
        )
    assert "not run yet" not in text, "docs/matrix.md has cells not run: run the full matrix and regenerate it"


if __name__ == "__main__":
    print(table(read_results(sys.argv[1])), end="")


@pytest.mark.parametrize("kind", list(data_kinds()))
def test_every_data_kind_has_uneven_evaluation_splits(kind, tmp_path):
    """What a cell's runs walk: val and test splits of an odd number of samples (on 2 ranks one shard gets the
    padding item), and a training epoch of 3 to 5 steps with a tail that does not fill a global batch (6 steps
    cross an epoch's end)."""
    from hydra.utils import instantiate
    from test_configs import compose_cfg

    option, _ = data_kinds()[kind]
    objective = "grpo" if option == "prompts" else "dpo" if option == "preference" else "sft"
    cfg = compose_cfg(cell_args(kind, objective, tmp_path) + [f"paths.cache_dir={tmp_path / 'cache'}"], tmp=tmp_path)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    sizes = {name: len(split) for name, split in datamodule.splits.items()}
    assert sizes["val"] % 2 == 1 and sizes["test"] % 2 == 1, sizes
    assert 3 <= sizes["train"] // 8 <= 5 and sizes["train"] % 8, sizes
