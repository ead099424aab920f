"""When a run writes checkpoints, how many it keeps, and which signal means "preempted: checkpoint and requeue"."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

REQUEUE_EXIT_CODE = 75
"""The exit code of a run that stopped for a preemption signal after writing its checkpoint (``EX_TEMPFAIL``:
a temporary failure, start it again with ``resume_from="auto"``)."""


def _count(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not valid: pass a whole number of {minimum} or more.")
    return value


def _signal(value: Any) -> signal.Signals | None:
    if value is None:
        return None
    try:
        if isinstance(value, str):
            return signal.Signals[value if value.startswith("SIG") else f"SIG{value}"]
        return signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(
            f"requeue_signal={value!r} is not a signal: pass e.g. signal.SIGUSR1, 'SIGUSR1', 'SIGTERM', or None."
        ) from None


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checked checkpoint arguments of a run."""

    every_n_epochs: int = 0
    every_n_steps: int = 0
    every_n_minutes: float = 0.0
    keep: int = 1
    requeue_signal: signal.Signals | None = signal.SIGUSR1

    @classmethod
    def checked(
        cls,
        *,
        every_n_epochs: Any = 0,
        every_n_steps: Any = None,
        every_n_minutes: Any = None,
        keep: Any = 1,
        requeue_signal: Any = signal.SIGUSR1,
    ) -> CheckpointPolicy:
        """The policy, or a clear error naming the argument (before any process starts)."""
        steps = _count("checkpoint_every_n_steps", every_n_steps, minimum=1) if every_n_steps is not None else 0
        minutes = 0.0
        if every_n_minutes is not None:
            if (
                isinstance(every_n_minutes, bool)
                or not isinstance(every_n_minutes, int | float)
                or every_n_minutes <= 0
            ):
                raise ValueError(
                    f"checkpoint_every_n_minutes={every_n_minutes!r} is not valid: pass a positive number of minutes."
                )
            minutes = float(every_n_minutes)
        return cls(
            every_n_epochs=_count("checkpoint_every_n_epochs", every_n_epochs, minimum=0),
            every_n_steps=steps,
            every_n_minutes=minutes,
            keep=_count("keep_checkpoints", keep, minimum=1),
            requeue_signal=_signal(requeue_signal),
        )
