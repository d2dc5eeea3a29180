"""Bad input ends the run with one clear line and exit status 2, never a traceback (src/utils/errors.py).

Each case is tried as a user would: the real train.py / eval.py / checkpoints tool in a subprocess,
without HYDRA_FULL_ERROR, on real (deliberately broken) files. The cases fail before training, so they
are cheap; the DDP case checks that the error is printed once and the job ends in seconds.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, python

FAST = [
    "extras.print_config=false",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "data.global_batch_size=4",
    "data.seq_len=32",
    "model.n_layer=1",
    "callbacks=none",
    "logger=none",
    "trainer.precision=32-true",
]


def run_as_user(args: list[str], timeout: int = 300) -> tuple[int, str, float]:
    """(exit status, stdout + stderr, seconds) of `python *args` as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run([python(), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert "[ERROR]" not in proc.stdout, f"an error on stdout, not stderr:\n{proc.stdout[-3000:]}"
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def assert_one_clear_line(rc: int, out: str, *fragments: str) -> str:
    assert rc == 2, f"exit status {rc}, expected 2:\n{out[-3000:]}"
    assert "Traceback" not in out and '  File "' not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "[ERROR]" in line or line.startswith("error: ")]
    # Under DDP another rank, blocked in a collective when the first exits, may say so before it is stopped (5 s
    # later; on a loaded machine it noticed first): a line that points at the error above, not a second error
    errors = [
        line for line in errors if "another rank exited or was killed (its own error, if any, is above)" not in line
    ]
    assert len(errors) == 1, out[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
    return errors[0]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """Broken inputs a user might pass."""
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_text("")
    (d / "notext").mkdir()
    (d / "notext" / "a.csv").write_text("x,y\n")
    (d / "binary.txt").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4000)))
    (d / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (d / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "oops\n')
    (d / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "x"}\n')
    (d / "tiny.txt").write_text("hi")
    (d / "records.json").write_text(json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c"}]))
    (d / "chats.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}, {"prompt": "x"}]))
    (d / "pairs.json").write_text(
        json.dumps([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}])
    )
    (d / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 20)
    (d / "noprompt.jsonl").write_text('{"prompt": "1+1="}\n{"question": "2+2="}\n')
    (d / "not_a.ckpt").write_text("hello, I am not a checkpoint\n")
    (d / "a_file").write_text("")
    return d


CASES = {  # name: (overrides, fragments the one error line must contain)
    "plus_unknown_top_key": (["+max_step=5"], ["'max_step'", "trainer.max_steps"]),
    "nested_unknown_key": (["+data.seqlen=5"], ["data.seqlen"]),
    "wrong_type": (["data.seq_len=abc"], ["data.seq_len='abc'"]),
    "seq_len_0": (["data.seq_len=0"], ["data.seq_len=0"]),
    "seq_len_negative": (["data.seq_len=-8"], ["data.seq_len=-8"]),
    "global_batch_0": (["data.global_batch_size=0"], ["data.global_batch_size=0"]),
    "val_fraction_1.5": (["data.val_fraction=1.5"], ["data.val_fraction=1.5"]),
    "endless_schedule": (["trainer.max_steps=-1"], ["trainer.max_steps=-1", "trainer.max_epochs"]),
    "negative_lr": (["model.optimizer.lr=-1"], ["model.optimizer.lr=-1"]),
    "heads_do_not_divide": (["model.n_head=3"], ["model.n_head=3"]),
    "compile_loss_yes": (["model.compile_loss=yes"], ["model.compile_loss='yes'", "true, false or auto"]),
    "compile_dropout_yes": (["compile_dropout=yes"], ["compile_dropout='yes'", "true, false or auto"]),
    "missing_path": (["data.path={bad}/missing.txt"], ["missing.txt", "does not exist"]),
    "empty_file": (["data.path={bad}/empty.txt"], ["empty.txt", "empty"]),
    "dir_without_text": (["data.path={bad}/notext"], ["notext", "no .txt or .jsonl"]),
    "binary_txt": (["data.path={bad}/binary.txt"], ["binary.txt: byte 0", "UTF-8"]),
    "latin1_jsonl": (["data.path={bad}/latin1.jsonl"], ["latin1.jsonl: line 2", "UTF-8"]),
    "broken_jsonl": (["data.path={bad}/broken.jsonl"], ["broken.jsonl:2", "malformed JSON"]),
    "missing_field": (["data.path={bad}/nofield.jsonl"], ["nofield.jsonl:2", "data.text_field"]),
    "too_small": (["data.path={bad}/tiny.txt"], ["too few", "data.seq_len"]),
    "bad_record": (["data=instruct", "data.path={bad}/records.json"], ["records.json: record 1", "'output'"]),
    "chat_without_layout": (["data=chat", "data.path={bad}/chats.json"], ["chats.json: record 1 has neither layout"]),
    "dpo_on_text": (["model/objective=dpo"], ["model/objective=dpo", "data=preference"]),
    "grpo_no_prompt": (
        ["data=prompts", "model/objective=grpo", "data.path={bad}/noprompt.jsonl"],
        ["noprompt.jsonl: record 1 has no 'prompt'"],
    ),
    "grpo_reward_not_importable": (
        [
            "data=prompts",
            "model/objective=grpo",
            "data.path={bad}/prompts.jsonl",
            "model.objective.rewards=[{{_target_: nosuch.module.reward, _partial_: true}}]",
        ],
        ["nosuch.module.reward"],
    ),
    "grpo_reward_wrong_length": (
        [
            "data=prompts",
            "model/objective=grpo",
            "data.path={bad}/prompts.jsonl",
            "model.objective.max_new_tokens=2",
            "model.objective.rewards=[{{_target_: tests.helpers.rewards.one_too_few, _partial_: true}}]",
        ],
        ["The reward function one_too_few returned list of length 3 for 4 completions"],
    ),
    "grpo_one_sample": (
        ["data=prompts", "model/objective=grpo", "data.path={bad}/prompts.jsonl", "model.objective.num_generations=1"],
        ["num_generations=1"],
    ),
    "objective_as_a_key": (["model.objective=dpo"], ["model.objective=dpo sets a key", "write model/objective=dpo"]),
    "pair_without_rejected": (
        ["data=preference", "model/objective=dpo", "data.path={bad}/pairs.json"],
        ["pairs.json: record 1", "'rejected'"],
    ),
    "dpo_beta_0": (
        ["data=preference", "model/objective=dpo", "model.objective.beta=0", "data.path={bad}/pairs.json"],
        ["model.objective.beta=0"],
    ),
    "missing_tokenizer": (["data.tokenizer={bad}/no_tokenizer"], ["data.tokenizer=", "no_tokenizer"]),
    "missing_pretrained": (["model.pretrained={bad}/no_model"], ["no_model", "model.pretrained"]),
    "cache_dir_unwritable": (["paths.cache_dir={bad}/a_file/cache"], ["a_file", "paths.cache_dir"]),
    "log_dir_in_a_file": (["paths.log_dir={bad}/a_file/logs"], ["a_file", "paths.log_dir", "not a directory"]),
    "ckpt_missing": (["ckpt_path={bad}/missing.ckpt"], ["ckpt_path=", "missing.ckpt", "does not exist"]),
    "ckpt_not_a_checkpoint": (["ckpt_path={bad}/not_a.ckpt"], ["not_a.ckpt", "not a checkpoint"]),
    "fp16_on_cpu": (["trainer.precision=16-mixed"], ["trainer.precision=16-mixed"]),
    "deepspeed_on_cpu": (["trainer=deepspeed"], ["trainer=deepspeed", "CUDA"]),
    "zero_devices": (["trainer.devices=0"], ["trainer.devices=0"]),
    "lightning_misconfiguration": (["callbacks=default", "logger=none"], ["LearningRateMonitor", "callbacks"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(name: str, bad: Path, tmp_path: Path) -> None:
    if name in ("fp16_on_cpu", "deepspeed_on_cpu"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CPU-only check")
    overrides, fragments = CASES[name]
    args = ["train.py", *FAST, f"paths.log_dir={tmp_path / 'logs'}", f"paths.cache_dir={tmp_path / 'cache'}"]
    rc, out, _ = run_as_user(args + [o.format(bad=bad) for o in overrides])
    assert_one_clear_line(rc, out, *fragments)
    assert not list((tmp_path / "cache").rglob("*.tmp*")), "a failed token-cache build left a partial file"


@pytest.mark.slow
def test_checkpoint_errors_in_eval_and_tool(bad: Path, tmp_path: Path) -> None:
    """eval.py without or with a bad ckpt_path, and the checkpoints tool on a file that is not one."""
    base = ["eval.py", "extras.print_config=false", "logger=none", f"paths.log_dir={tmp_path / 'logs'}"]
    assert_one_clear_line(*run_as_user(base)[:2], "ckpt_path")
    assert_one_clear_line(*run_as_user(base + [f"ckpt_path={bad}/not_a.ckpt"])[:2], "not_a.ckpt", "not a checkpoint")
    rc, out, _ = run_as_user(
        ["-m", "src.tools.checkpoints", "consolidate", str(bad / "not_a.ckpt"), str(tmp_path / "out.ckpt")]
    )
    assert_one_clear_line(rc, out, "not_a.ckpt", "not a checkpoint")


@pytest.mark.slow
def test_ddp_data_error_is_printed_once_and_ends_in_seconds(bad: Path, tmp_path: Path) -> None:
    """A bad record found by rank 0 while rank 1 waits at the prepare_data barrier: one line, exit 2, and no
    wait for a collective timeout (before: ~80 s, then a 60 s reap)."""
    args = [
        "train.py",
        *FAST,
        "trainer=ddp",
        "trainer.precision=32-true",
        f"data.path={bad}/broken.jsonl",
        f"paths.log_dir={tmp_path / 'logs'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
    ]
    rc, out, seconds = run_as_user(args)
    assert_one_clear_line(rc, out, "broken.jsonl:2", "malformed JSON")
    assert seconds < 60, f"took {seconds:.0f} s"


@pytest.mark.slow
def test_multirun_records_each_failed_job_and_goes_on(tmp_path: Path) -> None:
    """In a sweep a bad job fails alone: every job runs, each error is one line, and the summary Hydra
    prints at the end has no traceback."""
    args = [
        "train.py",
        "-m",
        *FAST,
        f"paths.log_dir={tmp_path / 'logs'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=0,-8",
    ]
    rc, out, _ = run_as_user(args)
    assert rc != 0 and "Traceback" not in out and '  File "' not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    assert len(errors) == 2 and "data.seq_len=0 " in errors[0] and "data.seq_len=-8 " in errors[1], out[-3000:]


def test_bugs_keep_their_traceback() -> None:
    """Only user errors are shortened: any other exception propagates unchanged."""
    from src.utils.config import ConfigError
    from src.utils.errors import UserError, translate, user_errors

    with pytest.raises(KeyError):
        with user_errors():
            raise KeyError("a bug")
    wrapped = RuntimeError("Error in call to target")
    wrapped.__cause__ = ConfigError("data.seq_len=0 is not valid")
    assert translate(wrapped) == "data.seq_len=0 is not valid"  # Hydra's instantiate wraps what a target raises
    with pytest.raises(SystemExit) as exit_info:
        with user_errors():
            raise wrapped
    assert exit_info.value.code == 2 and issubclass(ConfigError, UserError)


def test_failed_token_cache_build_leaves_nothing(bad: Path, tmp_path: Path) -> None:
    from src.lm.data.corpus import Corpus, CorpusError
    from src.lm.data.token_cache import load_or_build
    from src.lm.data.tokenizers import ByteTokenizer

    corpus = Corpus.from_config(str(bad / "broken.jsonl"), None, "train", "text")
    with pytest.raises(CorpusError, match="broken.jsonl:2"):
        load_or_build(corpus, ByteTokenizer(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []
