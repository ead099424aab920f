"""Stops that every rank takes together.

A flair plugin stops training by raising ``TrainingInterrupt`` from a hook. In one process that ends the loop at
once. With several processes a rank that stops alone leaves the others waiting in the next collective forever, so
here a hook's ``TrainingInterrupt`` is held back on its rank and the ranks agree at fixed points: inside the epoch,
at flair's log points (about every tenth of an epoch) and at its end, riding on the all-reduce of the train loss
that happens there anyway; and after each epoch-level event (``before_training_epoch``, ``after_training_epoch``,
``after_evaluation``). If any rank stopped, every rank raises ``TrainingInterrupt`` there, with the message of the
first rank that stopped. A signal (Ctrl-C, SIGTERM) received by any rank is agreed on the same way and makes every
rank raise ``KeyboardInterrupt``, which flair handles by saving the final model. No collective is added to the
training step (on this 2-core machine one gloo all-reduce costs about 1 ms, several percent of a small model's
step).
"""

from __future__ import annotations

import torch
from flair.trainers.plugins import TrainingInterrupt
from lightning.fabric import Fabric

from flair_fabric.training.loss import accumulator_dtype

# the events whose hooks may stop training inside the epoch loop; their stops wait for the next agreement
DEFERRED_EVENTS = frozenset(
    {
        "before_training_epoch",
        "before_training_batch",
        "before_training_optimizer_step",
        "after_training_batch",
        "after_training_epoch",
        "after_evaluation",
        "metric_recorded",
    }
)


class Lockstep:
    """Holds a rank's pending stop and makes all ranks agree on it."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.pending: TrainingInterrupt | None = None
        self.signal: str | None = None

    def hold(self, stop: TrainingInterrupt) -> None:
        """Keep this rank's stop (the first one) until the ranks next agree."""
        if self.pending is None:
            self.pending = stop

    def interrupt(self, signal_name: str) -> None:
        """Note a signal this rank received; every rank stops when the ranks next agree."""
        self.signal = self.signal or signal_name

    def agree(self, *values: torch.Tensor) -> list[float]:
        """All ranks: sum ``values`` over the ranks and learn whether any rank stopped; if one did, every rank
        raises ``TrainingInterrupt`` here. Returns the summed values."""
        fabric = self.fabric
        dtype = accumulator_dtype(fabric.device)
        stopped_here = torch.zeros(fabric.world_size, dtype=dtype, device=fabric.device)
        # per rank: 2 for a signal, 1 for a plugin's stop, 0 for none
        stopped_here[fabric.global_rank] = 2.0 if self.signal is not None else float(self.pending is not None)
        packed = torch.cat([stopped_here, *(value.detach().to(fabric.device, dtype).reshape(1) for value in values)])
        summed = fabric.all_reduce(packed, reduce_op="sum")
        assert isinstance(summed, torch.Tensor)
        numbers = summed.tolist()
        signalled = [rank for rank in range(fabric.world_size) if numbers[rank] > 1]
        if signalled:
            first = signalled[0]
            name = fabric.broadcast(self.signal if fabric.global_rank == first else None, src=first)
            self.signal = self.pending = None
            raise KeyboardInterrupt(f"{name} received by rank {first}; every rank stops here")
        stopped = [rank for rank in range(fabric.world_size) if numbers[rank] > 0]
        if stopped:
            first = stopped[0]
            reason = fabric.broadcast(str(self.pending) if fabric.global_rank == first else None, src=first)
            self.pending = None
            raise TrainingInterrupt(f"{reason} (stopped by rank {first}; every rank stops here)")
        return numbers[fabric.world_size :]
