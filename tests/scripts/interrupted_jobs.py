"""A user's script (a notebook kernel alike) whose Ctrl-C reaches the caller alone while forked workers run one of the
other jobs: `python interrupted_jobs.py OUT lm|predict|evaluate`. The language-model trainer stops at its next
agreement point (one Ctrl-C); predict and evaluate, which have none, stop at once on the second Ctrl-C and raise
KeyboardInterrupt. Prints what happened."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair.data import Sentence
from flair.models import TextClassifier

import flair_fabric
from flair_fabric import FabricLanguageModelTrainer
from tests.language_model.lm_support import tiny_corpus, tiny_language_model
from tests.support import small_trec, tiny_text_classifier

OUT = Path(sys.argv[1])
JOB = sys.argv[2]
FORK = {"accelerator": "cpu", "devices": 2, "strategy": "ddp_fork"}


class SlowClassifier(TextClassifier):
    """Predicts slowly and says when it has started (so that the interrupt comes while the workers run)."""

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        (OUT / "started").touch()
        time.sleep(0.5)
        return super().predict(sentences, *args, **kwargs)


def interrupt_the_caller_when(ready: Path, times: int) -> None:
    while not ready.exists():
        time.sleep(0.2)
    for _ in range(times):
        os.kill(os.getpid(), signal.SIGINT)  # the caller alone, as a notebook's kernel gets it
        time.sleep(2.0)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    if JOB == "lm":
        corpus = tiny_corpus(OUT / "corpus", splits=3)
        model = tiny_language_model(corpus)
        threading.Thread(target=interrupt_the_caller_when, args=(OUT / "run" / "loss.txt", 1), daemon=True).start()
        FabricLanguageModelTrainer(model, corpus).train(
            OUT / "run", sequence_length=20, mini_batch_size=2, max_epochs=500, num_workers=0, **FORK
        )
        lines = (OUT / "run" / "loss.txt").read_text().splitlines()
        print(f"stopped after {len(lines) - 1} split(s); test scored: {lines[-1].startswith('TEST')}")
    else:
        corpus = small_trec()
        model = tiny_text_classifier(corpus, model_class=SlowClassifier)
        sentences = [Sentence(sentence.to_original_text()) for sentence in list(corpus.train) * 4]
        threading.Thread(target=interrupt_the_caller_when, args=(OUT / "started", 2), daemon=True).start()
        try:
            if JOB == "predict":
                flair_fabric.predict(model, sentences, mini_batch_size=2, **FORK)
            else:
                flair_fabric.evaluate(model, sentences, "question_class", mini_batch_size=2, **FORK)
            print("finished without an interrupt")
        except KeyboardInterrupt as error:
            print(f"interrupted: {error}")
