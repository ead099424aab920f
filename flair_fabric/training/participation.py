"""Every rank takes part in every training step's collectives, whatever its data.

A flair model whose batch holds nothing to learn (a relation extractor on sentences with fewer than two entities, an
entity linker on sentences without a linked mention, an empty chunk of a chunked batch) returns a constant loss
that depends on no parameter: ``torch.tensor(0.0, requires_grad=True)``. Its backward pass then computes no
gradient, so the rank never joins the gradient all-reduce (DDP), the reduce-scatter (FSDP) or the all-gathers of
the forward pass (FSDP), and the other ranks wait for it forever.

:class:`Participation` turns such a step into one that learns nothing but takes part like any other: the model
runs its ``forward_loss`` on a *stand-in batch* (the first train mini-batch that has something to learn, chosen
before training starts) and the loss becomes ``constant + 0 * stand_in_loss``. The collectives are those of an
ordinary step on every strategy; every gradient this rank adds is zero, so the result is the one a single process
computes on the union of the other ranks' batches. The stand-in pass changes nothing else: random number
generators, buffers and accumulators (DeepNCM's prototype updates) are put back and its embeddings are dropped.
Ordinary steps pay only a check of ``loss.grad_fn``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flair
import torch
from flair.data import _len_dataset
from torch.utils.data import Dataset

from flair_fabric.strategies.probing import leaves_no_trace

ForwardLoss = Callable[[list], tuple[torch.Tensor, int]]


def learns_something(loss: torch.Tensor) -> bool:
    """Whether ``loss`` depends on a parameter (a backward pass through it computes gradients)."""
    return loss.grad_fn is not None


def largest_pass(mini_batch_size: int, mini_batch_chunk_size: int | None) -> int:
    """The most data points one forward pass of a training step holds: one chunk of the batch (flair runs a batch
    in chunks when ``mini_batch_chunk_size`` is smaller than it). No pass flair-fabric adds holds more."""
    return min(mini_batch_chunk_size, mini_batch_size) if mini_batch_chunk_size else mini_batch_size


def find_stand_in_batch(
    model: flair.nn.Model, train_data: Dataset, pass_size: int, points_to_search: int
) -> list | None:
    """The first run of ``pass_size`` train data points (in the split's order, among the first
    ``points_to_search``) whose loss depends on the parameters, for :class:`Participation`; ``None`` if none has
    (every step then learns nothing on every rank, and no rank enters a gradient collective). Runs the model in train
    mode, one pass of at most ``pass_size`` points at a time, without a backward pass, and leaves no trace.
    """
    size = _len_dataset(train_data)
    was_training = model.training
    model.train()
    try:
        for start in range(0, min(size, points_to_search), pass_size):
            batch = [train_data[index] for index in range(start, min(start + pass_size, size))]
            with leaves_no_trace(model, batch):
                loss, _ = model.forward_loss(batch)
                found = learns_something(loss)
            if found:
                return batch
        return None
    finally:
        model.train(was_training)


def stand_in_and_probe(
    model: flair.nn.Model,
    train_data: Dataset,
    mini_batch_size: int,
    mini_batch_chunk_size: int | None,
    several: bool,
    auto_chunks: bool,
) -> tuple[list | None, list]:
    """The stand-in batch for :class:`Participation` (on several processes whose passes synchronise, i.e. without
    ``mini_batch_chunk_size="auto"``) and the batch a strategy probes the model with before wrapping. Neither holds
    more data points than one chunk of a training step (a run that fits only in chunks fits through its set-up); with
    ``"auto"`` the probe holds one data point."""
    size = _len_dataset(train_data)
    pass_size = 1 if auto_chunks else largest_pass(mini_batch_size, mini_batch_chunk_size)
    stand_in = (
        find_stand_in_batch(model, train_data, pass_size, points_to_search=8 * mini_batch_size)
        if several and not auto_chunks
        else None
    )
    return stand_in, stand_in or [train_data[index] for index in range(min(pass_size, size))]


class Participation:
    """Makes a step that learns nothing take part in the collectives like one that does (see the module doc)."""

    def __init__(self, model: torch.nn.Module, stand_in_batch: list | None) -> None:
        self.model = model
        self.stand_in_batch = stand_in_batch
        self.steps_taken_part = 0  # steps (or chunks) of this rank that learned nothing and took part

    def loss(self, forward_loss: ForwardLoss, batch: list) -> tuple[torch.Tensor, int]:
        """``forward_loss(batch)``; if that learns nothing, a loss with the same value whose backward pass takes
        part in the collectives with zero gradients. A step that learns nothing counts no data points."""
        if batch:
            loss, data_points = forward_loss(batch)
            if learns_something(loss) or self.stand_in_batch is None:
                return loss, data_points
        else:
            loss = torch.zeros((), device=flair.device)
        stand_in = self.stand_in_batch
        if stand_in is None:
            return loss, 0
        with leaves_no_trace(self.model, stand_in):
            stand_in_loss, _ = forward_loss(stand_in)
        self.steps_taken_part += 1
        return loss + 0.0 * stand_in_loss, 0


def chunks_for_every_rank(batch: list, chunk_size: int | None, largest_batch: int) -> list[list]:
    """flair's chunks of ``batch`` (``ModelTrainer.get_batch_steps``), padded with empty chunks to the number of
    chunks the largest batch of this step on any rank has, so that every rank runs the same number of passes."""
    if chunk_size is None or largest_batch <= chunk_size:
        return [batch]
    chunks = [batch[i : i + chunk_size] for i in range(0, len(batch), chunk_size)] or [batch]
    return chunks + [[] for _ in range(math.ceil(largest_batch / chunk_size) - len(chunks))]
