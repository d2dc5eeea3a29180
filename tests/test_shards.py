"""data=litdata: shards built with litdata's `optimize` (its local multi-process executor), read from a local
dir and from `local:` (litdata's stand-in for a bucket: chunks go through its downloader into a cache), train
through the same samplers as data=text: every token a target once, N ranks = 1 process, exact mid-epoch resume."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FULL_MATRIX_ONLY, shared
from test_architectures_parity import llama_args

from tests.helpers.margins import within

# Under pytest-xdist these tests run on one worker: they share module fixtures (runs) that it makes once.
pytestmark = pytest.mark.xdist_group("shards")

pytest.importorskip("litdata")

SEQ = 32
# 3 files of tinyshakespeare (~4 KB each): ~380 blocks of 32 bytes; val 3% = 11 blocks, odd on 2 ranks (padding)
RUN = [
    "data=litdata",
    f"data.seq_len={SEQ}",
    "data.val_fraction=0.03",
    "data.test_fraction=0",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "data.global_batch_size=8",
    "trainer.max_steps=6",
    "trainer.val_check_interval=6",
    "test=false",
    "model.scheduler=null",
    "callbacks.last_checkpoint.every_n_train_steps=1",
]


def corpus_files(root: Path) -> list[Path]:
    text = shared("tinyshakespeare", "input.txt").read_text()
    root.mkdir(parents=True)
    files = []
    for k in range(3):
        files.append(root / f"part{k}.txt")
        files[-1].write_text(text[k * 4000 : (k + 1) * 4000])
    return files


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    from src.tools.shards import build

    root = tmp_path_factory.mktemp("shards")
    files = corpus_files(root / "text")
    meta = build(str(root / "text"), str(root / "out"), SEQ, "bytes", workers=2)
    return {"files": files, "dir": root / "out", "meta": meta, "tmp": root}


def test_pack_reads_blocks_like_packed_blocks():
    """Blocks packed while the stream arrives in pieces = text.py's PackedBlocks over the whole stream, the
    last block's PAD becoming EOS inputs and ignored labels."""
    from src.lm.data.shards import PAD, pack
    from src.lm.data.text import PackedBlocks, count_blocks

    rng = np.random.default_rng(0)
    for n in (2, 33, 64, 65, 97, 500):
        stream = rng.integers(0, 256, size=n).astype(np.int32)
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(5, n - 1), replace=False))
        blocks = list(pack(iter(np.split(stream, cuts)), SEQ))
        expected = PackedBlocks(stream, SEQ, 0, count_blocks(n, SEQ), pad_id=256)
        assert len(blocks) == len(expected)
        for block, want in zip(blocks, expected):
            ids, labels = torch.as_tensor(block[:-1], dtype=torch.int64), torch.as_tensor(block[1:], dtype=torch.int64)
            ids[ids == PAD], labels[labels == PAD] = 256, -100
            assert torch.equal(ids, want["input_ids"]) and torch.equal(labels, want["labels"])


def datamodule(input_dir: str, **kw):
    from src.lm.data.shards import LitDataModule

    dm = LitDataModule(
        input_dir=input_dir,
        seq_len=kw.pop("seq_len", SEQ),
        global_batch_size=8,
        val_fraction=0.03,
        test_fraction=0.03,
        **kw,
    )
    dm.setup("fit")
    return dm


@pytest.mark.slow
def test_every_token_of_every_file_is_a_target_once(shards, tmp_path):
    """Over train + val + test (read through the bucket stand-in), the targets are each file's stream but its
    first token, files one after the other; target_counts (the loss normaliser) agrees with the labels."""
    from src.lm.data.shards import read_documents
    from src.utils.config import ConfigError

    dm = datamodule(f"local:{shards['dir']}", cache_dir=str(tmp_path / "cache"))
    labels, counts = [], []
    for split in ("train", "val", "test"):
        data = dm.splits[split]
        for i in range(len(data)):
            block = data[i]["labels"].numpy()
            labels.append(block[block != -100])
            counts.append(len(labels[-1]))
        assert list(data.target_counts()) == counts[-len(data) :]
    got = np.concatenate(labels)
    # each file: its documents (split at blank lines, see read_documents), each followed by EOS (256)
    streams = [
        np.concatenate(
            [
                np.append(np.frombuffer(d.encode(), np.uint8), 256).astype(np.int64)
                for d in read_documents(str(f), "text")
            ]
        )
        for f in shards["files"]
    ]
    assert any(np.array_equal(got, np.concatenate([s[1:] for s in order])) for order in itertools.permutations(streams))
    assert shards["meta"]["n_targets"] == len(got) == sum(len(s) - 1 for s in streams)
    with pytest.raises(ConfigError, match=rf"seq_len={SEQ}, not data.seq_len=64: set data.seq_len={SEQ} or rebuild"):
        datamodule(str(shards["dir"]), seq_len=64)


@pytest.fixture(scope="module")
def one_process(shards) -> dict:
    from test_parity import train

    return train(shards["tmp"], "one", RUN + [f"data.input_dir={shards['dir']}"])


@pytest.mark.slow
def test_two_ranks_from_the_bucket_equal_one_process(shards, one_process):
    """1 process x 8 reading the local dir, 2 gloo ranks x 4 reading `local:` (the bucket stand-in): the same
    parameters, train/loss at every step and val/loss (11 val blocks: rank 1 gets a padding sample)."""
    from test_parity import assert_same_series, max_param_diff, train

    two = train(
        shards["tmp"], "two", RUN + [f"data.input_dir=local:{shards['dir']}", "trainer=ddp", "trainer.devices=2"]
    )
    within(max_param_diff(one_process["params"], two["params"]), 1e-5, "params")
    assert_same_series(one_process, two, "train/loss", 1e-5)
    assert_same_series(one_process, two, "val/loss", 1e-5)


@pytest.mark.slow
def test_mid_epoch_resume_on_two_ranks_equals_a_straight_run(shards, one_process):
    """2 ranks stopped after 3 of the epoch's ~46 steps, resumed from last.ckpt to 6: the parameters of 6 steps
    straight (1 process; the test above shows that 2 ranks straight give the same). No LR schedule in RUN: a
    warmup/decay schedule depends on trainer.max_steps, which differs between the stopped and the straight run."""
    from test_parity import assert_same_series, max_param_diff, train

    args = RUN + [f"data.input_dir={shards['dir']}", "trainer=ddp", "trainer.devices=2"]
    train(shards["tmp"], "first", args + ["trainer.max_steps=3"])
    (run,) = (shards["tmp"] / "first" / "train" / "runs").iterdir()
    resumed = train(shards["tmp"], "resumed", args + [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"])
    # against 1 process, so the tolerance of every N-vs-1 comparison (2 ranks sum their gradients in another
    # order: 1.25e-6 here); a wrong resume (batches repeated or skipped) is ~1e-3 away
    within(max_param_diff(one_process["params"], resumed["params"]), 1e-5, "params")
    straight = {"scalars": {"train/loss": one_process["scalars"]["train/loss"][3:]}}
    assert_same_series(resumed, straight, "train/loss", 1e-5)


@pytest.mark.slow
@FULL_MATRIX_ONLY
def test_llama_on_two_ranks_from_the_bucket_equals_one_process(shards):
    """data=litdata under Llama (grouped-query attention, untied head): 2 gloo ranks x 4 reading `local:` give the
    1-process run's parameters, train/loss at every step and val/loss."""
    from test_parity import assert_same_series, max_param_diff, train

    llama = llama_args(RUN)
    one = train(shards["tmp"], "llama_one", llama + [f"data.input_dir={shards['dir']}"])
    two = train(
        shards["tmp"],
        "llama_two",
        llama + [f"data.input_dir=local:{shards['dir']}", "trainer=ddp", "trainer.devices=2"],
    )
    within(max_param_diff(one["params"], two["params"]), 1e-5, "params")
    assert_same_series(one, two, "train/loss", 1e-5)
    assert_same_series(one, two, "val/loss", 1e-5)
    assert len(one["scalars"]["train/loss"]) == 6
    (k_proj,) = [t for name, t in one["params"].items() if name.endswith("layers.0.self_attn.k_proj.weight")]
    assert k_proj.shape == (16, 32)  # a Llama with 2 key/value heads of 8 dims
