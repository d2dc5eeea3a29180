"""The pieces in src/parallel/ (samplers, gather, SyncBatchNorm, mesh), each against its single-process truth, on gloo with real processes."""

from __future__ import annotations

import os
import socket
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import worker_processes
from torch import nn

from src.parallel.gather import gather_shards
from src.parallel.samplers import ShardSampler, rank_and_world, train_sampler
from src.parallel.sync_batchnorm import GlooSyncBatchNorm, SyncBatchNorm
from src.utils.config import ConfigError
from tests.helpers.margins import close64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = fn(rank, world)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable) -> dict:
    """Run fn(rank, world) in `world` gloo processes; return {rank: result}."""
    ctx = worker_processes()  # sets the preload of the one forkserver that start_processes forks from too
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(world, free_port(), fn, out), nprocs=world, start_method="forkserver")
        return dict(out)


# ---- SyncBatchNorm on CPU ----


def bn_case(rank: int, world: int) -> dict:
    """Each rank holds 1/world of the batch; returns what a single-process run must reproduce. In float64: the
    sums over ranks are another computation than BatchNorm's, equal in exact arithmetic."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, 5, dtype=torch.float64) * 3 + 1
    w = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    bn = nn.BatchNorm2d(3, momentum=0.3, dtype=torch.float64)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    if world > 1:
        bn = SyncBatchNorm().apply(nn.Sequential(bn))[0]
        assert isinstance(bn, GlooSyncBatchNorm)
        x, w = x.chunk(world)[rank], w.chunk(world)[rank]
    x = x.clone().requires_grad_(True)
    for _ in range(2):  # two steps: running stats accumulate
        y = bn(x)
    (y * w).sum().backward()  # a sum loss: the full-batch loss is the sum of the ranks' losses
    grads = [bn.weight.grad.clone(), bn.bias.grad.clone()]
    if world > 1:
        for g in grads:
            dist.all_reduce(g)  # what DDP does with parameter gradients (it averages; we compare sums)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dweight": grads[0],
        "dbias": grads[1],
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
    }


def test_gloo_syncbatchnorm_equals_full_batch_batchnorm():
    """torch's SyncBatchNorm refuses CPU ("SyncBatchNorm layers only work with GPU modules"); ours must
    give, on 2 ranks with half the batch each, what BatchNorm gives on the whole batch in one process."""
    full = bn_case(0, 1)
    ranks = run_ranks(2, bn_case)
    for key in ("y", "dx"):
        close64(torch.cat([ranks[0][key], ranks[1][key]]), full[key], key)
    for key in ("dweight", "dbias", "running_mean", "running_var"):
        for r in (0, 1):
            close64(ranks[r][key], full[key], key)


def test_syncbatchnorm_plugin_is_a_no_op_for_one_process_and_reverts():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert SyncBatchNorm().apply(model) is model and isinstance(model[1], nn.BatchNorm2d)  # no process group
    from src.parallel.sync_batchnorm import _convert

    gloo = _convert(model, to_gloo=True)
    assert isinstance(gloo[1], GlooSyncBatchNorm)
    back = SyncBatchNorm().revert(gloo)
    assert type(back[1]) is nn.BatchNorm2d and back[1].weight is not None


# ---- gathering and sharding ----


def gather_case(rank: int, world: int) -> list:
    sampler = ShardSampler(10, rank_and_world(None))
    local = torch.tensor(list(sampler), dtype=torch.float32)[:, None] * torch.tensor([[1.0, -1.0]])
    real = local[[not sampler.is_padding(i) for i in sampler]]  # a caller may drop the padding first
    return [gather_shards(local, 10, None).tolist(), gather_shards(real, 10, None).tolist()]


def test_gather_shards_returns_every_sample_once_in_dataset_order():
    results = run_ranks(3, gather_case)  # 10 samples on 3 ranks: 4 real + 0 padding, 3 + 1, 3 + 1
    expected = [[float(i), -float(i)] for i in range(10)]
    assert all(results[r] == [expected, expected] for r in range(3))


def shards_of(n: int, world: int) -> list[list[int]]:
    shards = []
    for rank in range(world):
        sampler = ShardSampler(n, (rank, world))
        assert len(sampler) == len(list(sampler))
        assert all(sampler.is_padding(i) == (i == n) for i in sampler)  # padding is marked: index n
        shards.append(list(sampler))
    return shards


@pytest.mark.parametrize("n,world", [(11, 3), (10, 3), (12, 3), (9, 4), (5, 5), (7, 1)])
def test_shard_sampler_equal_lengths_every_real_index_once_padding_marked(n, world):
    """Equal shard lengths (FSDP / ZeRO-3 all-gather in every evaluation forward: a rank with a batch
    less would hang the others), each real index exactly once, the rest the padding index n."""
    shards = shards_of(n, world)
    assert {len(s) for s in shards} == {-(-n // world)}
    real = [i for shard in shards for i in shard if i < n]
    assert sorted(real) == list(range(n))
    assert sum(i == n for shard in shards for i in shard) == -(-n // world) * world - n
    assert shards_of(11, 3) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]  # round-robin, padding last


def test_padded_split_labels_are_ignored():
    """The padding item: a real sample's inputs, every label -100 (dicts, and (x, y) tuples)."""
    from torch.utils.data import TensorDataset

    from src.core.datamodule import PaddedSplit, ignore_labels

    data = [{"input_ids": torch.arange(4), "labels": torch.arange(4)}]
    padded = PaddedSplit(data, ignore_labels(data[0]))
    assert len(padded) == 2 and padded[0] is data[0]
    assert padded[1]["input_ids"].tolist() == [0, 1, 2, 3] and padded[1]["labels"].tolist() == [-100] * 4
    x, y = ignore_labels(TensorDataset(torch.ones(2, 1, 8, 8), torch.tensor([3, 4]))[0])
    assert x.shape == (1, 8, 8) and y.item() == -100
    ids, labels = ignore_labels((torch.arange(3).numpy(), torch.arange(3).numpy()))
    assert ids.tolist() == [0, 1, 2] and labels.tolist() == [-100] * 3
    with pytest.raises(TypeError, match="expected a dict with 'labels' or an \\(inputs, labels\\) pair"):
        ignore_labels((torch.arange(3), torch.arange(3), torch.arange(3)))  # which item is the labels?


def test_shard_sampler_refuses_fewer_samples_than_ranks():
    with pytest.raises(ConfigError, match="3 sample.*4 ranks"):
        ShardSampler(3, (0, 4))


def test_shuffling_new_each_epoch_same_on_restart_disjoint_across_ranks():
    data = list(range(40))

    def order(rank: int, world: int, epoch: int, seed: int = 7) -> list[int]:
        sampler = train_sampler(data, seed, (rank, world))
        sampler.set_epoch(epoch)  # Lightning calls this at every epoch start
        return list(sampler)

    assert order(0, 1, 0) != order(0, 1, 1)  # a new order each epoch
    assert order(0, 1, 3) == order(0, 1, 3)  # a restart with the same seed replays it
    assert order(0, 1, 0) != order(0, 1, 0, seed=8)
    r0, r1 = order(0, 2, 2), order(1, 2, 2)
    assert not set(r0) & set(r1) and len(r0) == len(r1) == 20  # disjoint, together the epoch
    single = order(0, 1, 2)
    assert sorted(single[:8]) == sorted(r0[:4] + r1[:4])  # a global batch is the same samples for 1 or 2 ranks
