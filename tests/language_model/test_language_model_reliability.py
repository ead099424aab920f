"""The language-model trainer on the training run's safety nets: a stalled collective names the rank, the split and
the step; ranks that would train different text are refused (2 forked CPU ranks)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
from flair.trainers.language_model_trainer import TextCorpus
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricLanguageModelTrainer

from .lm_support import LM_OPTIONS, tiny_corpus, tiny_language_model

pytestmark = pytest.mark.multiprocess
FORK = {"accelerator": "cpu", "devices": 2, "strategy": "ddp_fork", "mini_batch_size": 2}


class _StallsOnRank1(FabricLanguageModelTrainer):
    """Rank 1 stalls in its first validation of split 1 (12 s, then it finds rank 0 gone, sooner than torch's 30-s
    wait before it kills a rank that holds its SIGTERM), so rank 0 waits for it in the validation all-reduce."""

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        if torch.distributed.get_rank() == 1:
            time.sleep(12)
        return super().evaluate(data_source, eval_batch_size, sequence_length)


def test_a_stalled_collective_names_the_rank_the_split_and_the_step(tmp_path: Path) -> None:
    corpus = tiny_corpus(tmp_path / "corpus")
    started = time.monotonic()
    with pytest.raises(
        ProcessRaisedException, match=r"global rank 0 of 2 waited longer than collective_timeout \(3 s\)"
    ) as error:
        _StallsOnRank1(tiny_language_model(corpus), corpus).train(
            tmp_path / "run", collective_timeout=3, **FORK, **LM_OPTIONS
        )
    assert re.search(r"in epoch 1, step \d+: split 1: the validation perplexity all-reduce", str(error.value))
    assert time.monotonic() - started < 90, "ended by the timeout, not by the stalled rank waking up"


class _OtherTextOnRank1(FabricLanguageModelTrainer):
    """Rank 1 trains on a corpus with another character dictionary (built from other files)."""

    def __init__(self, model: Any, corpus: TextCorpus, other: TextCorpus) -> None:
        super().__init__(model, corpus)
        self.other = other

    @property
    def corpus(self) -> TextCorpus:  # type: ignore[override]
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return self.other if rank == 1 else self._corpus

    @corpus.setter
    def corpus(self, value: TextCorpus) -> None:
        self._corpus = value


def test_ranks_that_would_train_other_text_are_refused(tmp_path: Path) -> None:
    corpus = tiny_corpus(tmp_path / "corpus")
    other = tiny_corpus(tmp_path / "other", splits=2)
    trainer = _OtherTextOnRank1(tiny_language_model(corpus), corpus, other)
    with pytest.raises(ProcessRaisedException, match=r"rank 1's corpus differs from rank 0's in .*train"):
        trainer.train(tmp_path / "run", **FORK, **LM_OPTIONS)
    assert not (tmp_path / "run" / "loss.txt").exists(), "refused before training"
