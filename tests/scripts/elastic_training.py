"""A training script as a user runs it under torchrun's elastic agent (``torchrun --nnodes=1:2 --max-restarts=N
--rdzv-backend=c10d ... elastic_training.py <config.json>``): the run lives in a bucket (``base_path`` a URL,
``resume_from="auto"``), so any restart on any number of nodes continues it. Every rank appends one line per optimizer
step to ``<out>/steps.jsonl`` (rank, world size, step) and sleeps ``step_seconds`` after it, so that a test can take
nodes away and bring them back while it trains; rank 0 of the attempt that finishes writes ``<out>/final.pt``.
``fine_tune`` with SGD and flair's linear schedule (counted in steps, so a restart that loses the step count shows).
Config: ``{"out": folder, "base_path": URL, "kwargs": fine_tune arguments, "step_seconds": float}``, optionally
``"optimizer"`` (a name in ``torch.optim``; SGD) and ``"train_size"`` (48)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import TrainerPlugin

import flair_fabric  # noqa: F401  (first, as the docs advise)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flair_fabric import FabricTrainer
from tests.support import small_trec, tiny_text_classifier


class Steps(TrainerPlugin):
    """One line per optimizer step and rank; then a pause."""

    def __init__(self, log: Path, pause: float) -> None:
        super().__init__()
        self.log, self.pause = log, pause

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        line = {"rank": self.trainer.global_rank, "world": self.trainer.world_size, "step": batch_count}
        line["attempt"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        with self.log.open("a") as stream:
            stream.write(json.dumps(line) + "\n")
        time.sleep(self.pause)


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Path(config["out"])
    corpus = small_trec(train_size=config.get("train_size", 48))
    model = tiny_text_classifier(corpus)
    trainer = FabricTrainer(model, corpus)
    plugins = [Steps(out / "steps.jsonl", config["step_seconds"])]
    # SGD: AdamW divides the rounding noise of near-zero gradients by their running size (docs/sharded-training.md)
    kwargs = {"optimizer": getattr(torch.optim, config.get("optimizer", "SGD")), **config["kwargs"]}
    trainer.fine_tune(config["base_path"], plugins=plugins, resume_from="auto", **kwargs)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), out / "final.pt")


if __name__ == "__main__":
    main()
