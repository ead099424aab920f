"""Training functions that Ray Train's workers run in tests/elastic (imported by the workers: no pytest here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flair.trainers.plugins import TrainerPlugin
from ray.train import UserCallback

from flair_fabric import FabricTrainer
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
    """Each bad input is refused in every worker; then the run, global rank 1 lost after step
    ``config['lose_after']`` of the first attempt; rank 0's answers return."""
    answers: dict[str, Any] = {
        "devices": refused(devices=3, accelerator="cpu"),
        "num_nodes": refused(num_nodes=2, accelerator="cpu"),
        "resume_from": refused(resume_from=config["foreign_checkpoint"], accelerator="cpu"),
    }
    folder = Path(config["folder"])
    plugin = LoseRank1Once(config["lose_after"], folder / "lost", folder / "steps-after-restart")
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


class LoseRank1Once(TrainerPlugin):
    """Global rank 1 of the first attempt dies after step ``step`` (the process ends at once, as a lost machine);
    global rank 0 of the attempt that ends writes the steps it ran to ``steps_file``."""

    def __init__(self, step: int, marker: Path, steps_file: Path) -> None:
        super().__init__()
        self.step, self.marker, self.steps_file, self.ran = step, marker, steps_file, []

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        trainer: Any = self.trainer
        self.ran.append(trainer.optimizer_steps)
        if trainer.global_rank == 1 and trainer.optimizer_steps == self.step and not self.marker.exists():
            self.marker.touch()
            os._exit(1)

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.global_rank == 0:  # type: ignore[union-attr]
            self.steps_file.write_text(" ".join(map(str, self.ran)))


class ReportsToFile(UserCallback):
    """In Ray's controller: one JSON line per report Ray collected from every worker (workers, checkpoint, metrics)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        line = {"workers": len(metrics), "checkpoint": checkpoint is not None, "metrics": metrics[0]}
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
