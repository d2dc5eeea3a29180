"""The module a user brings: plain Lightning code (tests/helpers/plain_lightning.py, written as Lightning's docs teach,
nothing of this template) trains and reports on 2 ranks what it does on 1, or is refused in one sentence before any
rank starts; the parity tool that proves it (`python -m src.tools.parity`) also catches what is not exact.

What each run guards (each fails without its fix, tried): every rank reading every sample (val/n 114 for 57 rows);
`self.log` without sync_dist logging rank 0's value; a torchmetrics accuracy logged each step as rank 0's batch's
(train/acc 0.625 against 0.531 at step 0); Lightning's integer division of a synced mean's batch sizes
(57 rows on 2 ranks counted as 28); nn.Dropout drawing from each rank's generator.
"""

from __future__ import annotations

import copy
import re
import subprocess

import numpy as np
import pytest
import torch
from conftest import FULL_MATRIX_ONLY, ROOT, python, run_script
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from src.core import plain_loaders as plain
from src.parallel import samplers
from src.utils.config import ConfigError
from tests.helpers.plain_lightning import write_configs


def parity(tmp_path, *args: str, check: bool = True, steps: int = 12) -> subprocess.CompletedProcess:
    conf = write_configs(tmp_path / "conf")
    return run_script(
        "-m", ["src.tools.parity", "--steps", str(steps), f"hydra.searchpath=[file://{conf}]", *args], check=check
    )


def values(report: str) -> dict[str, float]:
    """The parity report's last value (1 process) of each logged value."""
    rows = re.findall(r"^(\S+)\s+\d+\s+(\S+)\s+\S+\s+\S+$", report, re.MULTILINE)
    return {name: float(last) for name, last in rows if name != "value"}


@pytest.mark.slow
def test_plain_lightning_code_is_exact_on_2_ranks(tmp_path):
    """BatchNorm (SyncBatchNorm on 2 ranks), dropout, gradient accumulation, torchmetrics accuracy, `self.log` with
    and without sync_dist, a count with reduce_fx="sum", 57 validation rows (uneven shards): equal, each row once."""
    proc = parity(tmp_path, "experiment=plain", "trainer=ddp", "model.dropout=0.1", "trainer.accumulate_grad_batches=2")
    assert "equal on 1 process and N ranks" in proc.stdout, proc.stdout + proc.stderr
    logged = values(proc.stdout)
    assert logged["val/n"] == 57.0, logged  # each validation row counted once, on 1 process as on 2 ranks
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"} <= logged.keys(), logged


@pytest.mark.slow
def test_parity_names_the_first_value_that_differs(tmp_path):
    """A value logged with sync_dist=False said out loud is rank 0's own (Lightning's default, kept when asked for): the
    tool exits 1 naming the value and the step."""
    proc = parity(tmp_path, "experiment=plain", "trainer=ddp", "model.rank_own=true", check=False, steps=2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"parity: train/loss_here differs at step 0: .* on N ranks, .* on 1 process", proc.stderr), (
        proc.stderr
    )


@pytest.mark.slow
def test_a_training_step_drawing_its_own_random_numbers_is_refused_on_n_ranks(tmp_path):
    """Noise from torch.randn_like in the module's forward: one sentence naming it on 2 ranks, before any optimizer
    step (the 1-process run trains)."""
    conf = write_configs(tmp_path / "conf")
    args = [f"hydra.searchpath=[file://{conf}]", "experiment=plain", "model.noise=0.5", "trainer.max_steps=2"]
    one = run_script("train.py", [*args, f"paths.log_dir={tmp_path / 'one'}"])
    assert one.returncode == 0
    two = run_script(
        "train.py",
        [*args, "trainer=ddp", f"paths.log_dir={tmp_path / 'two'}"],
        check=False,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert two.returncode == 2, two.stdout[-3000:] + two.stderr[-3000:]
    assert "PlainMLP's training step draws random numbers of its own (randn_like)" in two.stderr, two.stderr
    assert "Traceback" not in two.stderr
    assert not list((tmp_path / "two").rglob("*.ckpt"))  # nothing trained, nothing saved


@pytest.mark.slow
def test_a_lit_module_without_blocks_trains_under_fsdp2_as_one_unit():
    """The worked example with no hidden block (model.hidden=[]: blocks() is empty) under FSDP2 with accumulation:
    the whole network is one FSDP2 unit, and 2 ranks equal 1 process (it was "returned no blocks to shard")."""
    args = [
        "--steps",
        "6",
        "experiment=mlp_table",
        "trainer=fsdp",
        "model.hidden=[]",
        "trainer.accumulate_grad_batches=2",
    ]
    proc = run_script("-m", ["src.tools.parity", *args], check=False)
    assert proc.returncode == 0 and "equal on 1 process and N ranks" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args,sentence",
    [
        (["experiment=convnet_digits", "trainer=tp"], "trainer=tp splits transformers decoder LMs only"),
        (["experiment=convnet_digits", "trainer=pipeline"], "trainer=pipeline splits transformers decoder LMs only"),
        (["experiment=plain", "trainer=fsdp"], "trainer=fsdp shards the model through src/core/module.py's LitModule"),
    ],
    ids=["convnet-tp", "convnet-pipeline", "plain-fsdp"],
)
def test_a_strategy_the_module_cannot_take_is_one_sentence_before_any_rank(tmp_path, args, sentence):
    conf = write_configs(tmp_path / "conf")
    proc = run_script(
        "train.py",
        [f"hydra.searchpath=[file://{conf}]", f"paths.log_dir={tmp_path / 'logs'}", *args],
        check=False,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sentence in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # no rank started


@pytest.mark.parametrize(
    "args,sentence",
    [
        (
            ["trainer=ddp", "data.batch_size=31"],
            "data.batch_size=31, the batch of PlainTable.train_dataloader(), does not divide over 2 ranks "
            "(trainer.devices=2 x trainer.num_nodes=1): make it a multiple of 2",
        ),
        (["debug=overfit"], "data.overfit_batches=4 (debug=overfit) deals the first batches of the template's"),
    ],
    ids=["batch-31-on-2-ranks", "overfit"],
)
def test_a_plain_datamodules_config_it_cannot_run_is_one_sentence_before_any_rank(tmp_path, args, sentence):
    """The plain loader's batch the ranks do not divide (it was refused on each rank, after they started), and
    debug=overfit, whose data.overfit_batches a plain LightningDataModule does not take (it was "Unknown config key
    'data.overfit_batches'", without a why)."""
    conf = write_configs(tmp_path / "conf")
    proc = run_script(
        "train.py",
        [f"hydra.searchpath=[file://{conf}]", f"paths.log_dir={tmp_path / 'logs'}", "experiment=plain", *args],
        check=False,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sentence in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # no rank started


def test_the_plain_checks_before_any_rank_refuse_only_what_cannot_run(tmp_path):
    """What plain.check_config lets through: a batch the ranks divide, any batch on 1 process, a device count known
    only when the ranks start, and the template's datamodules (debug=overfit is theirs)."""
    import shutil

    from test_configs import CONF, compose_cfg

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    write_configs(conf)
    for args in (["trainer=ddp", "data.batch_size=32"], ["data.batch_size=31"], ["trainer=ddp", "trainer.devices=auto",
                 "data.batch_size=31"], ["debug=overfit", "experiment=mlp_table", "trainer=ddp"]):  # fmt: skip
        overrides = args if "experiment=mlp_table" in args else ["experiment=plain", *args]
        plain.check_config(compose_cfg(overrides, tmp=tmp_path, conf=conf))
    with pytest.raises(ConfigError, match=r"^data\.batch_size=31, the batch of PlainTable\.train_dataloader\(\)"):
        plain.check_config(
            compose_cfg(["experiment=plain", "trainer=ddp", "data.batch_size=31"], tmp=tmp_path, conf=conf)
        )


def loader_refusal(loader: DataLoader) -> str:
    with pytest.raises(ConfigError) as error:
        plain.check_rebuildable(loader, "Table.train_dataloader()")
    return str(error.value)


def test_loaders_that_cannot_be_dealt_to_ranks_are_refused():
    data = TensorDataset(torch.arange(10.0), torch.arange(10))

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    weights = WeightedRandomSampler(torch.ones(10), num_samples=10)
    assert "IterableDataset" in loader_refusal(DataLoader(Stream(), batch_size=2))
    assert "a sampler of its own (WeightedRandomSampler)" in loader_refusal(
        DataLoader(data, batch_size=2, sampler=weights)
    )
    assert "a batch sampler of its own (list)" in loader_refusal(DataLoader(data, batch_sampler=[[0, 1], [2, 3]]))
    assert "with replacement" in loader_refusal(DataLoader(data, batch_size=2, sampler=torch.utils.data.RandomSampler(data, replacement=True)))  # fmt: skip
    assert "DataLoader subclass" in loader_refusal(type("MyLoader", (DataLoader,), {})(data, batch_size=2))
    plain.check_rebuildable(DataLoader(data, batch_size=2, shuffle=True), "ok")  # the plain one passes


def test_a_train_batch_that_does_not_divide_over_the_ranks_is_refused(monkeypatch):
    monkeypatch.setattr(plain, "rank_and_world", lambda trainer: (0, 4))
    make = lambda: DataLoader(TensorDataset(torch.arange(40.0)), batch_size=30, shuffle=True)  # noqa: E731
    with pytest.raises(ConfigError, match=r"has batch_size=30, which does not divide over 4 ranks: make it a multiple"):
        plain.sharded(make, type("Table", (), {"trainer": None})(), "train", 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_even_batches_deal_every_sample_once_in_as_many_batches_on_every_rank(world):
    for n in range(world, 40):
        longest, shortest = -(-n // world), n // world
        for batch in range(1, 9):
            ranks = []
            for rank in range(world):
                ranks.append(list(samplers.EvenBatches(n, batch, (rank, world))))
            assert len({len(r) for r in ranks}) == 1, (n, batch, world)  # every rank as many batches
            dealt = [i for r in ranks for b in r for i in b]
            assert sorted(dealt) == list(range(n)), (n, batch, world)  # each sample once
            largest = max(batch, -(-longest // shortest))  # one batch per sample of the shortest shard at most
            assert all(0 < len(b) <= largest for r in ranks for b in r), (n, batch, world)
            assert len(ranks[0]) == min(-(-longest // batch), shortest)  # no more batches than needed
    with pytest.raises(ConfigError, match=f"cannot give each of {world + 1} ranks at least one"):
        samplers.EvenBatches(world, 4, (0, world + 1))


def test_the_train_sampler_tells_which_samples_a_batch_holds():
    """What keys the dropout masks: batch k's dataset indices, as each rank's sampler deals them; together the ranks'
    batch k is the 1-process run's batch k."""
    data = list(range(50))

    def batches(world: int, rank: int, size: int) -> list[list[int]]:
        sampler = samplers.ResumableDistributedSampler(data, num_replicas=world, rank=rank, seed=3, drop_last=True)
        sampler.set_epoch(1)
        dealt = [sampler.batch(k, size).tolist() for k in range(len(sampler) // size)]
        assert [i for b in dealt for i in b] == list(sampler)[: len(dealt) * size]  # what the loader reads
        return dealt

    one = batches(1, 0, 4)
    two = list(zip(batches(2, 0, 2), batches(2, 1, 2)))
    assert [sorted(a + b) for a, b in two] == [sorted(b) for b in one]
    assert np.array_equal(samplers.train_sampler(data, 0, (0, 1), shuffle=False).batch(2, 4), [8, 9, 10, 11])


def test_the_parity_tool_refuses_a_failed_run_with_exit_2(tmp_path):
    proc = subprocess.run(
        [python(), "-m", "src.tools.parity", "--steps", "2", "experiment=nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "parity: train.py experiment=nosuch" in proc.stderr, proc.stderr


def test_the_throughput_callback_counts_any_batch():
    """A user's dict batch with keys of its own (it raised KeyError: 'input_ids'), a tuple, and the LM's tokens."""
    from src.callbacks.throughput import _batch_size, _num_items

    rows = {"features": torch.zeros(5, 3), "target": torch.zeros(5)}
    assert _batch_size(rows) == 5 and _num_items(rows) == 5
    assert _batch_size((torch.zeros(4, 2), torch.zeros(4))) == 4
    tokens = {"input_ids": torch.zeros(2, 7), "attention_mask": torch.ones(2, 7)}
    assert _batch_size(tokens) == 2 and int(_num_items(tokens)) == 14


ENCODERS = ["bert", "roberta", "distilbert", "electra", "deberta-v2", "modernbert", "vit"]


def encoder(kind: str, p: float = 0.1) -> torch.nn.Module:
    """A tiny transformers classifier of `kind` with every dropout of its config at p, in float64."""
    import transformers

    from tests.helpers.plain_lightning import encoder_sizes

    torch.manual_seed(0)
    if kind == "vit":
        sizes = {k: v for k, v in encoder_sizes("bert").items() if k != "max_position_embeddings"}
        config = transformers.ViTConfig(**sizes, image_size=8, patch_size=4, num_channels=1, num_labels=3)
    else:
        config = transformers.AutoConfig.for_model(kind, **encoder_sizes(kind), vocab_size=60, num_labels=3)
    for field in vars(config):
        if "dropout" in field and isinstance(getattr(config, field), float):
            setattr(config, field, p)
    auto = (
        transformers.AutoModelForImageClassification
        if kind == "vit"
        else transformers.AutoModelForSequenceClassification
    )
    return auto.from_config(config).double().train()  # SDPA where the family has it


@pytest.mark.parametrize("kind", ENCODERS)
def test_a_transformers_models_own_dropouts_are_keyed_by_sample(kind):
    """Hidden, attention (SDPA's dropout_p, eager attention's F.dropout) and classifier dropout of an encoder a user's
    module holds: the logits of a training forward depend on each row's key only, not on torch's generator or on
    which rows share the batch (2 rows + 2 rows = 4 rows: what 2 ranks and 1 process compute), in float64."""
    from src.core import dropout as keyed

    model = encoder(kind)
    inputs = torch.randn(4, 1, 8, 8, dtype=torch.float64) if kind == "vit" else torch.randint(3, 60, (4, 10))
    name = "pixel_values" if kind == "vit" else "input_ids"
    keys = keyed.row_keys(torch.arange(4), 4, step=3, seed=0)

    def logits(rows: slice, generator_seed: int) -> torch.Tensor:
        torch.manual_seed(generator_seed)
        keyed.set_keys(keys[rows])
        return model(**{name: inputs[rows]}).logits

    unkeyed = [logits(slice(0, 4), seed) for seed in (1, 2)]
    assert not torch.equal(*unkeyed)  # torch's generator: another mask for another state (what keying removes)
    assert keyed.key_module(model) > 0
    whole = logits(slice(0, 4), 1)
    assert torch.equal(whole, logits(slice(0, 4), 2)), kind  # no draw from the generator is left
    halves = torch.cat([logits(slice(0, 2), 3), logits(slice(2, 4), 4)])
    torch.testing.assert_close(halves, whole, rtol=1e-12, atol=1e-12)  # a row's mask does not depend on its batch
    with torch.no_grad():
        assert not torch.allclose(model.eval()(**{name: inputs}).logits, whole)  # the dropouts do drop in training
    keyed.set_keys(None)


@pytest.mark.parametrize("kind", ENCODERS)
def test_a_keyed_training_forward_computes_the_models_own_function(kind):
    """Every dropout at 1e-12 (no element dropped, the keyed path taken): a keyed training forward equals the model's
    own evaluation forward with its eager attention (the function keyed attention runs) in float64. A mask the keyed attention adds of its own (a causal one on an encoder's
    unpadded batch) or a dropped residual would move the logits by orders of magnitude more."""
    from src.core import dropout as keyed

    model = encoder(kind, p=1e-12)
    reference = copy.deepcopy(model)  # its own eager attention (whose softmax some families take in float32)
    if reference.config._attn_implementation != "eager":
        reference.set_attn_implementation("eager")
    keyed.key_module(model)
    inputs = torch.randn(3, 1, 8, 8, dtype=torch.float64) if kind == "vit" else torch.randint(3, 60, (3, 10))
    name = "pixel_values" if kind == "vit" else "input_ids"
    keyed.set_keys(keyed.row_keys(torch.arange(3), 3, step=0, seed=0))
    trained = model.train()(**{name: inputs}).logits
    keyed.set_keys(None)
    with torch.no_grad():
        evaluated = reference.eval()(**{name: inputs}).logits
    torch.testing.assert_close(trained.detach(), evaluated, rtol=1e-9, atol=1e-9)


def test_attention_that_drops_inside_its_kernel_is_one_sentence():
    from src.core import dropout as keyed

    model = encoder("bert")
    model.config._attn_implementation = "flash_attention_2"  # what a CUDA user may build; its kernel draws the mask
    with pytest.raises(
        ConfigError, match=r"draws its attention dropout inside its kernel .* attn_implementation='sdpa'"
    ):
        keyed.key_module(model)


@pytest.mark.slow
def test_a_plain_module_around_a_transformers_encoder_with_its_dropouts_is_exact_on_2_ranks(tmp_path):
    """BERT in a plain LightningModule, hidden and attention dropout 0.1, SDPA, AdamW: it was refused at the first
    training step ("draws random numbers of its own (scaled_dot_product_attention)")."""
    proc = parity(tmp_path, "experiment=plain_encoder", "trainer=ddp", steps=6)
    assert "equal on 1 process and N ranks" in proc.stdout, proc.stdout + proc.stderr
    assert {"train/loss", "val/loss", "val/acc"} <= values(proc.stdout).keys()


@pytest.mark.slow
def test_random_augmentation_in_a_dataset_is_exact_on_2_ranks_with_loader_workers(tmp_path):
    """A Dataset adding torch, numpy and Python `random` noise in __getitem__, read by 2 loader workers a rank: each
    sample augmented alike on 1 process and on 2 ranks (it trained another model: train/acc 0.5 against 0.531 at
    step 0, without the keyed items)."""
    proc = parity(tmp_path, "experiment=plain", "trainer=ddp", "data.augment=0.3", "data.num_workers=2", steps=8)
    assert "equal on 1 process and N ranks" in proc.stdout, proc.stdout + proc.stderr


def test_a_datasets_random_draws_are_keyed_by_seed_epoch_and_sample():
    """SeededItems: an item's draws depend on (seed, epoch, index) only, never on the generators' state before it,
    which it leaves as it found them; the training sampler hands the epoch along with each index."""
    import random as python_random

    from src.core.seeded import SeededItems
    from tests.helpers.plain_lightning import Jitter

    items = SeededItems(Jitter(TensorDataset(torch.zeros(6, 3), torch.zeros(6)), 1.0), seed=7)
    torch.manual_seed(1), np.random.seed(1), python_random.seed(1)
    first = items[(2, 4)][0]
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), python_random.getstate())
    torch.manual_seed(2), np.random.seed(2), python_random.seed(2)
    assert torch.equal(items[(2, 4)][0], first)  # another state before it: the same draws
    assert not torch.equal(items[(3, 4)][0], first) and not torch.equal(items[(2, 5)][0], first)  # epoch, sample
    assert not torch.equal(SeededItems(items.dataset, seed=8)[(2, 4)][0], first)  # the run's seed
    torch.manual_seed(1), np.random.seed(1), python_random.seed(1)
    items[(2, 4)]
    assert torch.equal(torch.get_rng_state(), states[0]) and np.array_equal(np.random.get_state()[1], states[1])
    assert python_random.getstate() == states[2]  # the generators restored after the item
    sampler = samplers.train_sampler(list(range(6)), 0, (1, 2))
    sampler.with_epoch, sampler.epoch = True, 5
    assert [epoch for epoch, _ in sampler] == [5, 5, 5] and sorted(i for _, i in sampler) == sorted(
        list(sampler.batch(0, 3))
    )


def _stack(tensor: torch.Tensor, group=None, sync_grads: bool = False) -> torch.Tensor:
    """Lightning's all_gather on N ranks: equal shapes stacked into (world, ...)."""
    out = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, tensor.contiguous())
    return torch.stack(out)


def _gather_case(rank: int, world: int) -> dict:
    from src.callbacks.epoch_end import RowsInOrder

    shard = [i for batch in samplers.EvenBatches(11, 2, (rank, world)) for i in batch]  # this rank's rows, in order
    rows = torch.tensor([[i, 10 * i] for i in shard])
    gather = RowsInOrder(_stack, lambda: len(shard), lambda: None)
    out = {"rows": gather({"x": rows})["x"], "scalar": gather(torch.tensor(float(rank)))}
    step = RowsInOrder(_stack, lambda: None, lambda: None)  # outside an epoch-end hook: a training step's batch
    out["step"] = step(torch.full((2, 3), float(rank)))
    try:
        gather(torch.zeros(rank + 1, 3))  # uneven and not the epoch's rows
    except ConfigError as error:
        out["error"] = str(error)
    return out


def test_all_gather_of_an_epochs_uneven_rows_is_every_row_in_dataset_order():
    """11 evaluation rows on 3 ranks (4, 4, 3): what `self.all_gather` returns on 1 process (every row, in order),
    where gloo aborted ("op.preamble.length <= op.nbytes"); another tensor keeps Lightning's (world, ...) stacking,
    and shapes that are neither are one sentence."""
    from tests.test_distributed import run_ranks

    for rank, out in run_ranks(3, _gather_case).items():
        assert torch.equal(out["rows"], torch.tensor([[i, 10 * i] for i in range(11)])), rank
        assert torch.equal(out["scalar"], torch.tensor([0.0, 1.0, 2.0]))
        assert out["step"].shape == (3, 2, 3) and out["step"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
        assert "self.all_gather got tensors of shapes [[1, 3], [2, 3], [3, 3]] on the 3 ranks" in out["error"]


@pytest.mark.slow
def test_an_epoch_metric_from_the_epochs_gathered_rows_is_exact_on_2_ranks(tmp_path):
    """Predictions collected in validation_step, self.all_gather'ed in on_validation_epoch_end (57 rows: 29 and 28 on
    2 ranks), an accuracy logged: equal to 1 process."""
    proc = parity(tmp_path, "experiment=plain", "trainer=ddp", "model.epoch_metric=gathered", steps=4)
    assert "equal on 1 process and N ranks" in proc.stdout, proc.stdout + proc.stderr
    assert "val/acc_epoch" in values(proc.stdout)


@pytest.mark.slow
def test_an_epoch_metric_of_each_ranks_own_rows_is_named_and_refused_when_selected_by(tmp_path):
    """The same accuracy from each rank's own rows (the mean of two shards' accuracies): named in the sanity
    validation, before step 1; refused in one sentence where the checkpoints select by it, nothing saved."""
    conf = write_configs(tmp_path / "conf")
    args = [f"hydra.searchpath=[file://{conf}]", "experiment=plain", "trainer=ddp", "model.epoch_metric=own"]
    proc = run_script(
        "train.py",
        [*args, "trainer.max_steps=2", "callbacks.model_checkpoint.monitor=val/acc_epoch", f"paths.log_dir={tmp_path}"],
        check=False,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    sentence = "val/acc_epoch, logged from on_validation_epoch_end, differs between the ranks"
    assert sentence in proc.stderr and "the metric the run selects by" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.rglob("*.ckpt"))


def test_a_bias_a_normalisation_cancels_is_found_and_its_gradient_held_at_zero():
    """What feeds a BatchNorm (1d, 2d), an InstanceNorm or a one-channel-a-group GroupNorm straight from a biased
    Linear or Conv is found over one forward; a LayerNorm, a ReLU between, or bias=False is not. Held: the gradient
    is exactly zero where rounding left 1e-9 (what Adam turns into a step of about lr)."""
    from src.callbacks.cancelled_bias import CancelledBiases

    nets = {
        "linear_bn": nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)),
        "conv_bn": nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.LazyLinear(1)),
        "conv_gn": nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(3, 3), nn.Flatten(), nn.LazyLinear(1)),
        "conv_in": nn.Sequential(nn.Conv2d(1, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.Flatten(), nn.LazyLinear(1)),
        "linear_ln": nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 1)),
        "relu_between": nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 1)),
        "no_bias": nn.Sequential(nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6), nn.Linear(6, 1)),
    }
    found = {}
    for kind, net in nets.items():
        x = torch.randn(8, 1, 5, 5) if kind.startswith("conv") else torch.randn(8, 4)
        watcher = CancelledBiases()
        watcher.watch(net, announce=False)
        net(x).sum().backward()
        watcher.stop_watching()
        found[kind] = sorted(watcher.held)
        if watcher.held:
            bias = net[0].bias
            assert 0 < bias.grad.abs().max() < 1e-5, (kind, bias.grad)  # zero but for rounding
            watcher.hold()
            assert torch.count_nonzero(bias.grad) == 0
    assert found == {
        "linear_bn": ["0.bias"],
        "conv_bn": ["0.bias"],
        "conv_gn": ["0.bias"],
        "conv_in": ["0.bias"],
        "linear_ln": [],
        "relu_between": [],
        "no_bias": [],
    }


@pytest.mark.slow
def test_a_bias_before_batchnorm_under_adamw_trains_the_same_model_on_2_ranks(tmp_path):
    """PyTorch's default nn.Linear(bias=True) into BatchNorm1d, AdamW at lr 1e-2: the bias's rounding-level gradient
    differed between 1 process and 2 ranks and Adam made it steps of about lr (val/loss 1.7e-5 apart at step 19, train
    loss equal); held at zero, every value is equal."""
    proc = parity(tmp_path, "experiment=plain", "trainer=ddp", "model.optimizer=adamw", steps=20)
    assert "equal on 1 process and N ranks" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time: the localisation is test_parity_localises_the_weights..., the exit 1 the test above
def test_parity_names_the_weights_that_differ_after_a_run_that_is_not_exact(tmp_path):
    """A Dataset augmenting from a generator of its own (not the global ones the template keys): each rank's copy
    draws its own noise, the 2-rank run trains another model. The tool names the first value that differs and, from
    both runs' last checkpoints, the weights that differ most."""
    args = ["experiment=plain", "trainer=ddp", "data.augment=0.3", "data.own_rng=true"]
    proc = parity(tmp_path, *args, check=False, steps=8)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^parity: \S+ differs at step \d+: ", proc.stderr, re.MULTILINE), proc.stderr
    assert re.search(r"^parity: the final weights differ most in net\.\S+ \(max \|diff\| ", proc.stderr, re.M), (
        proc.stderr
    )


def parity_values(*pairs: tuple[str, int, float]) -> dict[tuple[str, int], float]:
    return {(name, step): value for name, step, value in pairs}


@pytest.mark.parametrize("value", [0.137, 1.0, 250.0])
def test_the_parity_tolerance_passes_half_of_one_and_fails_ten(value):
    """Around a value below 1, at 1 and above (relative there): half a tolerance agrees, ten do not."""
    from src.tools.parity import first_difference, tolerance

    one = parity_values(("val/loss", 3, value))
    assert first_difference(one, parity_values(("val/loss", 3, value + tolerance(value) / 2))) is None
    differs = first_difference(one, parity_values(("val/loss", 3, value + 10 * tolerance(value))))
    assert differs is not None and differs.startswith("val/loss differs at step 3: "), differs


def test_the_parity_tolerance_is_below_the_smallest_difference_a_run_showed():
    """val/loss of the plain module with a bias before its BatchNorm under AdamW before that bias was held at zero
    (src/callbacks/cancelled_bias.py), as measured (12 steps): 1 process and 2 ranks 3.9e-5 apart, what the tool
    exists to catch; a tolerance loosened 10x lets it through."""
    from src.tools.parity import first_difference

    one, many = (
        parity_values(("val/loss", 11, 0.08979792892932892)),
        parity_values(("val/loss", 11, 0.08983700722455978)),
    )
    assert first_difference(one, many).startswith("val/loss differs at step 11")


def test_parity_names_nan_and_a_value_one_run_logged_first_by_step():
    from src.tools.parity import first_difference

    nan = float("nan")
    assert first_difference(parity_values(("a", 0, 1.0)), parity_values(("a", 0, nan))).startswith(
        "a differs at step 0"
    )
    assert first_difference(parity_values(("a", 0, nan)), parity_values(("a", 0, nan))).startswith(
        "a differs at step 0"
    )
    both = ("a", 0, 1.0)
    assert first_difference(parity_values(both, ("z", 2, 1.0)), parity_values(both)) == (
        "z at step 2 was logged on 1 process only"
    )
    assert first_difference(parity_values(both), parity_values(both, ("b", 1, 1.0), ("a", 5, 3.0))) == (
        "b at step 1 was logged on N ranks only"
    )


def test_parity_localises_the_weights_that_differ_in_the_last_checkpoints(tmp_path):
    """Two runs' last.ckpt: the weight that differs most is named with its max |diff|; a bias before a BatchNorm with
    why; equal weights said to agree (the runs logged differently)."""
    from src.tools.parity import localise

    def write(run: str, state: dict) -> None:
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        torch.save({"state_dict": state, "epoch": 0}, tmp_path / run / "checkpoints" / "last.ckpt")

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    state = net.state_dict()
    for case, (name, delta) in enumerate([("0.bias", 0.02), ("3.weight", 0.02), ("3.weight", 0.0)]):
        moved = {k: v + delta if k == name else v.clone() for k, v in state.items()}
        write(f"one{case}", state)
        write(f"many{case}", moved)
        lines = localise(tmp_path / f"one{case}", tmp_path / f"many{case}")
        if not delta:
            assert lines == ["the final weights agree (largest |diff| 0): the runs logged, not trained, differently"]
            continue
        assert re.match(rf"the final weights differ most in {re.escape(name)} \(max \|diff\| 0\.02\)", lines[0]), lines
        hinted = [line for line in lines[1:] if "a BatchNorm" in line]
        assert [line.split(" is ")[0] for line in hinted] == (["0.bias"] if name == "0.bias" else []), lines
    assert localise(tmp_path / "nothing", tmp_path / "many0") == [
        "the final weights were not compared: a run wrote no checkpoint"
    ]
    write("own", {**state, "hyper": ConfigError("an object weights_only refuses")})
    (lines,) = localise(tmp_path / "one0", tmp_path / "own")
    assert lines.startswith("the final weights were not compared: a checkpoint could not be read (")  # no traceback


@pytest.mark.parametrize("order", ["steps-first", "steps-between", "steps-last"])
def test_the_parity_tool_takes_steps_and_overrides_in_any_order(order, monkeypatch):
    from src.tools import parity

    runs = []

    def run(overrides, log_dir):
        runs.append(overrides)
        return {("train/loss", 0): 1.0}

    monkeypatch.setattr(parity, "run", run)
    given = {
        "steps-first": ["--steps", "3", "experiment=x", "trainer=ddp", "model.k=v"],
        "steps-between": ["experiment=x", "trainer=ddp", "--steps", "3", "model.k=v"],
        "steps-last": ["experiment=x", "trainer=ddp", "model.k=v", "--steps", "3"],
    }[order]
    assert parity.main(given) == 0
    for overrides in runs:
        assert {"experiment=x", "model.k=v", "trainer.max_steps=3"} <= set(overrides), overrides


@pytest.mark.slow
def test_a_refusal_inside_the_parity_check_is_its_one_sentence(tmp_path):
    """What the suite's parity runs (tests/test_experiments.py) show for an experiment refused on N ranks: the
    refusal's sentence on one line, exit 2 (it was the last 4000 characters of the ranks' output)."""
    conf = write_configs(tmp_path / "conf")
    args = ["--steps", "2", f"hydra.searchpath=[file://{conf}]", "experiment=plain", "trainer=ddp", "model.noise=0.5"]
    proc = run_script("-m", ["src.tools.parity", *args], check=False, env={"HYDRA_FULL_ERROR": "0"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("parity: ")]
    assert re.search(
        r" refused: (Rank \d: )?PlainMLP's training step draws random numbers of its own \(randn_like\)", line
    )
    assert "Traceback" not in proc.stderr
