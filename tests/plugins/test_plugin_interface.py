"""docs/plugins.md, "What a plugin may use of the trainer": inside a hook ``self.trainer`` is a
:class:`~flair_fabric.plugins.interface.DistributedTrainer` whose ``fabric`` is the run's own, so a plugin's collective
(entered on every rank) combines the ranks' values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer
from flair_fabric.plugins.interface import DistributedTrainer

from ..support import small_trec, tiny_text_classifier


class _SumsOverRanks(TrainerPlugin):
    """At each epoch's end, on every rank: ``trainer.fabric.all_reduce`` of ``rank + 1`` and ``10 ** rank``; written
    to ``<out>/interface-rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.seen: list[dict[str, Any]] = []

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        trainer = self.trainer
        rank = trainer.global_rank
        summed = trainer.fabric.all_reduce(torch.tensor([rank + 1.0, 10.0**rank]), reduce_op="sum")
        self.seen.append(
            {
                "epoch": epoch,
                "protocol": isinstance(trainer, DistributedTrainer),
                "world_size": trainer.world_size,
                "summed": [float(value) for value in summed],
            }
        )
        (self.out / f"interface-rank{rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.multiprocess
def test_a_plugins_collective_through_trainer_fabric_combines_every_rank(tmp_path: Path) -> None:
    corpus = small_trec(train_size=16, dev_size=4, test_size=4)
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=2,
        mini_batch_size=4,
        plugins=[_SumsOverRanks(tmp_path)],
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
    )
    seen = [json.loads((tmp_path / f"interface-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        assert [each["epoch"] for each in seen[rank]] == [1, 2]
        assert all(each["protocol"] and each["world_size"] == 2 for each in seen[rank])
        assert all(each["summed"] == [1.0 + 2.0, 1.0 + 10.0] for each in seen[rank]), "both ranks' values, summed"
