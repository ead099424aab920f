"""The train split, cut into per-rank mini-batches.

With one process the loader is exactly flair's (same shuffling, same random numbers drawn), so a one-device run
reproduces :class:`flair.trainers.ModelTrainer`. With N processes every data point is read exactly once per epoch
across the ranks: PyTorch's ``DistributedSampler`` (and so Fabric's) pads the split with repeated data points until
it divides by N, which would count those points twice in flair's summed loss. Here the ranks take strided shards of
one global order instead, and a rank whose shard is one longer folds that point into its last batch, so every rank
runs the same number of steps.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from flair.data import _len_dataset
from flair.datasets import DataLoader
from torch.utils.data import Dataset, Sampler


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's mini-batches of one epoch, cut from the global ``order`` of data point indices.

    Rank ``r`` reads ``order[r::world_size]`` in batches of ``batch_size``. Shards differ in length by at most one;
    the single extra point of a longer shard joins its last batch, so every rank yields the same number of batches.
    Without shuffling, the union of the ranks' k-th batches is the k-th batch of size ``world_size * batch_size``
    of one process reading ``order``.
    """

    def __init__(self, order: Sequence[int], *, rank: int, world_size: int, batch_size: int) -> None:
        if len(order) < world_size:
            raise ValueError(
                f"the train split has {len(order)} data point(s) for {world_size} processes: every process needs at"
                " least one; use fewer devices or more training data."
            )
        shortest = len(order) // world_size
        self.batches = _cut_batches(list(order)[rank::world_size], batch_size, shortest)
        shard_sizes = [len(range(r, len(order), world_size)) for r in range(world_size)]
        every_rank = [_batch_sizes(size, batch_size, shortest) for size in shard_sizes]
        # the size of the largest batch of each step on any rank, so that every rank cuts as many chunks
        self.largest_batches = [max(sizes) for sizes in zip(*every_rank, strict=True)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _cut_batches(shard: list[int], batch_size: int, shortest_shard: int) -> list[list[int]]:
    batches = [shard[i : i + batch_size] for i in range(0, len(shard), batch_size)]
    if len(batches) > steps_for(shortest_shard, batch_size):
        last = batches.pop()
        batches[-1] = batches[-1] + last
    return batches


def _batch_sizes(shard_size: int, batch_size: int, shortest_shard: int) -> list[int]:
    """The sizes of the batches :func:`_cut_batches` cuts from a shard of ``shard_size`` data points."""
    sizes = [batch_size] * (shard_size // batch_size) + ([shard_size % batch_size] if shard_size % batch_size else [])
    if len(sizes) > steps_for(shortest_shard, batch_size):
        last = sizes.pop()
        sizes[-1] += last
    return sizes


def steps_for(shard_size: int, batch_size: int) -> int:
    """Number of mini-batches of ``batch_size`` in a shard of ``shard_size`` data points."""
    return math.ceil(shard_size / batch_size)


def steps_per_epoch(dataset_size: int, batch_size: int, world_size: int) -> int:
    """Optimizer steps each rank runs per epoch (the same on every rank)."""
    if world_size == 1:
        return steps_for(dataset_size, batch_size)
    return steps_for(dataset_size // world_size, batch_size)


def epoch_order(dataset_size: int, *, shuffle: bool, sampler: Sampler | None, seed: int, epoch: int) -> list[int]:
    """The global order of data point indices for ``epoch``, identical on every rank.

    A flair sampler draws its random numbers inside a seeded scope, so all ranks see the same sequence whatever
    state their own generators are in; the caller's generators are left untouched.
    """
    if sampler is not None:
        with _seeded_random_generators(seed + epoch):
            return [int(i) for i in sampler]
    if shuffle:
        generator = torch.Generator().manual_seed(seed + epoch)
        return torch.randperm(dataset_size, generator=generator).tolist()
    return list(range(dataset_size))


@contextmanager
def _seeded_random_generators(seed: int) -> Iterator[None]:
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def train_loader(
    train_data: Dataset,
    *,
    mini_batch_size: int,
    shuffle: bool,
    sampler: Sampler | None,
    epoch: int,
    seed: int,
    rank: int,
    world_size: int,
) -> DataLoader:
    """The loader of this rank's mini-batches for ``epoch`` (1-based, as in flair)."""
    if world_size == 1:
        return DataLoader(train_data, batch_size=mini_batch_size, shuffle=shuffle, sampler=sampler)
    order = epoch_order(_len_dataset(train_data), shuffle=shuffle, sampler=sampler, seed=seed, epoch=epoch - 1)
    batches = ShardedBatchSampler(order, rank=rank, world_size=world_size, batch_size=mini_batch_size)
    return DataLoader(train_data, batch_sampler=batches)


def shared_seed(fabric: Any) -> int:
    """A shuffling seed drawn from rank 0's torch generator and broadcast, so all ranks shuffle alike."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if fabric.is_global_zero else 0
    return int(fabric.broadcast(seed, src=0))
