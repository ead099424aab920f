"""The train split, cut into per-rank mini-batches.

With one process the loader is exactly flair's (same shuffling, same random numbers drawn), so a one-device run
reproduces :class:`flair.trainers.ModelTrainer`. With N processes every data point is read exactly once per epoch
across the ranks: PyTorch's ``DistributedSampler`` (and so Fabric's) pads the split with repeated data points until
it divides by N, which would count those points twice in flair's summed loss. Here the ranks take strided shards of
one global order instead, and a rank whose shard is one longer folds that point into its last batch, so every rank
runs the same number of steps. The global order is the one process's: global rank 0 draws it from its generators
as flair's loader draws it and sends it to the others, so with shuffling on N ranks read, step by step, the data
points one process reads with a batch N times theirs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flair.data import _len_dataset
from flair.datasets import DataLoader
from torch.utils.data import Dataset, Sampler

from flair_fabric.data.stored import stored_lengths
from flair_fabric.training.balancing import data_point_length, deal_steps_by_length


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's mini-batches of one epoch, cut from the global ``order`` of data point indices.

    Rank ``r`` reads ``order[r::world_size]`` in batches of ``batch_size``. Shards differ in length by at most one;
    the single extra point of a longer shard joins its last batch, so every rank yields the same number of batches.
    Without shuffling, the union of the ranks' k-th batches is the k-th batch of size ``world_size * batch_size``
    of one process reading ``order``. With ``lengths`` (per data point), each step's data points are dealt to the
    ranks by length instead (:mod:`flair_fabric.training.balancing`): the same points per step, the rank with the
    longest ones gets fewer (with ``chunk_size``: no rank needs more chunks than the strided batches need).
    """

    def __init__(
        self,
        order: Sequence[int],
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        lengths: Sequence[int] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        if len(order) < world_size:
            raise ValueError(
                f"the train split has {len(order)} data point(s) for {world_size} processes: every process needs at"
                " least one; use fewer devices or more training data."
            )
        shortest = len(order) // world_size
        shard_sizes = [len(range(r, len(order), world_size)) for r in range(world_size)]
        every_rank = [_batch_sizes(size, batch_size, shortest) for size in shard_sizes]
        if lengths is None:
            self.batches = _cut_batches(list(order)[rank::world_size], batch_size, shortest)
        else:
            step_sizes = [sum(sizes) for sizes in zip(*every_rank, strict=True)]
            capacities = [
                math.ceil(max(sizes) / chunk_size) * chunk_size if chunk_size else total - world_size + 1
                for sizes, total in zip(zip(*every_rank, strict=True), step_sizes, strict=True)
            ]
            dealt = deal_steps_by_length(order, step_sizes, world_size, capacities, lengths)
            self.batches = dealt[rank]
            every_rank = [[len(batch) for batch in batches] for batches in dealt]
        # the size of the largest batch of each step on any rank, so that every rank cuts as many chunks
        self.largest_batches = [max(sizes) for sizes in zip(*every_rank, strict=True)]
        # the data points all ranks read at each step: a mid-epoch checkpoint's position in the epoch's order
        self.step_sizes = [sum(sizes) for sizes in zip(*every_rank, strict=True)]

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


@dataclass
class EpochBatches:
    """One rank's batches of one epoch, from ``first_step`` on (steps before it were trained before a resume and are
    neither read nor embedded again)."""

    batches: Iterable[list]
    total: int
    """Steps in the whole epoch."""
    first_step: int = 0
    largest_batches: list[int] | None = None
    """Per step, the largest batch any rank has (several processes)."""
    step_sizes: list[int] | None = None
    """Per step, the data points all ranks read (several processes; in one process: the batch's length)."""

    def after(self, steps: int) -> EpochBatches:
        """These batches numbered as the rest of an epoch whose first ``steps`` steps were trained before."""
        skipped = [0] * steps
        return EpochBatches(
            self.batches,
            self.total + steps,
            steps + self.first_step,
            skipped + self.largest_batches if self.largest_batches is not None else None,
            skipped + self.step_sizes if self.step_sizes is not None else None,
        )


def epoch_batches(
    train_data: Dataset,
    fabric: Any,
    *,
    mini_batch_size: int,
    shuffle: bool,
    sampler: Sampler | None,
    first_step: int = 0,
    remaining_order: list[int] | None = None,
    lengths: Sequence[int] | None = None,
    chunk_size: int | None = None,
) -> EpochBatches:
    """This rank's batches of the epoch that starts now.

    In one process the batches are flair's own loader's (same shuffling, same random numbers drawn); from
    ``first_step`` on, the loader's index batches are skipped without reading the data. With several processes the
    order is the job's (:func:`job_epoch_order`). ``remaining_order``: the epoch's data points not read yet, in order
    (a resume on another number of processes), cut into batches afresh and numbered from ``first_step`` on, as in the
    epoch the interrupted run began.
    ``lengths`` (several processes): each step's data points are dealt to the ranks by these lengths, in hands that
    need no more chunks of ``chunk_size`` than strided batches.
    """
    rank, world_size = fabric.global_rank, fabric.world_size
    if remaining_order is not None:
        rest = _cut(train_data, remaining_order, mini_batch_size, rank, world_size, lengths, chunk_size)
        return rest.after(first_step)
    if world_size == 1:
        loader = DataLoader(train_data, batch_size=mini_batch_size, shuffle=shuffle, sampler=sampler)
        if first_step == 0:
            return EpochBatches(loader, len(loader))
        # the same loader over the indices draws the epoch's order from the generators exactly as the data's would
        indices = DataLoader(
            range(_len_dataset(train_data)), batch_size=mini_batch_size, shuffle=shuffle, sampler=sampler
        )
        remaining = list(itertools.islice(indices, first_step, None))
        return EpochBatches(_read(train_data, remaining), len(loader), first_step)
    order = job_epoch_order(fabric, train_data, mini_batch_size=mini_batch_size, shuffle=shuffle, sampler=sampler)
    return _cut(train_data, order, mini_batch_size, rank, world_size, lengths, chunk_size, skip=first_step)


def _cut(
    train_data: Dataset,
    order: list[int],
    mini_batch_size: int,
    rank: int,
    world_size: int,
    lengths: Sequence[int] | None,
    chunk_size: int | None,
    skip: int = 0,
) -> EpochBatches:
    """``order`` cut into this rank's batches; the first ``skip`` steps are left out (neither read nor embedded)."""
    if world_size == 1:
        cut = [order[i : i + mini_batch_size] for i in range(0, len(order), mini_batch_size)]
        return EpochBatches(_read(train_data, cut[skip:]), len(cut), skip)
    batches = ShardedBatchSampler(
        order, rank=rank, world_size=world_size, batch_size=mini_batch_size, lengths=lengths, chunk_size=chunk_size
    )
    return EpochBatches(
        _read(train_data, batches.batches[skip:]),
        len(batches),
        skip,
        batches.largest_batches,
        batches.step_sizes,
    )


def _read(train_data: Dataset, index_batches: Iterable[list[int]]) -> Iterator[list]:
    """The data points of each index batch, read only when the batch is trained."""
    for indices in index_batches:
        yield [train_data[index] for index in indices]


def epoch_order_of_one_process(
    train_data: Dataset, *, mini_batch_size: int, shuffle: bool, sampler: Sampler | None
) -> list[int]:
    """The order flair's loader reads an epoch in, drawn from the random number generators as they are now."""
    indices = DataLoader(range(_len_dataset(train_data)), batch_size=mini_batch_size, shuffle=shuffle, sampler=sampler)
    return [index for batch in indices for index in batch]


def job_epoch_order(
    fabric: Any, train_data: Dataset, *, mini_batch_size: int, shuffle: bool, sampler: Sampler | None
) -> list[int]:
    """The order of the epoch for every rank of the job: the order one process reads it in, drawn by global rank 0's
    random number generators as flair's loader draws it (:func:`epoch_order_of_one_process`), and sent to every rank.
    So N ranks read, step by step, the data points of one process whose batch is N times theirs; the other ranks'
    generators draw nothing for it."""
    if not shuffle and sampler is None:
        return list(range(_len_dataset(train_data)))
    drawn = None
    if fabric.is_global_zero:
        one_process = epoch_order_of_one_process(
            train_data, mini_batch_size=mini_batch_size, shuffle=shuffle, sampler=sampler
        )
        drawn = np.asarray(one_process, dtype=np.int64)
    return [int(index) for index in fabric.broadcast(drawn, src=0)]


def data_point_lengths(train_data: Dataset) -> list[int]:
    """The length of every data point of ``train_data`` (:func:`~flair_fabric.training.balancing.data_point_length`),
    read once per run: from storage where the split stores them (nothing is built), else from each data point."""
    stored = stored_lengths(train_data)
    if stored is not None:
        return stored
    return [data_point_length(train_data[index]) for index in range(_len_dataset(train_data))]
