"""The train split, cut into per-rank mini-batches: one global batch stream, dealt to the ranks.

With one process the loader is exactly flair's (same shuffling, same random numbers drawn), so a one-device run
reproduces :class:`flair.trainers.ModelTrainer`. With N processes the epoch's order is the one process's: global rank
0 draws it from its generators as flair's loader draws it and sends it to the others. The order is cut into global
steps of ``global_batch_size`` data points, the batches one process reads with that batch size (the last one holds
the rest), and each step's data points are dealt to the ranks. So N ranks train, step by step, on the batches of
one process, every data point is read exactly once per epoch (PyTorch's ``DistributedSampler``, and so Fabric's,
pads the split with repeated data points until it divides by N, which would count those points twice in flair's
summed loss), and the number of steps does not depend on N.
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

from flair_fabric.training.balancing import deal_steps_by_length
from flair_fabric.training.grouping import Grouping


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's mini-batches of one epoch, cut from the global ``order`` of data point indices.

    The order is cut into global steps of ``global_batch_size`` data points (the last step holds the rest), exactly
    the batches one process reads with that batch size. Each step is dealt to the ranks: rank ``r`` reads
    ``step[r::world_size]``, so shares differ by at most one, and in a last step with fewer data points than ranks
    the last ranks get none (they still take part in the step's collectives:
    :mod:`flair_fabric.training.participation`). With ``lengths`` (per data point), each step's data points are dealt
    to the ranks by length instead (:mod:`flair_fabric.training.balancing`): the same points per step, the rank with
    the longest ones gets fewer (with ``chunk_size``: no rank needs more chunks than the strided shares need).
    """

    def __init__(
        self,
        order: Sequence[int],
        *,
        rank: int,
        world_size: int,
        global_batch_size: int,
        lengths: Sequence[int] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than the {world_size} processes: every process"
                f" needs a data point per step; pass global_batch_size >= {world_size} or use fewer devices."
            )
        order = list(order)
        steps = [order[start : start + global_batch_size] for start in range(0, len(order), global_batch_size)]
        if lengths is None:
            every_rank = [[step[r::world_size] for step in steps] for r in range(world_size)]
        else:
            capacities = [
                math.ceil(math.ceil(len(step) / world_size) / chunk_size) * chunk_size
                if chunk_size
                else max(len(step) - world_size + 1, 1)
                for step in steps
            ]
            every_rank = deal_steps_by_length(order, [len(step) for step in steps], world_size, capacities, lengths)
        self.batches = every_rank[rank]
        sizes = [[len(batch) for batch in batches] for batches in every_rank]
        # the size of the largest batch of each step on any rank, so that every rank cuts as many chunks
        self.largest_batches = [max(step) for step in zip(*sizes, strict=True)]
        # the data points all ranks read at each step: a mid-epoch checkpoint's position in the epoch's order
        self.step_sizes = [len(step) for step in steps]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def steps_per_epoch(dataset_size: int, global_batch_size: int) -> int:
    """Optimizer steps per epoch (the same on every rank, whatever their number): those of one process whose batch
    holds ``global_batch_size`` data points."""
    return math.ceil(dataset_size / global_batch_size)


@dataclass
class EpochBatches:
    """One rank's batches of one epoch, from ``first_step`` on (steps before it were trained before a resume and are
    neither read nor embedded again)."""

    batches: Iterable[list]
    total: int
    """Steps in the whole epoch."""
    first_step: int = 0
    largest_batches: list[int] | None = None
    """Per step, the largest batch any rank has (several processes, or an order cut here in one process)."""
    step_sizes: list[int] | None = None
    """Per step, the data points all ranks read (where ``largest_batches`` is; else each batch's length)."""

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
    global_batch_size: int,
    shuffle: bool,
    sampler: Sampler | None,
    first_step: int = 0,
    remaining_order: list[int] | None = None,
    lengths: Sequence[int] | None = None,
    chunk_size: int | None = None,
    grouping: Grouping | None = None,
) -> EpochBatches:
    """This rank's batches of the epoch that starts now.

    In one process the batches are flair's own loader's (same shuffling, same random numbers drawn); from
    ``first_step`` on, the loader's index batches are skipped without reading the data. With several processes the
    order is the job's (:func:`job_epoch_order`). ``remaining_order``: the epoch's data points not read yet, in order
    (a resume on another number of processes), cut into batches afresh and numbered from ``first_step`` on, as in the
    epoch the interrupted run began.
    ``lengths`` (several processes): each step's data points are dealt to the ranks by these lengths, in hands that
    need no more chunks of ``chunk_size`` than strided batches. ``grouping``: the order is grouped by length
    (:mod:`flair_fabric.training.grouping`), also in one process.
    """
    rank, world_size = fabric.global_rank, fabric.world_size
    if remaining_order is not None:
        rest = _cut(train_data, remaining_order, global_batch_size, rank, world_size, lengths, chunk_size)
        return rest.after(first_step)
    if world_size == 1 and grouping is None:
        loader = DataLoader(train_data, batch_size=global_batch_size, shuffle=shuffle, sampler=sampler)
        if first_step == 0:
            return EpochBatches(loader, len(loader))
        # the same loader over the indices draws the epoch's order from the generators exactly as the data's would
        indices = DataLoader(
            range(_len_dataset(train_data)), batch_size=global_batch_size, shuffle=shuffle, sampler=sampler
        )
        remaining = list(itertools.islice(indices, first_step, None))
        return EpochBatches(_read(train_data, remaining), len(loader), first_step)
    order = job_epoch_order(
        fabric, train_data, global_batch_size=global_batch_size, shuffle=shuffle, sampler=sampler, grouping=grouping
    )
    return _cut(train_data, order, global_batch_size, rank, world_size, lengths, chunk_size, skip=first_step)


def _cut(
    train_data: Dataset,
    order: list[int],
    global_batch_size: int,
    rank: int,
    world_size: int,
    lengths: Sequence[int] | None,
    chunk_size: int | None,
    skip: int = 0,
) -> EpochBatches:
    """``order`` cut into this rank's batches; the first ``skip`` steps are left out (neither read nor embedded)."""
    batches = ShardedBatchSampler(
        order,
        rank=rank,
        world_size=world_size,
        global_batch_size=global_batch_size,
        lengths=lengths,
        chunk_size=chunk_size,
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
    train_data: Dataset,
    *,
    global_batch_size: int,
    shuffle: bool,
    sampler: Sampler | None,
    grouping: Grouping | None = None,
) -> list[int]:
    """The order flair's loader reads an epoch in, drawn from the random number generators as they are now; with
    ``grouping``, then grouped by length (its batches shuffled from the same generators)."""
    indices = DataLoader(
        range(_len_dataset(train_data)), batch_size=global_batch_size, shuffle=shuffle, sampler=sampler
    )
    order = [index for batch in indices for index in batch]
    return grouping.applied(order, global_batch_size, shuffle) if grouping is not None else order


def job_epoch_order(
    fabric: Any,
    train_data: Dataset,
    *,
    global_batch_size: int,
    shuffle: bool,
    sampler: Sampler | None,
    grouping: Grouping | None = None,
) -> list[int]:
    """The order of the epoch for every rank of the job: the order one process reads it in, drawn by global rank 0's
    random number generators as flair's loader draws it (:func:`epoch_order_of_one_process`), and sent to every rank.
    So N ranks read, step by step, the data points of one process whose batch is their global batch; the other ranks'
    generators draw nothing for it."""
    if not shuffle and sampler is None and grouping is None:
        return list(range(_len_dataset(train_data)))
    drawn = None
    if fabric.is_global_zero:
        one_process = epoch_order_of_one_process(
            train_data, global_batch_size=global_batch_size, shuffle=shuffle, sampler=sampler, grouping=grouping
        )
        drawn = np.asarray(one_process, dtype=np.int64)
    return [int(index) for index in fabric.broadcast(drawn, src=0)]
