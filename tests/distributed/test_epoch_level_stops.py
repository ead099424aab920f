"""Epoch-level stops (a plugin's ``TrainingInterrupt`` after an epoch or after its evaluation) with several processes
happen exactly where flair's own trainer takes them in one process, on every rank, even when one rank stops alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin, TrainingInterrupt

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier


class _EpochEvents(TrainerPlugin):
    """The epoch-level events of a run, with their epoch, written to ``<out>/events-rank<r>.json`` at its end."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.events = out, []

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.events.append(["before_training_epoch", epoch])

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.events.append(["after_training_epoch", epoch])

    @TrainerPlugin.hook
    def after_evaluation(self, epoch: int, **kw: Any) -> None:
        self.events.append(["after_evaluation", epoch])

    @TrainerPlugin.hook
    def training_interrupt(self, **kw: Any) -> None:
        self.events.append(["training_interrupt", None])

    @TrainerPlugin.hook
    def after_training_loop(self, **kw: Any) -> None:
        self.events.append(["after_training_loop", None])

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        self.events.append(["after_training", None])
        rank = getattr(self.trainer, "global_rank", 0)  # flair's own trainer has no ranks
        (self.out / f"events-rank{rank}.json").write_text(json.dumps(self.events))


class _StopAt(TrainerPlugin):
    """Raises ``TrainingInterrupt`` from ``event`` of epoch ``epoch``, on global rank ``rank`` only."""

    def __init__(self, event: str, epoch: int, rank: int) -> None:
        super().__init__()
        self.event, self.epoch, self.rank = event, epoch, rank

    def _maybe_stop(self, event: str, epoch: int) -> None:
        if event == self.event and epoch == self.epoch and getattr(self.trainer, "global_rank", 0) == self.rank:
            raise TrainingInterrupt(f"stopped from {event} of epoch {epoch}")

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        self._maybe_stop("after_training_epoch", epoch)

    @TrainerPlugin.hook
    def after_evaluation(self, epoch: int, **kw: Any) -> None:
        self._maybe_stop("after_evaluation", epoch)


def _events(folder: Path, rank: int) -> list[list[Any]]:
    return json.loads((folder / f"events-rank{rank}.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("event", ["after_training_epoch", "after_evaluation"])
def test_an_epoch_level_stop_on_one_rank_stops_every_rank_where_flair_stops(tmp_path: Path, event: str) -> None:
    """flair's trainer in one process is the reference: a stop from ``after_training_epoch`` of epoch 2 ends the run
    before that epoch's evaluation, one from ``after_evaluation`` right after it. With 2 processes, rank 1 stopping
    alone, both ranks see the same epoch-level events as flair's run."""
    corpus = small_trec()
    settings = {"max_epochs": 4, "mini_batch_size": 4, "learning_rate": 0.1}
    flair_dir, fabric_dir = tmp_path / "flair", tmp_path / "fabric"
    flair_dir.mkdir()
    fabric_dir.mkdir()
    ModelTrainer(tiny_text_classifier(corpus), corpus).train(
        flair_dir, plugins=[_EpochEvents(flair_dir), _StopAt(event, epoch=2, rank=0)], **settings
    )
    expected = _events(flair_dir, 0)
    epoch_one = [["before_training_epoch", 1], ["after_training_epoch", 1], ["after_evaluation", 1]]
    epoch_two = [["before_training_epoch", 2], ["after_training_epoch", 2]]
    if event == "after_evaluation":
        epoch_two.append(["after_evaluation", 2])
    assert expected == [*epoch_one, *epoch_two, ["training_interrupt", None], ["after_training", None]]

    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        fabric_dir,
        plugins=[_EpochEvents(fabric_dir), _StopAt(event, epoch=2, rank=1)],
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        **settings,
    )
    assert _events(fabric_dir, 0) == expected
    assert _events(fabric_dir, 1) == expected
    log = (fabric_dir / "training.log").read_text()
    assert log.count("DEV : loss") == (2 if event == "after_evaluation" else 1)
    assert "stopped from" in log and (fabric_dir / "final-model.pt").is_file()
