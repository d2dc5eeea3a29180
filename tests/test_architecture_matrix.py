"""Every causal LM transformers ships with both plans, under trainer=fsdp, trainer=tp and trainer=pipeline on 2 ranks
(and each MoE model's experts split over the 2, expert_parallel_size=2), against 1 process, through train.py: built at a CPU size from its own config defaults (tests/helpers/
architectures.py), 2 steps, fp32. Each case ends equal (every step's loss and the final parameters within 1e-5) or
refused in one sentence before step 1 (exit 2); a crash or a different model fails the test. An architecture that
does not build or train in one process at that size is skipped with the reason.

The default suite runs MATRIX_SAMPLE's cases; TEST_ALL_ARCHITECTURES=1 runs every architecture under each.
TEST_MATRIX_RECORD=FILE appends each outcome as a JSON line; `python -m tests.helpers.matrix FILE` prints the table
docs/models.md carries."""

from __future__ import annotations

import json
import os

import pytest
import transformers
from conftest import ROOT, once_per_session, path_overrides, run_script
from test_errors import assert_one_clear_line
from test_fsdp import last_ckpt
from test_parity import QUIET, max_param_diff

from src.checkpoint.convert import load_checkpoint
from tests.helpers.architectures import SAMPLE, tiny_config, too_large, with_both_plans, with_ep_plan

pytestmark = pytest.mark.slow

RUN = [
    "model=causal_lm",
    "data.path=tests/data/tiny_corpus.txt",
    "data.seq_len=32",
    "data.global_batch_size=8",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "test=false",
    "model.scheduler.num_warmup_steps=1",
]
STRATEGIES = {
    "fsdp": ["trainer=fsdp", "trainer.devices=2"],
    "tp": ["trainer=tp", "trainer.devices=2", "trainer.strategy.tensor_parallel_size=2"],
    # 2 stages of 1 layer; the pipeline clips in its own step, by the same norm as one process
    "pipeline": ["trainer=pipeline", "trainer.devices=2", "trainer.gradient_clip_val=null"],
    # MoE models (an expert-parallel plan): each expert on 1 of the 2 ranks, tokens sent to it and back
    "experts": ["trainer=fsdp", "trainer.devices=2", "trainer.strategy.expert_parallel_size=2"],
}
# The default suite's sample (the suite's time budget): families whose forward differs from Llama's in what each
# strategy must keep (see tests/helpers/architectures.py). Qwen3 (per-head norms), Phi-3 (fused projections) and
# Gemma3 (scaled embeddings, per-layer rotary) under all three; Gemma2 (soft-capping), Cohere (logit scale,
# parallel blocks) and GPT-NeoX (partial rotary) as pipeline stages, the strategy that computed another function
# for them. Granite (granite-3's multipliers) and Mixtral (its aux loss) run in tests/test_architectures_parity.py.
# For suite time, each of the three under one strategy, the others in the full matrix: Qwen3 under tp (its
# per-head norms on sharded heads), Phi-3 under tp (fused projections split), Gemma3 under FSDP2 (a buffer no
# checkpoint stores, built on the meta device) and as pipeline stages.
MATRIX_SAMPLE = {"qwen3": ["tp"], "phi3": ["tp"], "gemma3_text": ["fsdp", "pipeline"]}
MATRIX_SAMPLE |= {"gemma2": ["pipeline"], "cohere": ["pipeline"], "gpt_neox": ["pipeline"]}
ALL = os.environ.get("TEST_ALL_ARCHITECTURES") == "1"
CASES = (
    [(a, s) for a in with_both_plans() for s in STRATEGIES if s != "experts"] + [(a, "experts") for a in with_ep_plan()]
    if ALL
    else [(a, s) for a, strategies in MATRIX_SAMPLE.items() for s in strategies]
)
assert set(MATRIX_SAMPLE) <= set(SAMPLE)


def overrides(model_type: str) -> list[str]:
    """`model_type` at the tests' CPU size with 2 layers, as train.py overrides: the vocabulary is the tokenizer's."""
    config = tiny_config(model_type, layers=2)
    defaults = transformers.AutoConfig.for_model(model_type).to_dict()
    mine = config.to_dict()
    changed = {k: v for k, v in mine.items() if k in defaults and v != defaults[k] and k != "vocab_size"}
    return ["model.model_type=" + model_type] + [f"+model.config.{k}={hydra_value(v)}" for k, v in changed.items()]


def hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a sub-config (rope_parameters per layer type, an encoder's config)
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and not value.replace("_", "").replace(".", "").isalnum():
        return "'" + value.replace("'", "\\'") + "'"
    return str(value)


def record(arch: str, strategy: str, outcome: str, detail: str) -> None:
    path = os.environ.get("TEST_MATRIX_RECORD")
    if path:
        row = {"arch": arch, "strategy": strategy, "outcome": outcome, "detail": detail}
        with open(path, "a") as f:
            f.write(json.dumps({**row, "transformers": transformers.__version__}) + "\n")


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """Each architecture's 1-process run (trained once per session, for all xdist workers), or the reason it
    cannot be."""
    runs: dict[str, dict | str] = {}

    def make(arch: str, tmp) -> dict | str:
        try:
            reason = too_large(tiny_config(arch, layers=2))
        except Exception as error:  # noqa: BLE001 - the reason is the skip's
            reason = f"its config does not build at a tiny size: {error}"
        if reason:
            return reason
        dirs = {"log_dir": tmp / "one", "cache_dir": tmp / "cache"}
        proc = run_script("train.py", QUIET + path_overrides(dirs) + RUN + overrides(arch), check=False)
        if proc.returncode:
            return "one process fails at a tiny size: " + last_line(proc)
        (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
        from conftest import read_events

        losses = [e.value for e in read_events(run / "tensorboard").Scalars("train/loss")]
        return {
            "losses": losses,
            "params": {"state_dict": load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]},
        }

    def get(arch: str) -> dict | str:
        if arch not in runs:
            runs[arch] = once_per_session(tmp_path_factory, f"matrix-one-{arch}", lambda tmp: make(arch, tmp))
        return runs[arch]

    return get


COLUMNS = {
    "trainer=fsdp": "fsdp",
    "trainer=tp": "tp",
    "trainer=pipeline": "pipeline",
    "expert_parallel_size=2": "experts",
}


def documented(text: str | None = None) -> dict[tuple[str, str], str]:
    """docs/models.md's outcome of each (architecture, strategy): "equal", "refused: <its sentence, shortened>", or
    why it was not run; a blank cell is not listed."""
    text = (ROOT / "docs" / "models.md").read_text() if text is None else text
    header, outcomes = None, {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("| architecture |"):
            header = [COLUMNS.get(cell) for cell in cells]
        elif header and line.startswith("| ") and not line.startswith("| ---"):
            outcomes |= {
                (cells[0], strategy): cell for strategy, cell in zip(header[1:], cells[1:]) if strategy and cell
            }
        elif header and not line.strip():
            header = None
    return outcomes


def test_the_default_sample_is_documented_equal():
    """The cases the default suite runs are held to docs/models.md (the test below): each is documented equal."""
    outcomes = documented()
    assert {(a, s): outcomes.get((a, s)) for a, strategies in MATRIX_SAMPLE.items() for s in strategies} == {
        (a, s): "equal" for a, strategies in MATRIX_SAMPLE.items() for s in strategies
    }
    assert outcomes[("qwen3_5_moe_text", "tp")].startswith("refused: trainer=tp cannot split qwen3_5_moe_text")


def last_line(proc) -> str:
    lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit {proc.returncode}"


@pytest.mark.parametrize("arch,strategy", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_each_architecture_trains_the_same_model_under_each_strategy_or_is_refused(
    tmp_path, one_process, arch, strategy
):
    one, expected = one_process(arch), documented().get((arch, strategy))
    if isinstance(one, str):
        record(arch, strategy, "unbuilt", one)
        assert expected != "equal", f"docs/models.md says {arch} under {strategy} is equal; now {one}"
        pytest.skip(f"{arch}: {one}"[:300])
    dirs = {"log_dir": tmp_path / strategy, "cache_dir": tmp_path / "cache"}
    args = QUIET + path_overrides(dirs) + RUN + overrides(arch) + STRATEGIES[strategy]
    proc = run_script("train.py", args, check=False, env={"HYDRA_FULL_ERROR": "0"})  # as a user sees an error
    if proc.returncode == 2:  # a user error: one sentence, before step 1
        line = assert_one_clear_line(proc.returncode, proc.stdout + proc.stderr)
        sentence = line.split("[ERROR] - ", 1)[-1]
        record(arch, strategy, "refused", sentence)
        assert expected != "equal", f"docs/models.md says {arch} under {strategy} is equal; it was refused: {sentence}"
        return
    assert proc.returncode == 0, f"{arch} under trainer={strategy} crashed:\n{proc.stderr[-4000:]}"
    run = train_sharded_result(tmp_path, strategy)
    loss_gap = max(abs(a - b) for a, b in zip(one["losses"], run["losses"]))
    param_gap = max_param_diff(one["params"]["state_dict"], run["params"])
    record(
        arch, strategy, "equal" if max(loss_gap, param_gap) <= 1e-5 else "DIFFERENT", f"{loss_gap:.1e} {param_gap:.1e}"
    )
    assert len(run["losses"]) == len(one["losses"]) == 2
    assert loss_gap <= 1e-5 and param_gap <= 1e-5, (arch, strategy, loss_gap, param_gap)


def train_sharded_result(tmp_path, strategy: str) -> dict:
    from conftest import read_events

    (run,) = (tmp_path / strategy / "train" / "runs").iterdir()
    ea = read_events(run / "tensorboard")
    losses = [e.value for e in ea.Scalars("train/loss")]
    return {"losses": losses, "params": load_checkpoint(last_ckpt(tmp_path, strategy))["state_dict"]}
