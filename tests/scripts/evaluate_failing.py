"""A user's script that scores a model with flair_fabric.evaluate on 2 ranks started by the script relaunch, where the
model raises while predicting on global rank 0 (and global rank 1 stalls); rank 0 catches the error and stays alive
for a minute: `python evaluate_failing.py`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flair_fabric
from tests.support import small_trec, tiny_text_classifier


class _Failing:
    def predict(self, *args, **kwargs):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            raise RuntimeError("injected failure while predicting on rank 0")
        time.sleep(600)  # rank 1 would wait for ever: the guards must end it


if __name__ == "__main__":
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    model.predict = _Failing().predict  # type: ignore[method-assign]
    try:
        flair_fabric.evaluate(model, corpus.test, "question_class", accelerator="cpu", devices=2, strategy="ddp")
    except RuntimeError as error:  # the caller goes on (as a notebook would): its relaunched rank must not
        print(f"caught on rank 0: {error}", flush=True)
        time.sleep(60)
        sys.exit(1)
