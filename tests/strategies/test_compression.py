"""Gradient compression by choice (``FlairDDPStrategy(gradient_compression=...)``) on two forked CPU ranks: the ranks
stay identical, the result moves a little away from exact DDP (the hook is really used) and bad input is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer, FlairDDPStrategy

from ..support import small_trec, state_dict_difference, tiny_text_classifier


class _SavesEveryRanksWeights(TrainerPlugin):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def after_training(self, **kwargs: Any) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save(self.trainer.model.state_dict(), self.folder / f"rank{rank}.pt")


def _train(folder: Path, **strategy_options: Any) -> list[dict[str, torch.Tensor]]:
    folder.mkdir()
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    FabricTrainer(model, corpus).train(
        folder,
        max_epochs=2,
        mini_batch_size=4,
        learning_rate=0.5,
        shuffle=False,
        accelerator="cpu",
        devices=2,
        strategy=FlairDDPStrategy(start_method="fork", **strategy_options),
        plugins=[_SavesEveryRanksWeights(folder)],
        save_final_model=False,
    )
    return [torch.load(folder / f"rank{rank}.pt") for rank in (0, 1)]


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], float]:
    """Exact DDP's trained weights, and how far training moved them (largest change of a weight)."""
    rank0, rank1 = _train(tmp_path_factory.mktemp("exact") / "run")
    assert state_dict_difference(rank0, rank1) == 0.0
    return rank0, state_dict_difference(tiny_text_classifier(small_trec()).state_dict(), rank0)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("compression", "options", "largest_share"),
    # measured: bf16 1.1%, fp16 0.07%, PowerSGD (rank 1, on a model this small) 53% of training's change
    [("bf16", None, 0.03), ("fp16", None, 0.003), ("powersgd", {"start_powerSGD_iter": 2}, 0.8)],
)
def test_compressed_ranks_stay_identical_and_close_to_exact(
    exact: tuple[dict[str, torch.Tensor], float], tmp_path: Path, compression: str, options: Any, largest_share: float
) -> None:
    exact_weights, moved = exact
    rank0, rank1 = _train(tmp_path / "run", gradient_compression=compression, powersgd_options=options)
    assert state_dict_difference(rank0, rank1) == 0.0, "every rank applies the same (decompressed) gradient"
    share = state_dict_difference(rank0, exact_weights) / moved
    assert 0.0 < share <= largest_share, f"{compression}: {share:.4f} of training's change away from exact DDP"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"gradient_compression": "int8"}, r"gradient_compression='int8' is not valid"),
        ({"powersgd_options": {"matrix_approximation_rank": 2}}, r"powersgd_options is given but"),
        ({"gradient_compression": "powersgd", "powersgd_options": {"rank": 2}}, r"unknown option\(s\) \['rank'\]"),
    ],
)
def test_bad_compression_arguments_are_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FlairDDPStrategy(**arguments)
