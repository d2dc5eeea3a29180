"""The loss of an optimizer step is the mean over ALL its target tokens (every rank, every accumulation
micro-batch), so padded instruction batches train the same on 1 x 8, 2 x 4 and 1 x 4 x accumulation 2.

A per-micro-batch mean, averaged by DDP and by accumulation, weights a token of a short micro-batch
more than one of a long micro-batch; which tokens share a micro-batch depends on the device count.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ALL, FULL_MATRIX_ONLY, shared
from torch.utils.data import DataLoader

from src.lm.data.instruct import InstructDataModule, pad_collate
from src.lm.data.text import IGNORE_INDEX
from src.parallel.samplers import ResumableDistributedSampler
from tests.helpers.margins import U32, close64, within

# Under pytest-xdist these tests run on one worker: they share module fixtures (runs) that it makes once.
pytestmark = pytest.mark.xdist_group("token_loss")


def instruct_train_set(seq_len: int = 64):
    dm = InstructDataModule(
        str(shared("alpaca", "alpaca_en_demo.json")),
        tokenizer=str(shared("gpt2-tokenizer")),
        seq_len=seq_len,
        global_batch_size=8,
    )
    dm.setup()
    return dm.splits["train"], dm.tokenizer.eos_id


@pytest.mark.parametrize("world,accumulate", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_step_totals_are_the_targets_the_loaders_deliver_on_all_ranks(world, accumulate):
    """The table each rank computes alone equals, step by step, the target tokens that the real
    loaders of all ranks deliver (also in a second epoch and after a mid-epoch resume skip)."""
    dataset, eos = instruct_train_set()
    micro = 2
    for epoch, skip_batches in [(0, 0), (1, 0), (0, 5 * accumulate)]:
        per_rank = []
        for rank in range(world):
            sampler = ResumableDistributedSampler(
                dataset, num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=True
            )
            sampler.set_epoch(epoch)
            sampler.skip = skip_batches * micro
            loader = DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True, collate_fn=pad_collate(eos))
            per_rank.append([int((b["labels"] != IGNORE_INDEX).sum()) for b in loader])
        delivered = np.sum(per_rank, axis=0)  # micro-batch k of every rank together
        steps = [int(delivered[k : k + accumulate].sum()) for k in range(0, len(delivered), accumulate)]
        table = sampler.step_totals(dataset.target_counts(), micro, accumulate, epoch)
        assert steps == table[skip_batches // accumulate :].tolist()
        assert len(set(steps)) > 1  # padded records: the steps do differ in their number of targets


def test_the_shared_order_is_torchs_distributed_sampler_order():
    """step_totals and the loaders read one function, epoch_order; it draws what torch's DistributedSampler
    (shuffle, drop_last) draws, so the resume skip and every rank's share stay as they were."""
    from torch.utils.data import DistributedSampler

    data = list(range(23))
    for world in (1, 3):
        for rank in range(world):
            ours = ResumableDistributedSampler(data, num_replicas=world, rank=rank, seed=5, drop_last=True)
            torchs = DistributedSampler(data, num_replicas=world, rank=rank, seed=5, drop_last=True)
            for epoch in (0, 1):
                ours.set_epoch(epoch), torchs.set_epoch(epoch)
                assert list(ours) == list(torchs)


def tiny_gpt2_without_dropout(tmp: Path) -> Path:
    """tiny-gpt2 with its checkpoint's dropout (0.1) set to 0: each rank draws its own dropout masks,
    so with dropout no device count can match another number for number."""
    path = tmp / "tiny-gpt2"
    shutil.copytree(shared("tiny-gpt2"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """One dropout-free copy for the module: equal paths make equal run args, so the 1 x 8 run that two
    tests compare against is trained once (the `reference` fixture)."""
    return tiny_gpt2_without_dropout(tmp_path_factory.mktemp("pretrained"))


def first_step_token_mean(pretrained: Path, seed: int, global_batch: int) -> float:
    """Σ token losses / Σ targets of the first global batch, computed here without the template's loop."""
    from transformers import GPT2LMHeadModel

    dataset, eos = instruct_train_set()
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    batch = pad_collate(eos)([dataset[int(i)] for i in sampler.epoch_order(0)[:global_batch]])
    model = GPT2LMHeadModel.from_pretrained(pretrained)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    ).item()


def instruct_args(pretrained: Path) -> list[str]:
    return [
        "data=instruct",
        f"model.pretrained={pretrained}",
        f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
        "data.seq_len=64",
        "data.global_batch_size=8",
        "seed=7",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "test=false",
        "model.scheduler.num_warmup_steps=1",
        "model.optimizer.lr=1e-2",
    ]


@pytest.mark.slow
def test_padded_instruction_batches_1x8_equals_2x4_equals_1x4_accumulate_2(tmp_path, pretrained, reference):
    """Full fine-tune of tiny GPT-2 on Alpaca records (padded batches, prompt masked): 1 x 8, DDP 2 x 4 (with
    the compiled token loss in the full matrix), FSDP2 2 x 4 and 1 x 4 x accumulation 2 agree to 1e-5 in final parameters and in the
    logged train/loss at every step, and train/loss is the global batch's token mean. FSDP2 in the full matrix
    (suite time; FSDP2 on DPO's padded pairs, tests/test_dpo.py fsdp_2, stays)."""
    from test_parity import assert_same_series, max_param_diff, train

    args = instruct_args(pretrained)
    one = reference(args)  # shared with the DeepSpeed test below
    # in the full matrix the 2 ranks compile their loss (auto: eager in runs this short), on padded batches of
    # changing length (suite time: compiling takes ~15 s of the test; the compiled loss's own tests stay)
    compiled = ["model.compile_loss=true"] if ALL else []
    two = train(tmp_path, "2x4", args + ["trainer=ddp", "trainer.devices=2"] + compiled)
    acc = train(tmp_path, "1x4x2", args + ["trainer.accumulate_grad_batches=2"])
    others = [two, acc]
    if ALL:
        fsdp = ["trainer=fsdp", "trainer.devices=2", "trainer.strategy.save_distributed_checkpoint=false"]
        others.append(train(tmp_path, "fsdp2x4", args + fsdp))
    for other in others:
        within(max_param_diff(one["params"], other["params"]), 1e-5, "params")
    for other in others:
        assert_same_series(one, other, "train/loss", 1e-5)
    assert len(one["scalars"]["train/loss"]) == 3
    within(abs(one["scalars"]["train/loss"][0][1] - first_step_token_mean(pretrained, 7, 8)), 1e-5, "first loss")
    (log,) = (tmp_path / "2x4" / "train" / "runs").glob("*/train.log")
    assert ("Token loss: compiled (model.compile_loss=true)" in log.read_text()) == ALL


@FULL_MATRIX_ONLY  # suite time, 21 s: DeepSpeed's own accumulation under ZeRO-2 stays (test_deepspeed.py's LitModule with accumulation)
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed package")
def test_deepspeed_with_accumulation_trains_like_one_process(tmp_path, pretrained, reference):
    """DeepSpeed divides the loss by its gradient_accumulation_steps itself, after Lightning already did:
    ZeRO-2 on 2 ranks x 2 x accumulation 2 must still equal 1 x 8 (parameters and train/loss)."""
    from test_deepspeed import CPU_DS
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import assert_same_series, max_param_diff

    from src.checkpoint.convert import load_checkpoint

    args = instruct_args(pretrained)
    one = reference(args)
    ds = train_sharded(
        tmp_path, "ds", args + CPU_DS + ["trainer.strategy.stage=2", "trainer.accumulate_grad_batches=2"]
    )
    within(max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp_path, "ds"))["state_dict"]), 1e-5, "params")
    assert_same_series(one, ds, "train/loss", 1e-5)


@FULL_MATRIX_ONLY  # suite time, 22 s: a resume 2 -> 1 with accumulation (test_resume_anywhere.py) and the padded instruction batches' normaliser (below) stay
@pytest.mark.slow
def test_mid_epoch_resume_with_accumulation_keeps_each_step_normaliser(tmp_path):
    """Stopped on 2 DDP ranks after 3 of an epoch's 6 optimizer steps (12 micro-batches, accumulation 2), resumed
    on 1 process to 8 steps (so into the next epoch): the same parameters and train/loss as 8 steps straight on 1
    process. Each step's token count is looked up by batch index, which must continue where the checkpoint left
    off, whatever the number of ranks (instruction data, whose token counts vary by batch)."""
    from test_parity import assert_same_series, max_param_diff, train

    pretrained = tiny_gpt2_without_dropout(tmp_path)
    args = [
        "data=instruct",
        f"model.pretrained={pretrained}",
        f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
        "data.seq_len=64",
        "data.global_batch_size=8",
        "trainer.accumulate_grad_batches=2",
        "trainer.limit_train_batches=12",
        "trainer.val_check_interval=12",
        "trainer.limit_val_batches=1",
        "test=false",
        "model.scheduler=null",
        "model.optimizer.lr=1e-2",
        "optimized_metric=train/loss",
        "callbacks.last_checkpoint.every_n_train_steps=1",
    ]
    train(tmp_path, "first", args + ["trainer.max_steps=3", "trainer=ddp", "trainer.devices=2"])
    (run,) = (tmp_path / "first" / "train" / "runs").iterdir()
    resumed = train(
        tmp_path, "resumed", args + ["trainer.max_steps=8", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"]
    )
    straight = train(tmp_path, "straight", args + ["trainer.max_steps=8"])
    within(max_param_diff(resumed["params"], straight["params"]), 1e-5, "params")  # 2 ranks sum in another order
    straight["scalars"]["train/loss"] = straight["scalars"]["train/loss"][3:]  # the resumed run logs steps 3..7
    assert_same_series(resumed, straight, "train/loss", 1e-5)


def test_compiled_token_loss_is_the_eager_one_and_auto_compiles_it_for_long_runs():
    """model.compile_loss: the torch.compile'd loss gives the eager sums and gradients (fp32 logits, and bf16 ones
    as autocast makes them); auto compiles it where model.compile is on, or on a CPU from AUTO_MIN_LOGITS logits over
    the run; a bad value is one sentence.

    The tolerances. In float64 the two are one function (FLOAT64_TOL). In fp32 (bf16 logits are upcast exactly
    first) inductor fuses and reorders the reductions, so each side rounds its own way: a token's log-sum-exp adds
    V exponentials (relative error <= V U32 of the sum, so <= V U32 in log z, absolute), the sum over n targets
    adds n U32 of sum |loss|, and each probability exp(z - log z) of the gradient carries log z's error (p <= 1).
    So |Δ sum| <= n V U32 + n U32 sum|loss| and |Δ grad| <= (V + 2) U32: worst cases, 4e-4 and 1.8e-5 here, of
    which 2 % and 0.25 % were seen (docs/testing.md). A softmax left in bf16 (no upcast) misses them by 460 and 27
    times."""
    from src.lm.objectives.loss import AUTO_MIN_LOGITS, summed_token_loss, token_loss_function
    from src.utils.config import ConfigError

    cpu = torch.device("cpu")
    compiled = token_loss_function("auto", AUTO_MIN_LOGITS, cpu)
    assert compiled is not summed_token_loss  # what torch.compile returned
    assert token_loss_function(True, 0, cpu) is not summed_token_loss
    for eager in ("auto", False):
        assert token_loss_function(eager, AUTO_MIN_LOGITS - 1, cpu) is summed_token_loss
    assert token_loss_function("auto", float("inf"), torch.device("meta")) is summed_token_loss  # not a CPU
    # with model.compile on, auto compiles the loss on any device, whatever the run's length
    assert token_loss_function("auto", 0, torch.device("meta"), model_compiled=True) is not summed_token_loss
    assert token_loss_function(False, 0, cpu, model_compiled=True) is summed_token_loss
    with pytest.raises(ConfigError, match=r"model.compile_loss='yes': use true, false or auto\."):
        token_loss_function("yes", 0, cpu)

    labels = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    labels[0, :4] = IGNORE_INDEX  # a masked prompt
    n, V = (labels != IGNORE_INDEX).sum().item(), 300
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        logits = {}
        sums = {}
        for name, fn in (("eager", summed_token_loss), ("compiled", compiled)):
            logits[name] = torch.randn(3, 7, V, generator=torch.Generator().manual_seed(1)).to(dtype)
            logits[name].requires_grad_()
            sums[name] = fn(logits[name], labels)
            sums[name][0].backward()
        assert sums["compiled"][1] == sums["eager"][1] == n
        (compiled_sum, _), (eager_sum, _) = sums["compiled"], sums["eager"]
        if dtype == torch.float64:
            close64(compiled_sum, eager_sum, "loss sum")
            close64(logits["compiled"].grad, logits["eager"].grad, "gradient")
            continue
        within((compiled_sum - eager_sum).abs().item(), n * V * U32 + n * U32 * eager_sum.abs().item(), f"sum {dtype}")
        grad_diff = (logits["compiled"].grad.double() - logits["eager"].grad.double()).abs().max().item()
        within(grad_diff, (V + 2) * U32, f"gradient {dtype}")


@FULL_MATRIX_ONLY  # suite time, 15 s: auto's threshold over the run stays (test_compiled_token_loss_is_the_eager_one_and_auto_compiles_it_for_long_runs)
@pytest.mark.slow
def test_auto_compiles_the_loss_of_a_run_whose_logits_reach_the_threshold(tmp_path):
    """compile_loss=auto in a real run: 8 x 256 tokens x GPT-2's 50257 x 20 steps = 2.06e9 logits, just above
    AUTO_MIN_LOGITS (19 steps would be below), so train.py compiles the loss; the run's train.log says which.
    The run stops after its first step: the decision is taken at the first loss, from trainer.max_steps."""
    from conftest import path_overrides, run_script
    from test_parity import QUIET

    from src.lm.objectives.loss import AUTO_MIN_LOGITS

    assert 8 * 256 * 50257 * 19 < AUTO_MIN_LOGITS <= 8 * 256 * 50257 * 20
    run_script(
        "train.py",
        QUIET
        + path_overrides({"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"})
        + [
            f"data.tokenizer={shared('gpt2-tokenizer')}",
            "data.path=" + str(Path(__file__).parent / "data" / "tiny_corpus.txt"),
            "data.seq_len=256",
            "data.global_batch_size=8",
            "model.n_layer=1",
            "model.n_embd=16",
            "model.n_head=2",
            "trainer.max_steps=20",
            "trainer.limit_val_batches=0",
            "test=false",
            "+callbacks.stop._target_=tests.helpers.callbacks.StopAfterFirstStep",
        ],
    )
    (log,) = (tmp_path / "logs" / "train" / "runs").glob("*/train.log")
    assert "Token loss: compiled (model.compile_loss=auto)" in log.read_text()
