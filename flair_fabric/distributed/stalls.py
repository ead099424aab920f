"""A stalled collective ends the job with an error that says where, instead of waiting half an hour.

Every collective of a run (the gradient all-reduce inside backward, the loss agreement at log points, evaluation
gathers, broadcasts) normally completes in milliseconds once all ranks reach it. A rank that never arrives (stuck
in a deadlock, a dead NFS mount, a stopped process) leaves the others waiting for the process group's timeout:
PyTorch's and Lightning's default is 30 minutes. flair-fabric's default is :data:`DEFAULT_COLLECTIVE_TIMEOUT`
(10 minutes), set with ``collective_timeout=``. When it fires, :func:`explain_timeouts` turns the backend's
error into a :class:`CollectiveTimeout` naming the rank, the epoch, the step and what the rank was doing; the rank
exits and the launcher's guards stop the others.

Phases where only global rank 0 works while the others wait (writing model files and checkpoints, reading the best
model, evaluation that cannot be split) are not limited by it: the others wait in :func:`wait_for_global_zero`, a
barrier on a separate gloo group with a 2-hour timeout, so a long save or a big rank-0-only evaluation never trips
the short timeout of the training collectives.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed
from lightning.fabric import Fabric

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=10)
PATIENT_TIMEOUT = timedelta(hours=2)
_TIMED_OUT = re.compile(r"time[sd]? ?out|timed out", re.IGNORECASE)


def check_collective_timeout(collective_timeout: Any) -> timedelta:
    """``collective_timeout`` as a ``timedelta``: seconds (a positive number) or a ``timedelta``; ``None``: the
    default."""
    if collective_timeout is None:
        return DEFAULT_COLLECTIVE_TIMEOUT
    if isinstance(collective_timeout, timedelta):
        value = collective_timeout
    elif isinstance(collective_timeout, int | float) and not isinstance(collective_timeout, bool):
        value = timedelta(seconds=collective_timeout)
    else:
        value = timedelta(0)
    if value <= timedelta(0):
        raise ValueError(
            f"collective_timeout={collective_timeout!r} is not valid: pass a positive number of seconds (e.g. 600) or"
            " a datetime.timedelta."
        )
    return value


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``collective_timeout`` for the other ranks."""


@dataclass
class Position:
    """Where a rank is in its run: cheap to update on every step, turned into text only when an error needs it."""

    phase: str = "set-up"
    epoch: int = 0
    step: int = 0

    def at(self, phase: str, epoch: int | None = None, step: int | None = None) -> None:
        """Record that the rank now does ``phase`` (in ``epoch``, at ``step`` if given)."""
        self.phase = phase
        if epoch is not None:
            self.epoch = epoch
        if step is not None:
            self.step = step

    def __str__(self) -> str:
        if self.epoch == 0:
            return self.phase
        where = f"epoch {self.epoch}" + (f", step {self.step}" if self.step else "")
        return f"{where}: {self.phase}"


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out (gloo: "Timed out waiting ...", NCCL: "... timeout")."""
    return isinstance(error, RuntimeError) and bool(_TIMED_OUT.search(str(error)))


@contextmanager
def explain_timeouts(fabric: Fabric, position: Position, timeout: timedelta) -> Iterator[None]:
    """Inside the block a timed-out collective raises :class:`CollectiveTimeout` that says where the rank was."""
    try:
        yield
    except RuntimeError as error:
        if not is_timeout(error) or isinstance(error, CollectiveTimeout):
            raise
        raise CollectiveTimeout(
            f"global rank {fabric.global_rank} of {fabric.world_size} waited longer than collective_timeout"
            f" ({timeout.total_seconds():g} s) for the other processes in {position}, and gives up: another process"
            " is stalled or has died (see its output). If a step really takes that long, pass a larger"
            " collective_timeout=..."
        ) from error


_patient_groups: dict[Any, Any] = {}


def prepare_patient_group(fabric: Fabric) -> Any:
    """The gloo group :func:`wait_for_global_zero` waits on, made now if not yet (every rank at the same point; a
    run makes it at its start, so that a rank 0 that dies before its first save leaves the others in a barrier that
    ends when its sockets close, not in the group's making). ``None`` in one process."""
    if fabric.world_size == 1 or not torch.distributed.is_initialized():
        return None
    world = torch.distributed.group.WORLD
    if world not in _patient_groups:
        _patient_groups.clear()  # a new default group (a new run in this process): the old one is gone
        _patient_groups[world] = torch.distributed.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
    return _patient_groups[world]


def wait_for_global_zero(fabric: Fabric) -> None:
    """Every rank: wait, with a 2-hour timeout, until all ranks (global rank 0 last, after its file work) get here.

    A collective on a gloo group of its own (:func:`prepare_patient_group`)."""
    group = prepare_patient_group(fabric)
    if group is not None:
        torch.distributed.barrier(group=group)
