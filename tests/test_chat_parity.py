"""data=chat from 1 device to N: the shared tool-call conversations (ShareGPT, GPT-2's tokenizer, ChatML, the loss on
the assistant's turns), packed and padded, 1 x 8 = DDP 2 x 4 = FSDP2 2 x 4 = ZeRO-2 2 x 4 = 1 x 4 x accumulation 2 (every step's
train/loss and the final parameters within 1e-5, fp32), through train.py as real subprocesses; a mid-epoch
checkpoint of 2 ranks resumed on 1 process ends as the straight run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FULL_MATRIX_ONLY, shared
from test_deepspeed import CPU_DS
from test_fsdp import last_ckpt, train_sharded
from test_parity import assert_same_series, max_param_diff, train
from test_token_loss import tiny_gpt2_without_dropout

from src.checkpoint.convert import load_checkpoint
from tests.helpers.margins import within

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return tiny_gpt2_without_dropout(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """The demo's first 80 conversations (suite time: each rank renders and tokenizes them all at setup)."""
    path = tmp_path_factory.mktemp("chats") / "chats.json"
    path.write_text(json.dumps(json.loads(shared("chat", "glaive_toolcall_en_demo.json").read_text())[:80]))
    return path


def chat_args(pretrained: Path, packing: bool, chats: Path) -> list[str]:
    return [
        "data=chat",
        f"model.pretrained={pretrained}",
        f"data.path={chats}",
        "data.seq_len=512",
        f"data.packing={str(packing).lower()}",
        "data.global_batch_size=8",
        "seed=7",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        "test=false",
        "model.scheduler.num_warmup_steps=1",
        "model.optimizer.lr=1e-2",
    ]


SPLITS = {
    "ddp": ["trainer=ddp", "trainer.devices=2"],
    "fsdp": ["trainer=fsdp", "trainer.devices=2", "trainer.strategy.save_distributed_checkpoint=false"],
    "accumulate": ["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=8"],
    # ZeRO-2 through the tests' CPU DeepSpeed strategy (the tiny GPT-2 has 1 head: no tensor parallel)
    "zero2": [*CPU_DS, "trainer.strategy.stage=2"],
}
CASES = [
    # all in the full matrix (suite time): the default suite's packed chat on 2 DDP ranks is tests/test_matrix.py's
    # sample cell, through validation, test, resume, eval.py and export as well
    pytest.param(packing, split, marks=[FULL_MATRIX_ONLY])
    for packing in (True, False)
    for split in SPLITS
]


@pytest.mark.parametrize(
    "packing,split", CASES, ids=[f"{'packed' if c.values[0] else 'padded'}-{c.values[1]}" for c in CASES]
)
def test_chat_on_n_ranks_matches_one_process(tmp_path, pretrained, chats, reference, packing, split):
    args = chat_args(pretrained, packing, chats)
    one = reference(args)
    if split == "zero2":  # a sharded checkpoint dir, read back whole
        run = train_sharded(tmp_path, split, args + SPLITS[split])
        run["params"] = load_checkpoint(last_ckpt(tmp_path, split))["state_dict"]
    else:
        run = train(tmp_path, split, args + SPLITS[split])
    assert len(one["scalars"]["train/loss"]) == 4
    assert_same_series(one, run, "train/loss", 1e-5)
    within(max_param_diff(one["params"], run["params"]), 1e-5, "params")


MID = (  # a mid-epoch checkpoint at step 2, kept beside last.ckpt
    "+callbacks.mid={_target_:lightning.pytorch.callbacks.ModelCheckpoint,dirpath:${paths.output_dir}/checkpoints,"
    "filename:'mid_{step}',auto_insert_metric_name:false,every_n_train_steps:2,save_top_k:-1,monitor:null}"
)


@FULL_MATRIX_ONLY
def test_packed_chat_resumed_mid_epoch_on_another_rank_count_ends_as_the_straight_run(
    tmp_path, pretrained, chats, reference
):
    """A step-2 checkpoint of 2 ranks resumed on 1 process: steps 2-3 and the final weights as 1 process throughout."""
    args = chat_args(pretrained, True, chats)
    one = reference(args)
    train(tmp_path, "two", args + SPLITS["ddp"] + [MID])
    (mid,) = (tmp_path / "two" / "train" / "runs").glob("*/checkpoints/mid_2.ckpt")
    resumed = train(tmp_path, "resumed", args + [f"ckpt_path={mid}"])
    straight = dict(one["scalars"]["train/loss"])
    steps = [step for step, _ in resumed["scalars"]["train/loss"]]
    assert steps == [2, 3]
    within(max(abs(v - straight[s]) for s, v in resumed["scalars"]["train/loss"]), 1e-5, "train/loss")
    within(max_param_diff(one["params"], resumed["params"]), 1e-5, "params")
