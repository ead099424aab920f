"""The per-rank train batches: every data point once per epoch, equal step counts, flair's order semantics."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flair.datasets import DataLoader
from flair.samplers import FlairSampler

from flair_fabric.launch.config import make_launch_config
from flair_fabric.training.balancing import deal_by_length
from flair_fabric.training.participation import chunks_for_every_rank
from flair_fabric.training.sampling import ShardedBatchSampler, job_epoch_order, steps_per_epoch

from ..support import run_on_ranks


def _all_batches(order: list[int], world_size: int, global_batch_size: int) -> list[list[list[int]]]:
    return [
        list(ShardedBatchSampler(order, rank=rank, world_size=world_size, global_batch_size=global_batch_size))
        for rank in range(world_size)
    ]


def test_each_step_is_one_process_loaders_batch_shared_strided_and_the_steps_do_not_depend_on_the_ranks() -> None:
    """Against flair's one-process loader with batch size G (the reference): step k of the ranks together holds its
    k-th batch, rank r reads the batch's points r, r + N, ... (shares differ by at most one; in a last batch with
    fewer points than ranks the last ranks read none), every rank runs as many steps as that loader has batches."""
    for size, world_size, global_batch_size in itertools.product(
        [1, 2, 3, 7, 8, 9, 20, 21, 22, 23, 101], [1, 2, 3, 4], [1, 2, 4, 5, 8, 10]
    ):
        order = random.Random(size).sample(range(size), size)
        if global_batch_size < world_size:
            with pytest.raises(ValueError, match=f"global_batch_size={global_batch_size} is smaller than the"):
                ShardedBatchSampler(order, rank=0, world_size=world_size, global_batch_size=global_batch_size)
            continue
        one_process = [list(batch) for batch in DataLoader(order, batch_size=global_batch_size)]
        samplers = [
            ShardedBatchSampler(order, rank=rank, world_size=world_size, global_batch_size=global_batch_size)
            for rank in range(world_size)
        ]
        per_rank = [list(sampler) for sampler in samplers]
        assert [len(batches) for batches in per_rank] == [len(one_process)] * world_size
        assert len(one_process) == steps_per_epoch(size, global_batch_size)
        for step, batch in enumerate(one_process):
            assert [per_rank[rank][step] for rank in range(world_size)] == [
                batch[r::world_size] for r in range(world_size)
            ]
        largest = [max(len(batches[step]) for batches in per_rank) for step in range(len(one_process))]
        assert all(sampler.largest_batches == largest for sampler in samplers), (size, world_size, global_batch_size)
        assert all(sampler.step_sizes == [len(batch) for batch in one_process] for sampler in samplers)


@pytest.mark.parametrize(
    ("batch", "chunk_size", "largest", "expected"),
    [
        ([1, 2, 3], None, 5, [[1, 2, 3]]),
        ([1, 2, 3], 2, 3, [[1, 2], [3]]),
        ([1, 2], 2, 3, [[1, 2], []]),  # another rank's batch of 3 makes two chunks: this rank runs two passes too
        ([1], 1, 3, [[1], [], []]),
        ([1, 2, 3], 5, 3, [[1, 2, 3]]),
    ],
)
def test_every_rank_cuts_as_many_chunks_as_the_largest_batch_of_the_step(
    batch: list[int], chunk_size: int | None, largest: int, expected: list[list[int]]
) -> None:
    assert chunks_for_every_rank(batch, chunk_size, largest) == expected


def _padded(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max((lengths[i] for i in batch), default=0)


def test_dealing_by_length_keeps_each_steps_data_points_and_pads_the_slowest_rank_less() -> None:
    """Against the strided sampler (the reference): the same data points per step, every rank at least one (where
    the step has as many), each rank's points in the epoch's order, and the largest padded batch (points x longest)
    never larger."""
    generator = random.Random(5)
    for size, world_size, batch_size, chunk in itertools.product(
        [2, 7, 9, 22, 23, 64], [2, 3, 4], [1, 3, 8], [None, 2]
    ):
        order = generator.sample(range(size), size)
        lengths = [generator.randint(1, 60) for _ in range(size)]
        global_batch_size = world_size * batch_size
        strided = _all_batches(order, world_size, global_batch_size)
        samplers = [
            ShardedBatchSampler(
                order,
                rank=r,
                world_size=world_size,
                global_batch_size=global_batch_size,
                lengths=lengths,
                chunk_size=chunk,
            )
            for r in range(world_size)
        ]
        dealt = [list(sampler) for sampler in samplers]
        position = {index: p for p, index in enumerate(order)}
        for step in range(len(strided[0])):
            assert sorted(i for r in range(world_size) for i in dealt[r][step]) == sorted(
                i for r in range(world_size) for i in strided[r][step]
            )
            holding = min(world_size, len(samplers[0].step_sizes) and samplers[0].step_sizes[step])
            assert all(dealt[r][step] for r in range(holding)) and not any(
                dealt[r][step] for r in range(holding, world_size)
            )
            assert all(sorted(dealt[r][step], key=position.get) == dealt[r][step] for r in range(world_size))
            slowest = max(_padded(dealt[r][step], lengths) for r in range(world_size))
            assert slowest <= max(_padded(strided[r][step], lengths) for r in range(world_size))
            largest = max(len(dealt[r][step]) for r in range(world_size))
            assert all(sampler.largest_batches[step] == largest for sampler in samplers)
            if chunk is not None:  # no rank runs more chunks than the strided batches need
                strided_largest = max(len(strided[r][step]) for r in range(world_size))
                assert math.ceil(largest / chunk) <= math.ceil(strided_largest / chunk)
        assert samplers[0].step_sizes == [len(batch) for batch in DataLoader(order, batch_size=global_batch_size)]


def test_dealing_by_length_finds_the_least_padding_a_brute_force_search_finds() -> None:
    generator = random.Random(11)
    for _ in range(60):
        world_size = generator.choice([2, 3])
        total = generator.randint(world_size, 8)
        lengths = [generator.randint(1, 30) for _ in range(total)]
        best = min(
            max(_padded([i for i in range(total) if owner[i] == r], lengths) for r in range(world_size))
            for owner in itertools.product(range(world_size), repeat=total)
            if len(set(owner)) == world_size
        )
        hands = deal_by_length(lengths, world_size, capacity=total)
        assert max(_padded(hand, lengths) for hand in hands) == best, lengths
        assert sorted(i for hand in hands for i in hand) == list(range(total))


def test_dealing_by_length_gives_the_rank_with_the_long_sentences_fewer() -> None:
    """Two long sentences and fourteen short ones for two ranks of 8: strided, both ranks pad 8 points to 40 tokens;
    dealt, one rank takes the two long ones (80 padded tokens), the other the fourteen short ones (56)."""
    lengths = [40 if index in (0, 1) else 4 for index in range(16)]
    dealt = [
        list(ShardedBatchSampler(range(16), rank=r, world_size=2, global_batch_size=16, lengths=lengths))
        for r in (0, 1)
    ]
    assert dealt[0] == [[0, 1]] and dealt[1] == [list(range(2, 16))]
    strided = _all_batches(list(range(16)), 2, 16)
    assert [_padded(strided[r][0], lengths) for r in (0, 1)] == [320, 320]


class _ShuffledBlocks(FlairSampler):
    """A flair sampler drawing from Python's, numpy's and torch's global generators (flair's own samplers call
    ``Sampler.__init__(None)``, which this PyTorch rejects)."""

    def __iter__(self):
        blocks = [list(range(i, min(i + 3, self.num_samples))) for i in range(0, self.num_samples, 3)]
        random.shuffle(blocks)
        blocks = [blocks[i] for i in np.random.permutation(len(blocks))]
        flip = bool(torch.randint(0, 2, (1,)).item())
        order = [i for block in blocks for i in (reversed(block) if flip else block)]
        return iter(order)


def _orders_on_ranks(fabric: Any, out: str) -> None:
    """Every rank: its generators seeded by its rank (rank 0 with the seeds of the test's reference), then the job's
    order of a shuffled epoch and of a sampler's epoch, and whether its own generators moved."""
    rank = fabric.global_rank
    random.seed(RANK_ZERO_SEED + rank)
    np.random.seed(RANK_ZERO_SEED + rank)
    torch.manual_seed(RANK_ZERO_SEED + rank)
    before = torch.get_rng_state()
    shuffled = job_epoch_order(fabric, list(range(50)), global_batch_size=8, shuffle=True, sampler=None)
    unchanged = torch.equal(torch.get_rng_state(), before)
    sampler = _ShuffledBlocks()
    sampler.set_dataset(list(range(30)))
    blocks = job_epoch_order(fabric, list(range(30)), global_batch_size=8, shuffle=False, sampler=sampler)
    in_order = job_epoch_order(fabric, list(range(5)), global_batch_size=8, shuffle=False, sampler=None)
    record = {"shuffled": shuffled, "blocks": blocks, "in_order": in_order, "generator_unchanged": unchanged}
    (Path(out) / f"orders-rank{rank}.json").write_text(json.dumps(record))


RANK_ZERO_SEED = 123


@pytest.mark.multiprocess
def test_the_jobs_order_is_the_one_process_loaders_drawn_by_rank_zero(tmp_path: Path) -> None:
    """2 ranks whose generators differ: both read the order flair's one-process loader draws from global rank 0's
    generators (shuffled, and a flair sampler drawing from Python's, numpy's and torch's generators); rank 0's
    generators move as that loader's would, the other rank's do not move."""
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_fork", precision=None)
    run_on_ranks(config, _orders_on_ranks, str(tmp_path))
    ranks = [json.loads((tmp_path / f"orders-rank{rank}.json").read_text()) for rank in (0, 1)]
    random.seed(RANK_ZERO_SEED)
    np.random.seed(RANK_ZERO_SEED)
    torch.manual_seed(RANK_ZERO_SEED)
    loader = DataLoader(list(range(50)), batch_size=16, shuffle=True)  # flair's, one process, any batch size
    shuffled = [index for batch in loader for index in batch]
    sampler = _ShuffledBlocks()
    sampler.set_dataset(list(range(30)))
    blocks = [index for batch in DataLoader(list(range(30)), batch_size=16, sampler=sampler) for index in batch]
    for rank in ranks:
        assert rank["shuffled"] == shuffled
        assert rank["blocks"] == blocks
        assert rank["in_order"] == [0, 1, 2, 3, 4]
    assert sorted(shuffled) == list(range(50)) and shuffled != list(range(50))
    assert [rank["generator_unchanged"] for rank in ranks] == [False, True]
