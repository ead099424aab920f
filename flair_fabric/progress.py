"""A progress bar per training epoch, on global rank 0: steps, global samples per second, the latest loss."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm

REFRESH_SECONDS = 0.5  # the loss is read (a device synchronisation) at most this often


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
    """One epoch's bar; :meth:`step` after every training step, :meth:`close` at the end."""

    def __init__(self, enabled: bool, epoch: int, steps: int) -> None:
        self.enabled = enabled
        self.bar = tqdm(total=steps, desc=f"epoch {epoch}", unit="step", disable=not enabled, dynamic_ncols=True)
        self.started = time.perf_counter()
        self.last_refresh = 0.0

    def step(self, samples_so_far: int, loss: Callable[[], float]) -> None:
        """Advance one step; ``samples_so_far`` counts the epoch's data points on all ranks, ``loss`` reads the
        step's loss (called only when the bar refreshes)."""
        if not self.enabled:
            return
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last_refresh >= REFRESH_SECONDS:
            self.last_refresh = now
            rate = samples_so_far / max(now - self.started, 1e-9)
            self.bar.set_postfix({"loss": f"{loss():.4f}", "samples/s": f"{rate:.1f}"}, refresh=False)

    def close(self) -> None:
        """Remove the bar."""
        self.bar.close()
