"""A progress bar per training epoch, on global rank 0: steps, global samples per second, the global loss."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def show_progress_bar(progress_bar: bool | None, is_global_zero: bool) -> bool:
    """Whether this rank draws the bar: global rank 0 only; ``None`` means only when stderr is a terminal, so
    logs of batch jobs stay free of bar lines unless ``progress_bar=True`` asks for them."""
    if progress_bar is not None and not isinstance(progress_bar, bool):
        raise ValueError(
            f"progress_bar={progress_bar!r} is not valid: pass True (always), False (never) or None (only when"
            " the output is a terminal)."
        )
    if not is_global_zero:
        return False
    return sys.stderr.isatty() if progress_bar is None else progress_bar


class EpochProgressBar:
    """One epoch's bar: :meth:`step` after every training step, :meth:`report` at flair's log points (where the loss
    is all-reduced anyway, so the bar adds no collective), :meth:`close` at the end."""

    def __init__(self, enabled: bool, epoch: int, steps: int) -> None:
        self.bar = tqdm(total=steps, desc=f"epoch {epoch}", unit="step", disable=not enabled, dynamic_ncols=True)

    def step(self) -> None:
        """One training step done."""
        self.bar.update(1)

    def report(self, global_loss: float, global_samples_per_second: float) -> None:
        """Show the epoch's global mean loss so far and the global throughput."""
        self.bar.set_postfix({"loss": f"{global_loss:.4f}", "samples/s": f"{global_samples_per_second:.1f}"})

    def close(self) -> None:
        """Remove the bar."""
        self.bar.close()
