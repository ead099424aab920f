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
(:mod:`flair_fabric.lockstep`); then every rank stops at the same point the way flair stops on ``KeyboardInterrupt``
(it saves ``final-model.pt``). A second signal stops at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric import Fabric

log = logging.getLogger("flair")

GRACEFUL_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_started_processes(fabric: Fabric) -> None:
    """Kill the processes Fabric's script relaunch started from this one (they would wait for it forever)."""
    launcher = fabric.strategy.launcher
    for process in getattr(launcher, "procs", []):
        if process.poll() is None:
            process.kill()


def exit_with_parent(poll_seconds: float = 1.0) -> None:
    """In a process started by rank 0: exit as soon as the parent process is gone (a daemon thread watches)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        log.error(f"the process that started this rank (pid {parent}) is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="flair-fabric-parent-watch", daemon=True).start()


@contextlib.contextmanager
def graceful_interrupts(on_signal: Callable[[str], None]) -> Iterator[None]:
    """Inside the block the first SIGINT or SIGTERM calls ``on_signal(name)`` instead of interrupting; a second one
    raises ``KeyboardInterrupt`` at once. Only in the main thread (elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[str] = []

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if received:
            raise KeyboardInterrupt(f"{name} received a second time")
        received.append(name)
        on_signal(name)

    previous = {number: signal.getsignal(number) for number in GRACEFUL_SIGNALS}
    for number in GRACEFUL_SIGNALS:
        signal.signal(number, handle)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
