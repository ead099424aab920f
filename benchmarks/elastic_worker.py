"""The training script of ``elastic_restart.py``, started by torchrun's elastic agents: MiniLM fine-tuned on TREC with
the run in a bucket and ``resume_from="auto"``. Appends timed events to ``<out>/events.jsonl``: the process's start,
the set-up done (``after_setup``), each optimizer step (with the world size), and the training's end.

    torchrun --nnodes=1:2 ... elastic_worker.py <config.json>
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.time()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import build_model, train_only_corpus  # noqa: E402
from flair.trainers.plugins import TrainerPlugin  # noqa: E402

import flair_fabric  # noqa: E402,F401  (first, as the docs advise)
from flair_fabric import FabricTrainer  # noqa: E402


class Events(TrainerPlugin):
    """The set-up's end and every optimizer step, timed."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        self._write("set-up")

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        self._write("step", step=batch_count)

    def _write(self, event: str, **more: Any) -> None:
        line = {"event": event, "rank": self.trainer.global_rank, "world": self.trainer.world_size, **more}
        line |= {"time": time.time(), "pid": os.getpid()}
        with self.log.open("a") as stream:
            stream.write(json.dumps(line) + "\n")


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    log = Path(config["out"]) / "events.jsonl"
    with log.open("a") as stream:
        stream.write(json.dumps({"event": "process", "time": STARTED, "pid": os.getpid()}) + "\n")
    corpus = train_only_corpus(config["train_size"])
    model = build_model("minilm", corpus)
    FabricTrainer(model, corpus).fine_tune(
        config["base_path"],
        plugins=[Events(log)],
        resume_from="auto",
        learning_rate=5e-5,
        global_batch_size=config["global_batch_size"],
        max_epochs=1,
        shuffle=False,
        accelerator="cpu",
        devices="auto",
        checkpoint_every_n_steps=config["every"],
        keep_checkpoints=1,
        create_file_logs=False,
        save_final_model=False,
        use_final_model_for_eval=True,
        progress_bar=False,
    )
    with log.open("a") as stream:
        stream.write(json.dumps({"event": "end", "time": time.time(), "pid": os.getpid()}) + "\n")


if __name__ == "__main__":
    main()
