"""Each step's data points dealt to the ranks by length, so that no rank pads its batch to another's long sentences.

A synchronous step lasts as long as its slowest rank, and a rank's forward and backward pass costs about its batch
size times the length it pads to (its longest data point). With strided shards every rank gets the same number of
points, and the rank that got the step's longest sentence pads all of them to it.

Every rank's k-th batch together holds the same data points whichever rank reads which (a contiguous chunk of the
epoch's order), and the step's gradient is that of the loss summed over all of them
(:mod:`flair_fabric.training.step`), so dealing them differently changes the result only by the order of
floating-point additions. Here the step's points, longest first, are cut into one run per rank so that the largest
``points x longest`` of any rank is as small as it can be: the rank with the longest sentences gets fewer of them.
Every rank gets at least one point (where the step has as many), and no more than ``capacity`` (with
``mini_batch_chunk_size``: no more chunks than the strided batches need). Each rank reads its points in
the epoch's order.
"""

from __future__ import annotations

from collections.abc import Sequence

from flair.data import DataPair, DataTriple, Sentence


def data_point_length(point: object) -> int:
    """Tokens of a data point: a sentence's, summed over the parts of a pair or triple; 1 for anything else."""
    if isinstance(point, Sentence):
        return max(len(point), 1)
    if isinstance(point, DataTriple):
        return sum(data_point_length(part) for part in (point.first, point.second, point.third))
    if isinstance(point, DataPair):
        return data_point_length(point.first) + data_point_length(point.second)
    return 1


def padded_cost(lengths: Sequence[int]) -> int:
    """What a batch of data points of these lengths costs: their number times the longest (the padded tokens)."""
    return len(lengths) * max(lengths, default=0)


def deal_by_length(lengths: Sequence[int], ranks: int, capacity: int) -> list[list[int]]:
    """Positions ``0..len(lengths)-1`` dealt into ``ranks`` hands of 1 to ``capacity`` positions each (each hand in
    ascending order), so that the largest :func:`padded_cost` of a hand is the smallest possible."""
    total = len(lengths)
    if not ranks <= total <= ranks * capacity:
        raise ValueError(f"{total} data points cannot be dealt to {ranks} ranks of 1 to {capacity} points each")
    longest_first = sorted(range(total), key=lambda i: (-lengths[i], i))
    descending = [lengths[i] for i in longest_first]

    def runs_within(cost: int) -> list[int] | None:
        """Sizes of the runs (longest first) of at most ``cost`` each, or None if ``ranks`` runs cannot hold all."""
        sizes: list[int] = []
        start = 0
        while start < total:
            size = min(cost // descending[start], capacity, total - start)
            if size == 0 or len(sizes) == ranks:
                return None
            sizes.append(size)
            start += size
        return sizes

    low, high = descending[0], padded_cost(descending[:capacity])  # high: runs of `capacity` always fit
    while low < high:  # the smallest cost that some cut into runs stays within
        middle = (low + high) // 2
        if runs_within(middle) is None:
            low = middle + 1
        else:
            high = middle
    sizes = runs_within(low)
    assert sizes is not None
    while len(sizes) < ranks:  # every rank gets a point: halve the largest run (halves never cost more)
        largest = max(range(len(sizes)), key=lambda i: sizes[i])
        sizes[largest : largest + 1] = [sizes[largest] - sizes[largest] // 2, sizes[largest] // 2]
    hands, start = [], 0
    for size in sizes:
        hands.append(sorted(longest_first[start : start + size]))
        start += size
    return hands


def deal_steps_by_length(
    order: Sequence[int], step_sizes: Sequence[int], ranks: int, capacities: Sequence[int], lengths: Sequence[int]
) -> list[list[list[int]]]:
    """Every rank's batches of an epoch: step k takes the next ``step_sizes[k]`` data points of ``order`` (the union
    of the ranks' k-th strided batches) and deals them by ``lengths`` (indexed by data point) into hands of at most
    ``capacities[k]`` (every rank gets one, where the step has as many). Returns ``batches[r][k]``."""
    dealt: list[list[list[int]]] = [[] for _ in range(ranks)]
    offset = 0
    for size, capacity in zip(step_sizes, capacities, strict=True):
        step = order[offset : offset + size]
        offset += size
        holding = min(ranks, size)  # a last step with fewer data points than ranks: the last ranks get none
        hands = deal_by_length([lengths[i] for i in step], holding, capacity) + [[]] * (ranks - holding)
        for rank, hand in enumerate(hands):
            dealt[rank].append([step[position] for position in hand])
    return dealt
