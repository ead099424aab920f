"""A progress bar per training epoch, on global rank 0: steps, global samples per second, the global loss."""

from __future__ import annotations

import multiprocessing
import sys

import tqdm.auto
import tqdm.std

from flair_fabric.launch.environment import in_jupyter_kernel


def show_progress_bar(progress_bar: bool | None, is_global_zero: bool) -> bool:
    """Whether this rank draws the bar: global rank 0 only; ``None`` means only where someone watches (stderr is a
    terminal, or a notebook), so logs of batch jobs stay free of bar lines unless ``progress_bar=True`` asks."""
    if progress_bar is not None and not isinstance(progress_bar, bool):
        raise ValueError(
            f"progress_bar={progress_bar!r} is not valid: pass True (always), False (never) or None (only when"
            " the output is a terminal)."
        )
    if not is_global_zero:
        return False
    return (sys.stderr.isatty() or in_jupyter_kernel()) if progress_bar is None else progress_bar


class EpochProgressBar:
    """One epoch's bar: :meth:`step` after every training step, :meth:`report` at flair's log points (where the loss
    is all-reduced anyway, so the bar adds no collective), :meth:`close` at the end."""

    def __init__(self, enabled: bool, epoch: int, steps: int, done: int = 0) -> None:
        options = {"total": steps, "initial": done, "desc": f"epoch {epoch}", "unit": "step", "disable": not enabled}
        if multiprocessing.parent_process() is None:  # the user's own process: tqdm's notebook widget where it can
            self.bar = tqdm.auto.tqdm(**options, dynamic_ncols=True)
        else:  # a worker forked from a notebook cannot draw widgets; a text bar on stdout (stderr shows red there)
            self.bar = tqdm.std.tqdm(**options, file=sys.stdout if in_jupyter_kernel() else sys.stderr)

    def step(self) -> None:
        """One training step done."""
        self.bar.update(1)

    def report(self, global_loss: float, global_samples_per_second: float) -> None:
        """Show the epoch's global mean loss so far and the global throughput."""
        self.bar.set_postfix({"loss": f"{global_loss:.4f}", "samples/s": f"{global_samples_per_second:.1f}"})

    def close(self) -> None:
        """Remove the bar."""
        self.bar.close()
