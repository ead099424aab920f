"""No hangs when a process of the job dies, and graceful stops on Ctrl-C and SIGTERM.

When one rank of a job dies, the others wait in their next collective until its timeout (30 minutes by default).
Who notices depends on who started the processes:

- **torchrun, SLURM**: their agents watch the ranks and stop the others.
- **spawned or forked workers**: ``torch.multiprocessing`` stops the others when one fails.
- **the script relaunch** (``strategy="ddp"``/``"fsdp"``): Lightning watches the relaunched copies from rank 0 and
  kills everything when one of them fails. The other direction is done here: when rank 0 raises, it kills the copies
  it started (:func:`stop_started_processes`); when rank 0 is killed, each copy notices that its parent is gone and
  exits (:func:`exit_with_parent`).

Ctrl-C and SIGTERM during training are held (:func:`graceful_interrupts`) until the ranks next agree on stops
(:mod:`flair_fabric.distributed.lockstep`); then every rank stops at the same point the way flair stops on
``KeyboardInterrupt`` (it saves ``final-model.pt``). A second signal stops at once. Spawned and forked workers hold
signals from their first moment, so a Ctrl-C during set-up stops them at the first agreement point; their caller
passes a Ctrl-C that reaches it alone (a notebook kernel) on to them, and on a second one ends and reaps them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric import Fabric

log = logging.getLogger("flair")

GRACEFUL_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_started_processes(fabric: Fabric, grace_seconds: float = 0.0) -> None:
    """Kill the processes Fabric's script relaunch started from this one (they would wait for it forever); those
    that end by themselves within ``grace_seconds`` (a preempted run's ranks, which exit with its requeue code) are
    left to end."""
    launcher = fabric.strategy.launcher
    deadline = time.monotonic() + grace_seconds
    for process in getattr(launcher, "procs", []):
        if grace_seconds:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        if process.poll() is None:
            process.kill()


_watching: list[int] = []  # the parent this process watches already


def exit_with_parent(poll_seconds: float = 1.0) -> None:
    """In a process started by rank 0: exit as soon as the parent process is gone (a daemon thread watches; one per
    process, however many runs it makes)."""
    parent = os.getppid()
    if parent in _watching:
        return
    _watching.append(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        log.error(f"the process that started this rank (pid {parent}) is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="flair-fabric-parent-watch", daemon=True).start()


FORWARDED_SIGNAL = signal.SIGUSR2
"""What the caller of spawned or forked workers sends them when it is interrupted itself (a notebook kernel gets
Ctrl-C alone): a SIGINT that never counts as a second one, since a worker in a terminal gets both for one Ctrl-C (the
terminal sends it to the whole process group), in either order."""

_received: list[str] = []  # the signals this process got since its outermost graceful block began
_received_directly: list[str] = []  # the signals that reached this process itself (not FORWARDED_SIGNAL) since then
_preempted: list[str] = []  # the preemption signal this process got since then
_preemption_signals: set[int] = set()  # the signals that mean "checkpoint, then end for a requeue"
Consumer = tuple[Callable[[str], None], Callable[[str], None] | None]
_consumers: list[Consumer] = []  # who is told of the first one: the innermost block's functions


def _handle(signum: int, frame: Any) -> None:
    if signum in _preemption_signals:  # never escalates: the scheduler may send it more than once
        if not _preempted:
            _preempted.append(signal.Signals(signum).name)
            if _consumers and _consumers[-1][1] is not None:
                _consumers[-1][1](_preempted[0])
        return
    # One Ctrl-C in a terminal reaches a worker twice: itself (sent to the whole process group) and passed on by its
    # caller. Either may be handled first (both pending at once run nested, the later one inside the earlier one), so
    # only a second signal that reached this process itself stops it at once.
    forwarded = signum == FORWARDED_SIGNAL
    name = "SIGINT" if forwarded else signal.Signals(signum).name
    if not forwarded:
        if _received_directly:
            raise KeyboardInterrupt(f"{name} received a second time")
        _received_directly.append(name)
    if _received:
        return  # the same Ctrl-C, already told
    _received.append(name)
    if _consumers:
        _consumers[-1][0](name)


def forget_inherited_interrupts() -> None:
    """In a forked worker: drop the caller's graceful blocks, which the fork copied. A signal that reached the worker
    since the fork stays held: the worker's own block is told of it."""
    _consumers.clear()


@contextlib.contextmanager
def graceful_interrupts(
    on_signal: Callable[[str], None],
    on_preemption: Callable[[str], None] | None = None,
    preemption_signal: signal.Signals | None = None,
) -> Iterator[None]:
    """Inside the block the first SIGINT or SIGTERM (or :data:`FORWARDED_SIGNAL`) calls ``on_signal(name)`` instead
    of interrupting; a second SIGINT or SIGTERM raises ``KeyboardInterrupt`` at once. ``preemption_signal`` (e.g.
    SIGUSR1 from SLURM before a time limit; it may also be SIGTERM) calls ``on_preemption(name)``, once.

    Blocks nest: the innermost one is told, and a block that begins after a signal was held by an outer one is told
    of it at once. Only in the main thread (elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outermost = not _consumers
    numbers = [*GRACEFUL_SIGNALS, FORWARDED_SIGNAL]
    added_preemption = preemption_signal is not None and preemption_signal not in _preemption_signals
    if preemption_signal is not None and preemption_signal not in numbers:
        numbers.append(preemption_signal)
    previous = {number: signal.getsignal(number) for number in numbers}
    if added_preemption:
        _preemption_signals.add(int(preemption_signal))  # type: ignore[arg-type]
    for number in numbers:
        if outermost or signal.getsignal(number) is not _handle:
            signal.signal(number, _handle)
    _consumers.append((on_signal, on_preemption))
    try:
        if _received:
            on_signal(_received[0])
        if _preempted and on_preemption is not None:
            on_preemption(_preempted[0])
        yield
    finally:
        _consumers.pop()
        if added_preemption:
            _preemption_signals.discard(int(preemption_signal))  # type: ignore[arg-type]
        if outermost:
            _received.clear()
            _received_directly.clear()
            _preempted.clear()
        for number, handler in previous.items():
            if outermost or handler is not _handle:
                signal.signal(number, handler)
