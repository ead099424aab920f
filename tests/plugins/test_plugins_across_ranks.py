"""What the plugin documentation promises about several processes, observed on 2 forked CPU ranks: checkpoints every
k epochs written once by global rank 0, stops agreed right after epoch-level events, no collective in the training
step, and the progress bar drawn on global rank 0 only with the global loss."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest
import torch
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin, TrainingInterrupt
from lightning.fabric.utilities.throughput import Throughput

from flair_fabric import FabricTrainer
from flair_fabric.state import model_files
from flair_fabric.training import log_points
from flair_fabric.training import progress_bar as progress_bar_module
from flair_fabric.training.progress_bar import EpochProgressBar, show_progress_bar
from flair_fabric.training.run import TrainingRun

from ..support import small_trec, state_dict_difference, tiny_text_classifier

STEPS = 30  # per rank and epoch: 60 questions, batches of 1, 2 ranks; log points every 3 steps, step 20 is none
WATCHED_EPOCHS = 2
EVERY_K = 2  # save_model_each_k_epochs
COLLECTIVES = (
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)
_calls = [0]  # Python-level collective calls in this process (each forked rank counts its own)
# what this process's bars were given: ["throughput"] (a new epoch), ["update", time, samples], ["report", loss, rate]
_bar_events: list[list] = []


def _counted(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _calls[0] += 1
        return function(*args, **kwargs)

    return call


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else -1


def _recording_save(record: Path, save: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.save`` that notes which rank writes a file, and under which name."""

    @functools.wraps(save)
    def recording(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        with record.open("a") as handle:
            handle.write(f"{_rank()}\t{f}\n")
        return save(obj, f, *args, **kwargs)

    return recording


def _recording_save_model(record: Path, save_model: Callable[..., Any]) -> Callable[..., Any]:
    """The run's ``save_model`` (what ``trainer.save_model`` calls) that notes which rank calls it, for which file."""

    @functools.wraps(save_model)
    def recording(run: Any, model_file: Any, *args: Any, **kwargs: Any) -> Any:
        with record.open("a") as handle:
            handle.write(f"{_rank()}\t{Path(model_file).name}\n")
        return save_model(run, model_file, *args, **kwargs)

    return recording


class _RecordedThroughput(Throughput):
    """Lightning's Throughput (the bar's samples/s) that notes what it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _bar_events.append(["throughput"])

    def update(self, *, time: float, batches: int, samples: int, **kwargs: Any) -> None:
        _bar_events.append(["update", time, samples])
        super().update(time=time, batches=batches, samples=samples, **kwargs)


def _recorded_report(report: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(report)
    def recording(bar: Any, global_loss: float, global_samples_per_second: float) -> None:
        _bar_events.append(["report", global_loss, global_samples_per_second])
        report(bar, global_loss, global_samples_per_second)

    return recording


class Watcher(TrainerPlugin):
    """On every rank: its stderr in ``stderr-rank<r>.txt``, the Python-level collectives of each training epoch,
    the train/batch_loss records of each epoch; written to ``watched-rank<r>.json`` after training."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.epoch = 0
        self.calls_at_start = 0
        self.collectives: dict[int, int] = {}
        self.batch_losses: dict[int, list[float]] = {}
        self.steps: dict[int, int] = {}
        self.stderr: TextIO | None = None
        self.saved_stderr: TextIO | None = None

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        self.saved_stderr = sys.stderr
        self.stderr = (self.out / f"stderr-rank{self.trainer.global_rank}.txt").open("w")
        sys.stderr = self.stderr

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.epoch = epoch
        self.calls_at_start = _calls[0]

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        self.steps[self.epoch] = self.steps.get(self.epoch, 0) + 1

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.collectives[epoch] = _calls[0] - self.calls_at_start

    @TrainerPlugin.hook
    def metric_recorded(self, record: Any) -> None:
        if str(record.name) == "train/batch_loss":
            self.batch_losses.setdefault(self.epoch, []).append(float(record.value))

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        sys.stderr = self.saved_stderr
        assert self.stderr is not None
        self.stderr.close()
        record = {"collectives": self.collectives, "batch_losses": self.batch_losses, "steps": self.steps}
        (self.out / f"watched-rank{self.trainer.global_rank}.json").write_text(json.dumps(record))
        (self.out / f"bar-events-rank{self.trainer.global_rank}.json").write_text(json.dumps(_bar_events))


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One training on 2 forked ranks, 30 steps of one question per rank and epoch, with the bar asked for
    (``progress_bar=True``) and ``save_model_each_k_epochs=2``; collectives, model-file saves and writes, and what the
    bar is given are recorded."""
    out = tmp_path_factory.mktemp("watched")
    corpus = small_trec(train_size=2 * STEPS)
    model = tiny_text_classifier(corpus)
    with pytest.MonkeyPatch.context() as patch:  # the forked ranks inherit the patched functions
        for name in COLLECTIVES:
            patch.setattr(torch.distributed, name, _counted(getattr(torch.distributed, name)))
        patch.setattr(torch, "save", _recording_save(out / "model-file-writes.tsv", torch.save))
        patch.setattr(TrainingRun, "save_model", _recording_save_model(out / "save-model.tsv", TrainingRun.save_model))
        patch.setattr(log_points, "Throughput", _RecordedThroughput)
        patch.setattr(EpochProgressBar, "report", _recorded_report(EpochProgressBar.report))
        FabricTrainer(model, corpus).train(
            out,
            max_epochs=WATCHED_EPOCHS,
            mini_batch_size=1,
            learning_rate=0.05,
            save_model_each_k_epochs=EVERY_K,
            progress_bar=True,
            plugins=[Watcher(out)],
            accelerator="cpu",
            devices=2,
            strategy="ddp_fork",
        )
    yield out


def _watched(out: Path, rank: int) -> dict:
    record = json.loads((out / f"watched-rank{rank}.json").read_text())
    return {key: {int(epoch): value for epoch, value in values.items()} for key, values in record.items()}


def _stderr(out: Path, rank: int) -> str:
    """What rank ``rank`` wrote to its stderr, with tqdm's carriage returns kept (``read_text`` would turn them
    into newlines)."""
    return (out / f"stderr-rank{rank}.txt").read_bytes().decode()


def _closed_bars(stderr: str) -> dict[int, list[str]]:
    """Per epoch, the final rendering of each bar that was closed (tqdm ends a kept bar with a newline)."""
    closed: dict[int, list[str]] = {}
    for line in stderr.split("\n")[:-1]:
        rendering = line.split("\r")[-1]
        match = re.match(r"epoch (\d+): +100%", rendering)
        if match:
            closed.setdefault(int(match.group(1)), []).append(rendering)
    return closed


@pytest.mark.multiprocess
def test_checkpoint_every_k_epochs_is_written_once_by_global_zero_atomically(watched_run: Path) -> None:
    """save_model_each_k_epochs=2 on 2 ranks: only model_epoch_2.pt, written by global rank 0 alone into a temporary
    file of the run's folder (then renamed), readable by flair in one process."""
    assert sorted(path.name for path in watched_run.glob("model_epoch_*.pt")) == ["model_epoch_2.pt"]
    every_write = [line.split("\t") for line in (watched_run / "model-file-writes.tsv").read_text().splitlines()]
    writes = [(rank, path) for rank, path in every_write if "model_epoch_" in path]
    assert [rank for rank, _ in writes] == ["0"], writes
    # every rank reaches the save (trainer.save_model), once
    calls = (watched_run / "save-model.tsv").read_text().splitlines()
    assert sorted(call for call in calls if "model_epoch_" in call) == ["0\tmodel_epoch_2.pt", "1\tmodel_epoch_2.pt"]
    written = Path(writes[0][1])
    assert written.parent == watched_run and written.name.startswith(".model_epoch_2.pt.") and written.suffix == ".tmp"
    assert not written.exists() and not list(watched_run.glob(".*.tmp"))
    saved = TextClassifier.load(watched_run / "model_epoch_2.pt")
    final = TextClassifier.load(watched_run / "final-model.pt")  # the weights at the end of epoch 2 as well
    assert state_dict_difference(saved.state_dict(), final.state_dict()) == 0.0


@pytest.mark.multiprocess
def test_trainer_save_model_writes_each_file_once_from_global_zero(watched_run: Path) -> None:
    """Every trainer.save_model of the run (model_epoch_2.pt, best-model.pt at each new best, final-model.pt), called
    on both ranks, writes its file exactly once, on global rank 0; rank 1 writes no file at all."""
    calls = [line.split("\t") for line in (watched_run / "save-model.tsv").read_text().splitlines()]
    writes = [line.split("\t") for line in (watched_run / "model-file-writes.tsv").read_text().splitlines()]
    assert [rank for rank, _ in writes if rank != "0"] == [], writes
    names = sorted({name for _, name in calls})
    assert {"model_epoch_2.pt", "final-model.pt", "best-model.pt"} <= set(names), names
    for name in names:
        called = [sum(1 for rank, each in calls if (rank, each) == (str(r), name)) for r in (0, 1)]
        written = sum(1 for _, path in writes if Path(path).name.startswith(f".{name}."))
        assert called[0] == called[1] == written, (name, called, written)
    assert [name for _, name in calls].count("final-model.pt") == 2, "final-model.pt: one save, on both ranks"


@pytest.mark.multiprocess
def test_no_collective_is_added_to_the_training_step(watched_run: Path) -> None:
    """The ranks meet after before_training_epoch, at flair's 10 log points (steps 3, 6, ..., 30), at step 20 (the
    agreement every 20 steps: not a log point here) and at the epoch's end, each a fabric.all_reduce (a barrier and an
    all-reduce): exactly 13 agreements in the 30 steps, none in the other steps. Before the first step, rank 0 sends
    the shuffled epoch's order (one fabric.broadcast)."""
    agreements, order = 1 + 10 + 1 + 1, 1
    for rank in (0, 1):
        watched = _watched(watched_run, rank)
        assert watched["steps"] == {epoch: STEPS for epoch in range(1, WATCHED_EPOCHS + 1)}
        expected = {epoch: 2 * agreements + order for epoch in range(1, WATCHED_EPOCHS + 1)}
        assert watched["collectives"] == expected, rank


@pytest.mark.multiprocess
def test_the_training_bar_is_drawn_on_global_rank_zero_only(watched_run: Path) -> None:
    """progress_bar=True: one bar per epoch, closed once, on global rank 0; rank 1 draws nothing."""
    rank0, rank1 = _stderr(watched_run, 0), _stderr(watched_run, 1)
    bars = _closed_bars(rank0)
    assert {epoch: len(renderings) for epoch, renderings in bars.items()} == {1: 1, 2: 1}
    assert all(f"{STEPS}/{STEPS}" in renderings[0] for renderings in bars.values())
    started = re.findall(r"epoch (\d+): +0%\|[^\r\n]*\| 0/\d+ \[00:00<\?, \?step/s\]", rank0)
    assert started == ["1", "2"], "a bar renders its empty start once, when it is created"
    assert re.findall(r"epoch \d+: +\d+%", rank1) == [], rank1[-2000:]


@pytest.mark.multiprocess
def test_the_bar_shows_the_global_loss_so_far(watched_run: Path) -> None:
    """The epoch's last step is a log point: the bar's loss is then the mean loss of all data points of both
    ranks in that epoch (each batch_loss record is one question's loss), not rank 0's own."""
    bars = _closed_bars(_stderr(watched_run, 0))
    rank0, rank1 = _watched(watched_run, 0), _watched(watched_run, 1)
    for epoch in range(1, WATCHED_EPOCHS + 1):
        losses = rank0["batch_losses"][epoch] + rank1["batch_losses"][epoch]
        assert len(losses) == 2 * STEPS
        shown = re.search(r"loss=([0-9.]+)", bars[epoch][0])
        assert shown is not None, bars[epoch][0]
        assert float(shown.group(1)) == pytest.approx(statistics.fmean(losses), abs=6e-5), epoch
        assert "samples/s=" in bars[epoch][0]


@pytest.mark.multiprocess
def test_the_bar_shows_the_global_samples_per_second(watched_run: Path) -> None:
    """At each log point the bar's samples/s is the data points of both ranks over the time they took: Lightning's
    Throughput over the last 3 log points (before that, since the epoch's start), fed the global counts."""
    events = json.loads((watched_run / "bar-events-rank0.json").read_text())
    epochs: list[list[list]] = []
    for event in events:
        if event[0] == "throughput":
            epochs.append([])
        else:
            epochs[-1].append(event)
    assert len(epochs) == WATCHED_EPOCHS
    bars = _closed_bars(_stderr(watched_run, 0))
    for epoch, happened in enumerate(epochs, start=1):
        updates: list[tuple[float, int]] = []
        for event in happened:
            if event[0] == "update":
                updates.append((event[1], event[2]))
                continue
            (now, samples), (then, before) = updates[-1], updates[-3] if len(updates) >= 3 else (0.0, 0)
            assert event[2] == pytest.approx((samples - before) / (now - then), rel=1e-12), (epoch, updates)
        assert [samples for _, samples in updates] == [2 * step for step in range(3, STEPS + 1, 3)], epoch
        assert f"samples/s={happened[-1][2]:.1f}" in bars[epoch][0], bars[epoch][0]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stderr", "notebook", "shown"),
    [(io.StringIO, False, False), (_Terminal, False, True), (io.StringIO, True, True)],
    ids=["log-file", "terminal", "notebook"],
)
def test_the_default_draws_the_bar_only_where_someone_watches(
    monkeypatch: pytest.MonkeyPatch, stderr: type[io.StringIO], notebook: bool, shown: bool
) -> None:
    """progress_bar=None: a bar only when stderr is a terminal or in a notebook; True always, False never (global
    rank 0; other ranks never)."""
    monkeypatch.setattr(sys, "stderr", stderr())
    monkeypatch.setattr(progress_bar_module, "in_jupyter_kernel", lambda: notebook)
    assert show_progress_bar(None, is_global_zero=True) is shown
    assert show_progress_bar(True, is_global_zero=True) is True
    assert show_progress_bar(False, is_global_zero=True) is False
    assert not any(show_progress_bar(choice, is_global_zero=False) for choice in (None, True, False))


# --- stops agreed right after the epoch-level events --------------------------------------------------------------


class StopAtEvent(TrainerPlugin):
    """Raises ``TrainingInterrupt`` on rank 1 only, in ``event`` of epoch ``epoch``; records on every rank which
    epochs started, how many steps ran and which epochs were evaluated (``events-rank<r>.json``)."""

    def __init__(self, out: Path, event: str, epoch: int) -> None:
        super().__init__()
        self.out, self.event, self.epoch = out, event, epoch
        self.started: list[int] = []
        self.evaluated: list[int] = []
        self.steps = 0

    def _maybe_stop(self, event: str, epoch: int) -> None:
        if event == self.event and epoch == self.epoch and self.trainer.global_rank == 1:
            raise TrainingInterrupt(f"rank 1 stops in {event} of epoch {epoch}")

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.started.append(epoch)
        self._maybe_stop("before_training_epoch", epoch)

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        self.steps += 1

    @TrainerPlugin.hook
    def after_evaluation(self, epoch: int, **kw: Any) -> None:
        self.evaluated.append(epoch)
        self._maybe_stop("after_evaluation", epoch)

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        record = {"started": self.started, "evaluated": self.evaluated, "steps": self.steps}
        (self.out / f"events-rank{self.trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("event", "expected"),
    [
        # flair stops at once: epoch 2 trains no step and is not evaluated
        ("before_training_epoch", {"started": [1, 2], "evaluated": [1], "steps": 6}),
        # epoch 2 is evaluated, epoch 3 never starts
        ("after_evaluation", {"started": [1, 2], "evaluated": [1, 2], "steps": 12}),
    ],
)
def test_a_stop_in_an_epoch_level_event_is_agreed_right_after_it(
    event: str, expected: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """A stop raised on rank 1 in an epoch-level event stops both ranks right after that event, where flair's own
    trainer stops (24 questions per rank, batches of 4: 6 steps per epoch). progress_bar is left at None and standard
    error is captured (a log, not a terminal): no bar is drawn."""
    corpus = small_trec()
    FabricTrainer(tiny_text_classifier(corpus), corpus).train_custom(
        tmp_path,
        max_epochs=4,
        mini_batch_size=4,
        plugins=[StopAtEvent(tmp_path, event, epoch=2)],
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
    )
    for rank in (0, 1):
        assert json.loads((tmp_path / f"events-rank{rank}.json").read_text()) == expected, rank
    assert "rank 1 stops in" in (tmp_path / "training.log").read_text()
    assert not os.isatty(2)
    drawn = re.findall(r"epoch \d+: +\d+%", capfd.readouterr().err)
    assert drawn == [], "progress_bar=None draws no bar into a log"


# --- trainer.save_model and trainer.load_model on global rank 0 and on another rank --------------------------------


class _StandInFabric:
    """What the model-file functions read of one rank's Fabric; rank 0 answers the broadcast "the file exists"."""

    def __init__(self, rank: int) -> None:
        self.global_rank, self.world_size, self.is_global_zero = rank, 2, rank == 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return True


def test_save_model_writes_the_file_once_on_global_rank_zero_and_nothing_on_another_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trainer.save_model`` (the run's ``save_on_global_zero``) on rank 1 writes nothing, and waits; on global rank
    0 it writes the model file once."""
    model = tiny_text_classifier(small_trec())
    saves: list[str] = []
    save = TextClassifier.save

    def counted_save(self: TextClassifier, path: Any, **kw: Any) -> None:
        saves.append(str(path))
        save(self, path, **kw)

    monkeypatch.setattr(TextClassifier, "save", counted_save)
    waits: list[int] = []
    monkeypatch.setattr(model_files, "wait_for_global_zero", lambda fabric: waits.append(fabric.global_rank))
    model_files.save_on_global_zero(_StandInFabric(1), model, tmp_path / "model.pt", checkpoint=False)
    assert (saves, list(tmp_path.iterdir()), waits) == ([], [], [1])
    model_files.save_on_global_zero(_StandInFabric(0), model, tmp_path / "model.pt", checkpoint=False)
    assert len(saves) == 1 and [path.name for path in tmp_path.iterdir()] == ["model.pt"] and waits == [1, 0]
    assert state_dict_difference(TextClassifier.load(tmp_path / "model.pt").state_dict(), model.state_dict()) == 0.0


def test_load_model_reads_the_file_on_global_rank_zero_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainer.load_model`` (the run's ``load_from_global_zero``) reads the file on global rank 0 only and hands its
    weights on (to the strategy, which sends them to the other ranks); rank 1 does not open the file, even where it
    can see it (a shared disk)."""
    corpus = small_trec()
    saved = tiny_text_classifier(corpus, seed=1)
    saved.save(tmp_path / "best-model.pt")
    model = tiny_text_classifier(corpus)
    reads: list[str] = []
    load = TextClassifier.load
    monkeypatch.setattr(TextClassifier, "load", staticmethod(lambda path: (reads.append(str(path)), load(path))[1]))
    monkeypatch.setattr(model_files, "wait_for_global_zero", lambda fabric: None)
    handed: list[Any] = []
    assert model_files.load_from_global_zero(_StandInFabric(1), model, tmp_path / "best-model.pt", handed.append)
    assert (reads, handed) == ([], [None]), "rank 1 gets the weights over the process group, not from the file"
    assert model_files.load_from_global_zero(_StandInFabric(0), model, tmp_path / "best-model.pt", handed.append)
    assert len(reads) == 1
    assert state_dict_difference(handed[1], saved.state_dict()) == 0.0
