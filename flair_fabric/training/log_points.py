"""What an epoch's log points report, global across the ranks: flair's log line (loss, time, samples per second,
learning rate) plus tokens per second, real and padded, and the padding fraction, for the log, the progress bar and
the loggers.

Each rank counts, step by step, the tokens of its data points (the lengths of :mod:`flair_fabric.training.lengths`:
subwords for a transformer) and the positions its forward passes compute: each pass (the whole batch, or each chunk
of ``mini_batch_chunk_size``) pads its data points to its longest one. At a log point the counts since the last one
travel with the train loss in the same all-reduce (no extra collective), so every number is the job's: tokens per
second are the job's tokens over global rank 0's time since the last log point, and the padding fraction is
``1 - real / padded`` over all ranks' passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flair.trainers.plugins import MetricRecord
from lightning.fabric.utilities.throughput import Throughput

from flair_fabric.distributed.lockstep import Agreed
from flair_fabric.training.loss import LossTracker
from flair_fabric.training.progress_bar import EpochProgressBar

if TYPE_CHECKING:
    from flair_fabric.training.run_interface import Run

log = logging.getLogger("flair")


def padded_positions(lengths: list[int], chunk_size: int | None) -> int:
    """The positions the forward passes over data points of ``lengths`` compute: each chunk of ``chunk_size`` (all
    of them without one) padded to its longest."""
    size = chunk_size or max(len(lengths), 1)
    chunks = [lengths[start : start + size] for start in range(0, len(lengths), size)]
    return sum(len(chunk) * max(chunk) for chunk in chunks)


class TokenCount:
    """This rank's real and padded token positions since the last log point."""

    def __init__(self, lengths_of: Callable[[list], list[int]]) -> None:
        self.lengths_of = lengths_of
        self.real = self.padded = 0

    def add(self, batch: list, chunk_size: int | None) -> None:
        """Count one step's batch, passed in chunks of ``chunk_size`` (``None``: whole)."""
        lengths = self.lengths_of(batch) if batch else []
        self.real += sum(lengths)
        self.padded += padded_positions(lengths, chunk_size)

    def taken(self) -> tuple[float, float]:
        """The counts, which start again from zero."""
        counts, self.real, self.padded = (float(self.real), float(self.padded)), 0, 0
        return counts


class EpochLog:
    """The log points of one epoch (or of its rest, after a mid-epoch resume) on every rank."""

    def __init__(self, run: Run, epoch: int, total: int, first_step: int, epoch_loss: LossTracker) -> None:
        self.run, self.epoch, self.total, self.first_step = run, epoch, total, first_step
        self.start = self.last = time.time()
        self.carried = epoch_loss.data_points  # read before this start (a resumed epoch)
        self.throughput = Throughput(window_size=3)  # Lightning's: samples/s over the last log points, for the bar
        self.tokens = TokenCount(run.length_of)

    def after_step(self, batch: list) -> None:
        """Count this rank's batch of the step just taken."""
        run = self.run
        chunk_size = run.progress.chunk_size if run.arguments.chunks_on_out_of_memory else None
        self.tokens.add(batch, chunk_size or run.flair_arguments.mini_batch_chunk_size)

    def log_point(self, batch_no: int, epoch_loss: LossTracker, bar: EpochProgressBar) -> tuple[Agreed, str]:
        """All ranks: the global loss and counts (the collective where the ranks also agree on stops); global rank
        0 logs the line, every rank records the numbers for the loggers, the bar shows the recent rate. Returns
        what the ranks agreed and flair's learning-rate text."""
        run, trainer = self.run, self.run.trainer
        so_far, agreed = run.global_loss(epoch_loss, *self.tokens.taken())
        real, padded = agreed.values[2:]
        now = time.time()
        elapsed, since_last = now - self.start, max(now - self.last, 1e-9)
        self.last = now
        lr_info, momentum_info = trainer._get_current_lr_and_momentum(run.progress.batch_count)
        padding = 1.0 - real / padded if padded > 0 else 0.0
        log.info(
            f"epoch {self.epoch}"
            f" - iter {batch_no + 1}/{self.total}"
            f" - loss {so_far.mean:.8f}"
            f" - time (sec): {elapsed:.2f}"
            f" - samples/sec: {(so_far.data_points - self.carried) / elapsed:.2f}"
            f"{lr_info}{momentum_info}"
            f" - tokens/sec: {real / since_last:.0f} (padded {padded / since_last:.0f}) - padding: {padding:.1%}"
        )
        step = run.progress.batch_count
        for name, value in [
            ("tokens_per_second", real / since_last),
            ("padded_tokens_per_second", padded / since_last),
            ("padding_fraction", padding),
        ]:
            trainer._record(MetricRecord.scalar(("train", name), value, step))
        done, read = batch_no + 1 - self.first_step, so_far.data_points - self.carried  # since this start
        if read >= done:  # (Lightning's monitor counts at least a sample per batch)
            self.throughput.update(time=elapsed, batches=done, samples=read)
        bar.report(so_far.mean, self.throughput.compute().get("device/samples_per_sec", read / elapsed))
        return agreed, lr_info
