"""A script that starts spawned workers must guard its main function with ``if __name__ == "__main__":``.

A spawned worker is a fresh Python process that imports the user's script again (as ``__mp_main__``; a module run
with ``python -m`` too; ``python -c`` and notebooks are not imported again) before it reads its job. Without the
guard, that import starts the run again, at module level. Lightning refuses that in the worker; here the worker
refuses it at once (:func:`refuse_a_run_while_spawned`, before anything of the run is built) and leaves a mark that
the caller looks for once its workers have ended (:func:`watch_for_a_missing_guard`), so that the caller's own error
says the same. The caller never waits for such a worker: the job goes to the workers through a file
(:mod:`flair_fabric.launch.runner`), not through the pipe that starts them, which a worker that is gone never reads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from pathlib import Path

MARK_VARIABLE = "FLAIR_FABRIC_MISSING_GUARD_MARK"
"""Where a spawned worker that found the guard missing leaves its mark: a file in the caller's private hand-off
folder, named by the caller in the environment its workers inherit."""

_GUARD = """Launching multiple processes with the 'spawn' start method requires that your script guards the main \
function with an `if __name__ == "__main__"` clause. For example:

    def main():
        corpus = ...
        FabricTrainer(model, corpus).train("out/", devices=2, strategy="ddp_spawn")

    if __name__ == "__main__":
        main()

Alternatively, run with strategy="ddp" (the script relaunch, which needs no guard)."""

IN_THE_WORKER = (
    "This process was spawned to be a worker and imports the script again, which starts a run at module level. "
    + _GUARD
)
IN_THE_CALLER = (
    "A spawned worker imported the script again, which starts a run at module level, and exited before it received "
    "its job. " + _GUARD
)


class MissingMainGuard(RuntimeError):
    """A script started a run with spawned workers without ``if __name__ == "__main__":``."""


def refuse_a_run_while_spawned() -> None:
    """Raise :class:`MissingMainGuard` in a spawned process that is still importing the script (multiprocessing's
    bootstrap, before it has its job): the script started a run at module level. Marks it for the caller first."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    mark = os.environ.get(MARK_VARIABLE)
    if mark:
        with contextlib.suppress(OSError):  # the caller's folder may be gone already: the error stands alone then
            Path(mark).touch()
    raise MissingMainGuard(IN_THE_WORKER)


def watch_for_a_missing_guard(folder: Path) -> Path:
    """Name the mark a spawned worker leaves in ``folder`` (the environment the workers inherit; the caller restores
    it afterwards); returns the mark's path."""
    mark = folder / "missing-main-guard"
    os.environ[MARK_VARIABLE] = str(mark)
    return mark
