"""A user's script that predicts with 2 processes started by the script relaunch (``strategy="ddp"``):
`python predict_ddp.py OUT`. Each rank writes the labels its own sentences got, and flair's predict in one process,
to OUT/labels-RANK.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair.data import Sentence

import flair_fabric
from flair_fabric.datasets import TREC_LABEL_TYPE
from tests.support import small_trec, tiny_text_classifier


def labels(sentences: list[Sentence]) -> list[list[tuple[str, float]]]:
    return [[(label.value, round(label.score, 6)) for label in s.get_labels(TREC_LABEL_TYPE)] for s in sentences]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    texts = [sentence.to_original_text() for sentence in corpus.train][:11]
    ours, reference = [Sentence(text) for text in texts], [Sentence(text) for text in texts]
    flair_fabric.predict(model, ours, devices=2, strategy="ddp", accelerator="cpu", mini_batch_size=2)
    model.predict(reference, mini_batch_size=2)
    result = {"ours": labels(ours), "flair": labels(reference)}
    (out / f"labels-{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(result))
