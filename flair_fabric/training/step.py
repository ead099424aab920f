"""One training step as flair's loop takes it: chunks, forward through the wrapped module, backward through Fabric
(scaled so that DDP's average is the gradient of the sum over all ranks' batches), clipping, the optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from flair.training_utils import identify_dynamic_embeddings, store_embeddings

from flair_fabric.strategies.sharded_state import whole_tensor
from flair_fabric.training.loss import LossTracker
from flair_fabric.training.participation import chunks_for_every_rank, learns_something

if TYPE_CHECKING:
    from flair_fabric.training.run_interface import Run


def train_step(run: Run, batch: list, batch_kw: dict, largest_batch: int) -> tuple[LossTracker, torch.Tensor | None]:
    """Forward, backward (chunked, gradient sync on the last chunk only), clip and step for one mini-batch.

    Every rank runs as many chunks as the largest batch of this step has on any rank, and a chunk that learns
    nothing still takes part in the collectives (:mod:`flair_fabric.training.participation`). With
    ``mini_batch_chunk_size="auto"`` the passes run without gradient sync, a step that ran out of memory is redone
    in smaller chunks on every rank, and the gradients are summed over the ranks by flair-fabric during the last pass
    (:mod:`flair_fabric.training.out_of_memory`)."""
    fabric, a, module, trainer = run.fabric, run.flair_arguments, run.module, run.trainer
    optimizer = trainer.optimizer
    assert optimizer is not None
    trainer.model.zero_grad()
    optimizer.zero_grad()
    trainer.dispatch("before_training_batch", **batch_kw)

    retries = run.chunks_on_out_of_memory
    if retries is None:
        batch_loss = LossTracker(fabric.device)
        chunks = chunks_for_every_rank(batch, a.mini_batch_chunk_size, largest_batch)
        for chunk_no, chunk in enumerate(chunks):
            with fabric.no_backward_sync(module, enabled=chunk_no < len(chunks) - 1):
                # DDP averages the gradients over the ranks: a loss scaled by their number gives those of the sum
                _forward_backward(run, chunk, batch, batch_loss, loss_scale=fabric.world_size)
    else:
        attempt = [LossTracker(fabric.device)]

        def one_pass(chunk: list, first: bool) -> None:
            if first:  # a new attempt: the losses of a failed one are dropped
                attempt[0] = LossTracker(fabric.device)
            with fabric.no_backward_sync(module, enabled=fabric.world_size > 1):  # (summed by OverlappedSum)
                _forward_backward(run, chunk, batch, attempt[0], loss_scale=1)

        retries.step(batch, one_pass, where=f"epoch {run.position.epoch}, step {run.position.step}")
        batch_loss = attempt[0]

    trainer.dispatch("before_training_optimizer_step", **batch_kw)
    gradient_norm = None
    if a.max_grad_norm is not None and not run.strategy.clips_gradients_in_engine:
        norm = run.strategy.clip_gradients(fabric, module, optimizer, max_norm=a.max_grad_norm)
        gradient_norm = whole_tensor(norm) if norm is not None else None
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    scale_before = scaler.get_scale() if scaler is not None else 1.0
    optimizer.step()
    scale_after = scaler.get_scale() if scaler is not None else 1.0
    batch_kw["optimizer_was_run"] = scale_before <= scale_after
    return batch_loss, gradient_norm


def _forward_backward(run: Run, chunk: list, batch: list, batch_loss: LossTracker, loss_scale: int) -> None:
    """Forward and backward of one chunk of ``batch``, backpropagating its loss times ``loss_scale``; its loss is
    added to ``batch_loss``."""
    fabric, a, module, trainer = run.fabric, run.flair_arguments, run.module, run.trainer
    with fabric.autocast():
        if run.participation is None:
            loss, data_points = module.forward_loss(chunk)
            if fabric.world_size > 1 and not learns_something(loss):  # as Participation counts it (none)
                data_points = 0
        else:
            loss, data_points = run.participation.loss(module.forward_loss, chunk)
    batch_loss.add(loss, data_points)
    # flair's losses are sums over data points: the gradients must be those of the sum over all ranks' batches
    trainer._backward(loss * loss_scale if loss_scale != 1 else loss)
    if run.dynamic_embeddings is None and chunk:
        run.dynamic_embeddings = identify_dynamic_embeddings(batch)
    store_embeddings(chunk, a.embeddings_storage_mode, run.dynamic_embeddings)
