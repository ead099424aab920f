"""Running a model on a batch without leaving a trace: for decisions taken before training (which parameters get
gradients) and for passes that only take part in collectives (a stand-in batch)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import flair
import torch
from flair.training_utils import store_embeddings


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
