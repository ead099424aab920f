"""Training functions that Ray Train's workers run in tests/elastic (imported by the workers: no pytest here)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import ray.train
from flair.trainers.plugins import TrainerPlugin
from ray.train import UserCallback

from flair_fabric import FabricTrainer
from flair_fabric.plugins.ray_report import CHECKPOINT_SAVED
from tests.support import small_trec, tiny_text_classifier

TRAIN_SIZE, GLOBAL_BATCH, EPOCHS, CHECKPOINT_EVERY = 24, 8, 2, 2
"""3 steps an epoch, 6 in all; checkpoints after steps 2, 4 and 6."""


def corpus_and_model() -> tuple[Any, Any]:
    """The run's corpus and model, the same in every process (no dropout, seeded)."""
    corpus = small_trec(train_size=TRAIN_SIZE, dev_size=6, test_size=6)
    return corpus, tiny_text_classifier(corpus)


def fine_tune(base_path: str | Path, **options: Any) -> tuple[Any, dict]:
    """The run as a user's training function writes it; returns the model and flair's result."""
    corpus, model = corpus_and_model()
    result = FabricTrainer(model, corpus).fine_tune(
        base_path,
        max_epochs=EPOCHS,
        global_batch_size=GLOBAL_BATCH,
        learning_rate=0.01,
        checkpoint_every_n_steps=CHECKPOINT_EVERY,
        accelerator="cpu",
        **options,
    )
    return model, result


def weights(model: Any) -> dict[str, list]:
    """The model's weights as plain lists (what a worker returns to the test)."""
    return {name: value.detach().cpu().tolist() for name, value in model.state_dict().items()}


def refused(**options: Any) -> str:
    """The error a run with ``options`` is refused with (before anything starts), or ``"not refused"``."""
    try:
        corpus, model = corpus_and_model()
        FabricTrainer(model, corpus).fine_tune("/nonexistent-never-written", max_epochs=1, **options)
    except ValueError as error:
        return str(error)
    return "not refused"


def train(config: dict) -> dict:
    """The run, whose world the test changes 2 -> 1 -> 2 at the plugin's requests (:class:`ChangeTheWorld`); in the
    last world each bad input is refused in every worker first (once: each start costs seconds). Rank 0's answers
    return."""
    folder = Path(config["folder"])
    answers: dict[str, Any] = {}
    if (folder / "grow").exists():
        answers["devices"] = refused(devices=3, accelerator="cpu")
        answers["num_nodes"] = refused(num_nodes=2, accelerator="cpu")
        answers["resume_from"] = refused(resume_from=config["foreign_checkpoint"], accelerator="cpu")
    plugin = ChangeTheWorld(folder, config["shrink_after"], config["grow_after"])
    model, _ = fine_tune(config["base_path"], devices="auto", plugins=[plugin])
    answers["children"] = _children()
    answers["weights"] = weights(model)
    return answers


def _children() -> list[str]:
    """The command lines of this process's children (a relaunch by Fabric would start copies of the worker)."""
    pid = os.getpid()
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split() if (task / "children").exists() else []
        found += [Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ") for child in children]
    return found


class ChangeTheWorld(TrainerPlugin):
    """Global rank 0 writes each step it ran, after Ray's world size, to ``folder/steps`` (``"2 1"``). In a world of
    2, once the checkpoint after step ``shrink_after`` is complete and before it is reported to Ray, every rank asks
    the test for a node less (``folder/shrink``) and waits to be lost; in a world of 1, before the step after
    ``grow_after`` (its checkpoint reported), for a node more (``folder/grow``), and waits for Ray to resize."""

    WAIT_S = 120

    def __init__(self, folder: Path, shrink_after: int, grow_after: int) -> None:
        super().__init__()
        self.folder, self.shrink_after, self.grow_after = folder, shrink_after, grow_after

    @staticmethod
    def world() -> int:
        return int(ray.train.get_context().get_world_size())

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        trainer: Any = self.trainer
        if trainer.global_rank == 0:
            with (self.folder / "steps").open("a", encoding="utf-8") as steps:
                steps.write(f"{self.world()} {trainer.optimizer_steps}\n")

    @TrainerPlugin.hook(CHECKPOINT_SAVED)
    def checkpoint_saved(self, step: int, **kw: Any) -> None:
        if self.world() == 2 and step == self.shrink_after:
            self._wait("shrink")

    @TrainerPlugin.hook
    def before_training_batch(self, **kw: Any) -> None:
        if self.world() == 1 and self.trainer.optimizer_steps == self.grow_after + 1:  # type: ignore[union-attr]
            self._wait("grow")

    def _wait(self, request: str) -> None:
        (self.folder / request).touch()
        time.sleep(self.WAIT_S)
        raise RuntimeError(f"asked the test to {request} the world: Ray did not restart this worker in {self.WAIT_S} s")


class ReportsToFile(UserCallback):
    """In Ray's controller: one JSON line per report Ray collected from every worker (workers, checkpoint, metrics)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        line = {"workers": len(metrics), "checkpoint": checkpoint is not None, "metrics": metrics[0]}
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
