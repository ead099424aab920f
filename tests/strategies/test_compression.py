"""Gradient compression by choice (``FlairDDPStrategy(gradient_compression=...)``) on two forked CPU ranks: the ranks
stay identical, the result moves a little away from exact DDP (the hook is really used) and bad input is refused."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.datasets import TREC_LABEL_TYPE

from ..support import out_of_step_is_a_hang, small_trec, state_dict_difference, tiny_text_classifier


class _SavesEveryRanksWeights(TrainerPlugin):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def after_training(self, **kwargs: Any) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save(self.trainer.model.state_dict(), self.folder / f"rank{rank}.pt")


def _larger_classifier(corpus: Any) -> TextClassifier:
    """About 5 MB of parameters: several DDP buckets of 1 MB (DDP's first bucket alone holds up to 1 MiB)."""
    flair.set_seed(7)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=1024)
    document = DocumentPoolEmbeddings([words], fine_tune_mode="nonlinear")
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def _train(folder: Path, larger: bool = False, **strategy_options: Any) -> list[dict[str, torch.Tensor]]:
    folder.mkdir()
    corpus = small_trec()
    model = _larger_classifier(corpus) if larger else tiny_text_classifier(corpus)
    FabricTrainer(model, corpus).train(
        folder,
        max_epochs=2,
        mini_batch_size=4,
        learning_rate=0.5,
        shuffle=False,
        accelerator="cpu",
        devices=2,
        # a short timeout: a collective mismatch ends the run instead of hanging it
        strategy=FlairDDPStrategy(start_method="fork", timeout=timedelta(seconds=60), **strategy_options),
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


@pytest.mark.multiprocess
def test_powersgd_over_several_buckets_keeps_the_ranks_collectives_in_step(tmp_path: Path) -> None:
    # PowerSGD all-reduces each bucket twice, the second time from a callback: unordered, two buckets' collectives
    # can meet in a different order on each rank (gloo: "Received data size doesn't match expected size")
    options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}
    with out_of_step_is_a_hang():
        rank0, rank1 = _train(
            tmp_path / "run", larger=True, bucket_cap_mb=1, gradient_compression="powersgd", powersgd_options=options
        )
    assert state_dict_difference(rank0, rank1) == 0.0


@pytest.mark.multiprocess
def test_powersgd_with_unused_parameters_is_refused_with_the_reason(tmp_path: Path) -> None:
    # measured: with find_unused_parameters=True the ranks' PowerSGD collectives fall out of step on gloo
    with pytest.raises(
        ProcessRaisedException, match=r"gradient_compression='powersgd' with find_unused_parameters=True"
    ):
        _train(tmp_path / "run", find_unused_parameters=True, gradient_compression="powersgd")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("compression", "largest_share"), [("bf16", 0.03), ("fp16", 0.003)])
def test_half_precision_compression_works_where_ddp_searches_for_unused_parameters(
    exact: tuple[dict[str, torch.Tensor], float], tmp_path: Path, compression: str, largest_share: float
) -> None:
    """Unlike PowerSGD, bf16 and fp16 are accepted with find_unused_parameters=True and train as without it: the
    ranks stay identical, close to exact DDP."""
    exact_weights, moved = exact
    try:
        rank0, rank1 = _train(tmp_path / "run", find_unused_parameters=True, gradient_compression=compression)
    except Exception as error:  # the refusal that belongs to PowerSGD alone
        if "with find_unused_parameters=True" in str(error):
            pytest.fail(f"gradient_compression={compression!r} with find_unused_parameters=True was refused: {error}")
        raise
    assert state_dict_difference(rank0, rank1) == 0.0
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
