"""With several processes the ranks agree on stops, checkpoints and preemptions at flair's log points and every 20
steps: one small all-reduce there, and no collective of flair-fabric's own at any other step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier

STEPS = 250  # per rank, batches of 1: flair's log points every 25 steps, further apart than the agreements every 20
AGREEMENTS = sorted(set(range(20, STEPS + 1, 20)) | set(range(25, STEPS + 1, 25)))
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "all_to_all",
    "all_to_all_single",
)
_called: list[str] = []  # in each forked rank: the collectives it called through torch.distributed


def _counting(name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        _called.append(name)
        return collective(*args, **kwargs)

    return counted


class _CollectivesPerStep(TrainerPlugin):
    """On every rank: the collectives called during each step (from the end of the previous one), written to
    ``<out>/collectives-rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.seen, self.per_step = out, 0, {}

    @TrainerPlugin.hook
    def before_training_batch(self, **kw: Any) -> None:
        self.seen = len(_called)

    @TrainerPlugin.hook
    def after_training_batch(self, batch_no: int, **kw: Any) -> None:
        self.per_step[batch_no + 1] = _called[self.seen :]

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        (self.out / f"collectives-rank{self.trainer.global_rank}.json").write_text(json.dumps(self.per_step))


@pytest.mark.multiprocess
def test_two_ranks_call_one_all_reduce_at_each_agreement_point_and_no_collective_at_other_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 forked ranks, 250 steps each: the steps at which a collective is called through ``torch.distributed`` (the
    gradients' all-reduce inside DDP's C++ reducer aside) are exactly the log points and every 20th step, with one
    all-reduce each."""
    for name in COLLECTIVES:
        if hasattr(torch.distributed, name):
            monkeypatch.setattr(torch.distributed, name, _counting(name, getattr(torch.distributed, name)))
    corpus = small_trec(train_size=2 * STEPS)
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=1,
        mini_batch_size=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        plugins=[_CollectivesPerStep(tmp_path)],
        create_file_logs=False,
    )
    for rank in (0, 1):
        per_step = json.loads((tmp_path / f"collectives-rank{rank}.json").read_text())
        assert len(per_step) == STEPS
        assert [int(step) for step, called in per_step.items() if called] == AGREEMENTS
        # Lightning's all_reduce is a barrier and the all-reduce
        assert all(per_step[str(step)] in (["all_reduce"], ["barrier", "all_reduce"]) for step in AGREEMENTS)
