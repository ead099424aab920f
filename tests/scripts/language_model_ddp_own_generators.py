"""A user's script that trains a character language model on 2 processes with the script relaunch
(``strategy="ddp"``): `python language_model_ddp_own_generators.py OUT`. Each rank makes its own corpus (flair flips
the case of other lines of valid.txt and test.txt on rank 1) and calls ``train`` with its own generators (rank 0:
those of ``seeded()``, rank 1: others), and writes its final weights to OUT/weights-RANK.pt and what it did, step by
step, to OUT/journals/journal-RANK (tests/language_model/lm_support.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from flair_fabric import FabricLanguageModelTrainer
from tests.language_model.lm_support import LM_OPTIONS, journaled, seeded, tiny_corpus, tiny_language_model

if __name__ == "__main__":
    out = Path(sys.argv[1])
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    corpus = tiny_corpus(out / f"corpus-{rank}", case_seed=3 * rank)  # rank 1 reads other case flips
    model = tiny_language_model(corpus)
    for owner, name, method in journaled(out / "journals"):
        setattr(owner, name, method)
    seeded(5 + 7 * rank)  # rank 0: as the one-process reference; rank 1's caller holds other generators
    FabricLanguageModelTrainer(model, corpus).train(
        out / "run",
        mini_batch_size=2,
        devices=2,
        strategy="ddp",
        accelerator="cpu",
        collective_timeout=45,  # ranks that fell out of step end the run (their journals show where they parted)
        **LM_OPTIONS,
    )
    torch.save(model.state_dict(), out / f"weights-{rank}.pt")
