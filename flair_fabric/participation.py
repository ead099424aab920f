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
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import flair
import torch
from flair.data import _len_dataset
from flair.training_utils import store_embeddings
from torch.utils.data import Dataset

ForwardLoss = Callable[[list], tuple[torch.Tensor, int]]


def learns_something(loss: torch.Tensor) -> bool:
    """Whether ``loss`` depends on a parameter (a backward pass through it computes gradients)."""
    return loss.grad_fn is not None


def _stateful_tensors(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Copies of the buffers and plain tensor attributes of every module (running statistics, accumulators)."""
    saved = []
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            saved.append((module, name, buffer.detach().clone()))
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                saved.append((module, name, value.detach().clone()))
    return saved


@contextmanager
def leaves_no_trace(model: torch.nn.Module, batch: list) -> Iterator[None]:
    """Inside the block the model may run on ``batch``: afterwards random number generators, buffers and tensor
    attributes are as before and the embeddings stored on ``batch`` are gone."""
    saved_state = _stateful_tensors(model)
    devices = [torch.cuda.current_device()] if flair.device.type == "cuda" else []
    python_state = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        for module, name, value in saved_state:
            setattr(module, name, value)
        store_embeddings(batch, "none")


def find_stand_in_batch(
    model: flair.nn.Model, train_data: Dataset, mini_batch_size: int, max_batches: int = 8
) -> list | None:
    """The first of the first ``max_batches`` train mini-batches (in the split's order) whose loss depends on the
    parameters, for :class:`Participation`; ``None`` if none has (every step then learns nothing on every rank, and
    no rank enters a gradient collective). Runs the model in train mode without a backward pass and leaves no trace.
    """
    size = _len_dataset(train_data)
    was_training = model.training
    model.train()
    try:
        for start in range(0, min(size, max_batches * mini_batch_size), mini_batch_size):
            batch = [train_data[index] for index in range(start, min(start + mini_batch_size, size))]
            with leaves_no_trace(model, batch):
                loss, _ = model.forward_loss(batch)
                found = learns_something(loss)
            if found:
                return batch
        return None
    finally:
        model.train(was_training)


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


def parameters_without_gradient(model: flair.nn.Model, batch: list) -> list[str]:
    """Names of trainable parameters that get no gradient from one ``forward_loss`` on ``batch``; leaves no trace."""
    was_training = model.training
    try:
        with leaves_no_trace(model, batch):
            model.train()
            model.zero_grad(set_to_none=True)
            loss, _ = model.forward_loss(batch)
            if loss.requires_grad:
                loss.backward()
            unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return unused
