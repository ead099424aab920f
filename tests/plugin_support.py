"""Plugins and stand-ins used by the rank-aware plugin tests (imported by the tests and by the test scripts)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import TrainerPlugin, TrainingInterrupt

from flair_fabric import rank_zero_only

from .support import processes


class StepRecorder(TrainerPlugin):
    """On every rank: learning rate after each step, the train/batch_loss records, the epochs that ended; written
    to ``<out>/record-rank<r>.json`` after training."""

    def __init__(self, out: Path, save_weights: bool = False) -> None:
        super().__init__()
        self.out = Path(out)
        self.save_weights = save_weights
        self.learning_rates: list[float] = []
        self.batch_losses: list[float] = []
        self.epochs: list[int] = []
        self.batch_counts: list[int] = []
        self.steps_per_epoch: int | None = None

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        self.steps_per_epoch = self.trainer.steps_per_epoch  # what a plugin reads of the trainer, inside a hook

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        self.learning_rates.append(self.trainer.optimizer.param_groups[0]["lr"])
        self.batch_counts.append(batch_count)

    @TrainerPlugin.hook
    def metric_recorded(self, record: Any) -> None:
        if str(record.name) == "train/batch_loss":
            self.batch_losses.append(float(record.value))

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.epochs.append(epoch)

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {
            "learning_rates": self.learning_rates,
            "batch_losses": self.batch_losses,
            "epochs": self.epochs,
            "batch_counts": self.batch_counts,
            "steps_per_epoch": self.steps_per_epoch,
            "learning_rate_at_the_end": self.trainer.optimizer.param_groups[0]["lr"],
        }
        rank = self.trainer.global_rank
        (self.out / f"record-rank{rank}.json").write_text(json.dumps(record))
        if self.save_weights:
            torch.save(self.model.state_dict(), self.out / f"weights-rank{rank}.pt")


class StopOnOneRank(TrainerPlugin):
    """Raises ``TrainingInterrupt`` on one rank only: after step ``at_step`` or at the end of epoch ``at_epoch``. Its
    message does not name the rank (the trainer's log line must)."""

    def __init__(self, rank: int, at_step: int | None = None, at_epoch: int | None = None) -> None:
        super().__init__()
        self.rank, self.at_step, self.at_epoch = rank, at_step, at_epoch

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        if self.trainer.global_rank == self.rank and batch_count == self.at_step:
            raise TrainingInterrupt(f"plugin wants to stop after step {batch_count}")

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        if self.trainer.global_rank == self.rank and epoch == self.at_epoch:
            raise TrainingInterrupt(f"plugin wants to stop after epoch {epoch}")


class HookCounter(TrainerPlugin):
    """One hook on every rank, one on global rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.every_rank_calls = 0
        self.rank_zero_calls = 0

    @TrainerPlugin.hook("after_training_epoch")
    def count_everywhere(self, **kw: Any) -> None:
        self.every_rank_calls += 1

    @TrainerPlugin.hook("after_training_epoch")
    @rank_zero_only
    def count_on_rank_zero(self, **kw: Any) -> None:
        self.rank_zero_calls += 1


class FakeClearmlLogger:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def report_scalar(self, title: str, series: str, value: float, iteration: int) -> None:
        self.scalars.append((series, float(value), iteration))

    def report_text(self, *args: Any, **kw: Any) -> None:
        pass


class FakeClearmlTask:
    """Stands in for a ClearML task given to flair's ClearmlLoggerPlugin."""

    task_id = "fake-task"

    def __init__(self) -> None:
        self.logger = FakeClearmlLogger()

    def get_logger(self) -> FakeClearmlLogger:
        return self.logger


class KillJobAt(TrainerPlugin):
    """SIGKILLs the whole job (every process of its process group) when epoch ``epoch`` starts on global rank 0: a
    machine that dies, with no chance to clean up."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        if epoch == self.epoch and self.trainer.is_global_zero:
            os.killpg(os.getpgrp(), signal.SIGKILL)


class KillAtStep(TrainerPlugin):
    """Every rank dies at optimizer step ``step`` (SIGKILL, no chance to save), after its after_training_batch."""

    def __init__(self, step: int | None) -> None:
        super().__init__()
        self.step = step

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        if batch_count == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class FailAt(TrainerPlugin):
    """On rank ``rank``, when epoch ``epoch`` starts (or, with ``step``, before that step of the epoch): raise an error
    (``how="raise"``), die (``how="kill"``), stall for ``stall_seconds`` (ten minutes) without closing anything
    (``how="stall"``; ``how="hang"``: with SIGINT and SIGTERM blocked, as in native code) or stop (``how="stop"``,
    SIGSTOP: its sockets stay open, so its peers' backend would wait for it)."""

    def __init__(
        self,
        epoch: int,
        rank: int,
        how: str,
        stall_seconds: float = 600,
        step: int | None = None,
        marker: str | None = None,
    ) -> None:
        super().__init__()
        self.epoch, self.rank, self.how, self.stall_seconds, self.step = epoch, rank, how, stall_seconds, step
        self.marker = marker  # a file written as the rank fails (for a test that waits for it)

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        if self.step is None:
            self._fail(epoch)

    @TrainerPlugin.hook
    def before_training_batch(self, epoch: int, batch_no: int, **kw: Any) -> None:
        if self.step is not None and batch_no + 1 == self.step:
            self._fail(epoch)

    def _fail(self, epoch: int) -> None:
        if epoch != self.epoch or self.trainer.global_rank != self.rank:
            return
        if self.marker is not None:
            Path(self.marker).write_text(self.how)
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "stall":
            time.sleep(self.stall_seconds)
        if self.how == "hang":  # stuck where no signal reaches it (e.g. in native code): SIGINT and SIGTERM wait
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            time.sleep(self.stall_seconds)
        if self.how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected failure on rank {self.rank} in epoch {epoch}")


def listening_sockets_of_job() -> list[tuple[int, str]]:
    """Every listening TCP socket (IPv4 and IPv6) held by a process of this job: (pid, local address), from
    /proc/net/tcp{,6} matched with the sockets in /proc/<pid>/fd. The job is the process that started it (this one, or
    the parent of a spawned or forked worker) and everything below it; not the process group, which under pytest-xdist
    holds the other worker's tests too."""
    listening: dict[str, str] = {}
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening[fields[9]] = _address(fields[1], family)
    found = []
    for pid in _job_processes():
        try:
            descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                link = os.readlink(descriptor)
            except OSError:  # closed meanwhile (e.g. the one listing this folder)
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                found.append((pid, listening[link[8:-1]]))
    return found


def _job_processes() -> list[int]:
    """The process that started this job and all its descendants."""
    root = os.getppid() if multiprocessing.parent_process() is not None else os.getpid()
    children: dict[int, list[int]] = {}
    for process in processes():
        children.setdefault(process.parent, []).append(process.pid)
    job, pending = [], [root]
    while pending:
        pid = pending.pop()
        job.append(pid)
        pending.extend(children.get(pid, []))
    return job


def _address(hex_address: str, family: int) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # the kernel prints the address in host byte order, 32 bits at a time
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{socket.inet_ntop(socket.AF_INET if family == 4 else socket.AF_INET6, words)}:{int(port, 16)}"


class ListeningSockets(TrainerPlugin):
    """On global rank 0 after the first epoch (every rank has met and connected): the listening sockets of the
    job's processes, written to ``<out>/listening.json``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = Path(out)

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        if epoch == 1 and self.trainer.is_global_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "listening.json").write_text(json.dumps(listening_sockets_of_job()))
