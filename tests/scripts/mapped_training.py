"""A user's script that trains on a memory-mapped corpus: `python mapped_training.py CONFIG.json`, relaunched by
Fabric once per extra device. Every rank opens the corpus from the column files through the shared cache (one rank
builds it, the others wait); each rank writes its trained weights and whether it built the cache."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import flair
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair_fabric import FabricTrainer
from flair_fabric.data import MappedCorpus
from flair_fabric.datasets import WNUT16_LABEL_TYPE
from tests.support import tiny_sequence_tagger

if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = Path(config["out"])
    corpus = MappedCorpus.from_column_files(
        config["folder"], {0: "text", 1: WNUT16_LABEL_TYPE}, cache_folder=config["cache"]
    )
    model = tiny_sequence_tagger(corpus)
    flair.set_seed(11)
    trainer = FabricTrainer(model, corpus)
    trainer.train(out / "run", accelerator="cpu", devices=2, strategy="ddp", **config["settings"])
    (out / f"built-{os.getpid()}.json").write_text(json.dumps(corpus.built), encoding="utf-8")
    torch.save(model.state_dict(), out / f"weights-{os.getpid()}.pt")
