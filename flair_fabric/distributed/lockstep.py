"""Stops that every rank takes together.

A flair plugin stops training by raising ``TrainingInterrupt`` from a hook. In one process that ends the loop at
once. With several processes a rank that stops alone leaves the others waiting in the next collective forever, so
here a hook's ``TrainingInterrupt`` is held back on its rank and the ranks agree at fixed points: inside the epoch,
at flair's log points (about every tenth of an epoch) and at its end, riding on the all-reduce of the train loss
that happens there anyway; and after each epoch-level event (``before_training_epoch``, ``after_training_epoch``,
``after_evaluation``). If any rank stopped, every rank raises ``TrainingInterrupt`` there, with the message of the
first rank that stopped. A signal (Ctrl-C, SIGTERM) received by any rank is agreed on the same way and makes every
rank raise ``KeyboardInterrupt``, which flair handles by saving the final model. No collective is added to the
training step (one gloo all-reduce between 2 CPU processes costs about 1 ms, several percent of a small model's
step). The language-model trainer agrees the same way at its log points and split ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from flair.trainers.plugins import TrainingInterrupt
from lightning.fabric import Fabric

from flair_fabric.distributed.collectives import accumulator_dtype
from flair_fabric.state.run_state import AgreementFlags

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


class AgreedInterrupt(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM that every rank acts on at the same agreement point (a second one is a plain
    ``KeyboardInterrupt``, raised at once)."""


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on at one agreement point (when they did not stop)."""

    values: list[float]
    """The summed values."""
    checkpoint: bool = False
    """Global rank 0 asks for a checkpoint now (its clock said so)."""
    preempted: str | None = None
    """The preemption signal a rank received: checkpoint, then end the job for a requeue."""

    @staticmethod
    def either(first: Agreed | None, second: Agreed) -> Agreed:
        """Two agreements of one step as one: a checkpoint or a preemption either asked for (``second``'s values)."""
        if first is None:
            return second
        return Agreed(second.values, first.checkpoint or second.checkpoint, first.preempted or second.preempted)


class Lockstep:
    """Holds a rank's pending stop, checkpoint request or preemption (in the run's :class:`AgreementFlags`) and makes
    all ranks agree on them."""

    SLOTS = 3  # per rank: stop (2 a signal, 1 a plugin), checkpoint request, preemption

    def __init__(self, fabric: Fabric, flags: AgreementFlags | None = None) -> None:
        self.fabric = fabric
        self.flags = flags if flags is not None else AgreementFlags()

    def hold(self, stop: TrainingInterrupt) -> None:
        """Keep this rank's stop (the first one) until the ranks next agree."""
        if self.flags.stop is None:
            self.flags.stop = str(stop)

    def interrupt(self, signal_name: str) -> None:
        """Note a signal this rank received; every rank stops when the ranks next agree."""
        self.flags.signal = self.flags.signal or signal_name

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the next agreement (global rank 0's clock)."""
        self.flags.checkpoint_requested = True

    def preempt(self, signal_name: str) -> None:
        """Note a preemption signal; every rank checkpoints and ends when the ranks next agree."""
        self.flags.preemption = self.flags.preemption or signal_name

    def agree(self, *values: torch.Tensor | float) -> Agreed:
        """All ranks: sum ``values`` over the ranks and learn what any rank holds. A preemption or a checkpoint
        request is returned; otherwise, if a rank stopped, every rank raises here (``KeyboardInterrupt`` for a
        signal, ``TrainingInterrupt`` for a plugin's stop). One collective, none in one process.

        The flags and the plain numbers are packed on the host and cross to the device in one copy that does not
        wait; device tensors are read back once: on a GPU an agreement costs one synchronisation (in one process
        none without device values), not one per flag."""
        fabric = self.fabric
        dtype = accumulator_dtype(fabric.device)
        host = [0.0] * (fabric.world_size * self.SLOTS)
        mine = fabric.global_rank * self.SLOTS
        flags = self.flags
        host[mine] = 2.0 if flags.signal is not None else float(flags.stop is not None)
        host[mine + 1] = float(flags.checkpoint_requested)
        host[mine + 2] = float(flags.preemption is not None)
        plain_slots = [slot for slot, value in enumerate(values) if not isinstance(value, torch.Tensor)]
        device_slots = [slot for slot, value in enumerate(values) if isinstance(value, torch.Tensor)]
        on_host = host + [float(values[slot]) for slot in plain_slots]
        on_device = [
            cast(torch.Tensor, values[slot]).detach().to(fabric.device, dtype).reshape(1) for slot in device_slots
        ]
        if fabric.world_size > 1:
            packed = torch.cat([torch.tensor(on_host, dtype=dtype).to(fabric.device, non_blocking=True), *on_device])
            numbers = cast(torch.Tensor, fabric.all_reduce(packed, reduce_op="sum")).tolist()
        else:
            numbers = on_host + (torch.cat(on_device).tolist() if on_device else [])
        summed = [0.0] * len(values)
        for slot, number in zip(plain_slots + device_slots, numbers[len(host) :], strict=True):
            summed[slot] = number
        per_rank = [numbers[rank * self.SLOTS : (rank + 1) * self.SLOTS] for rank in range(fabric.world_size)]
        flags.checkpoint_requested = False
        preempted = [rank for rank, slots in enumerate(per_rank) if slots[2] > 0]
        if preempted:
            name = self._from(preempted[0], flags.preemption)
            flags.preemption = None
            return Agreed(summed, checkpoint=True, preempted=f"{name} received by rank {preempted[0]}")
        signalled = [rank for rank, slots in enumerate(per_rank) if slots[0] > 1]
        if signalled:
            name = self._from(signalled[0], flags.signal)
            flags.signal = flags.stop = None
            raise AgreedInterrupt(f"{name} received by rank {signalled[0]}; every rank stops here")
        stopped = [rank for rank, slots in enumerate(per_rank) if slots[0] > 0]
        if stopped:
            reason = self._from(stopped[0], flags.stop)
            flags.stop = None
            raise TrainingInterrupt(f"{reason} (stopped by rank {stopped[0]}; every rank stops here)")
        return Agreed(summed, checkpoint=any(slots[1] > 0 for slots in per_rank))

    def _from(self, rank: int, value: str | None) -> str:
        """``value`` as rank ``rank`` holds it, on every rank."""
        if self.fabric.world_size == 1:
            return str(value)
        return str(self.fabric.broadcast(value if self.fabric.global_rank == rank else None, src=rank))
