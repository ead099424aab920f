"""A user's script that trains with forked workers and gets Ctrl-C (SIGINT to its process group) after epoch 2:
`python interrupted_workers.py OUT`. Prints the difference between final-model.pt and the caller's model."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flair.nn
from flair.models import TextClassifier

from flair_fabric import FabricTrainer
from tests.support import counting_saves, small_trec, tiny_text_classifier

OUT = Path(sys.argv[1])


def press_ctrl_c_after_epoch_2() -> None:
    log = OUT / "training.log"
    while not (log.exists() and "EPOCH 2 done" in log.read_text()):
        time.sleep(0.2)
    os.killpg(os.getpgrp(), signal.SIGINT)


if __name__ == "__main__":
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    threading.Thread(target=press_ctrl_c_after_epoch_2, daemon=True).start()
    # every model file written, by which rank (the forked workers inherit it): "<rank> <file>" lines
    flair.nn.Model.save = counting_saves(OUT / "saves.txt", flair.nn.Model.save)
    trainer = FabricTrainer(model, corpus)
    settings = {"accelerator": "cpu", "devices": 2, "strategy": "ddp_fork", "use_final_model_for_eval": True}
    trainer.train(OUT, max_epochs=200, mini_batch_size=4, **settings)
    final = TextClassifier.load(OUT / "final-model.pt").state_dict()
    difference = max(float((final[name] - value).abs().max()) for name, value in model.state_dict().items())
    print(f"final-model.pt differs from the caller's model by {difference}")
