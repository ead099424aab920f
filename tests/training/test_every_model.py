"""Every flair model type trains on 2 ranks exactly as flair's own trainer trains it on the union of their batches,
also where one rank's batches hold nothing to learn (relation extraction, entity linking, unlabelled sentences)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import flair
import pytest
from flair.trainers import ModelTrainer
from flair.trainers.plugins import MetricRecord, TrainerPlugin
from torch.multiprocessing.spawn import ProcessRaisedException
from torch.utils.data import Subset

from flair_fabric import FabricTrainer, FlairDDPStrategy, FlairFSDPStrategy

from ..model_zoo import NOTHING_TO_LEARN_ON_ODD, ZOO, learns_nothing, limit_passes, rank_batches
from ..support import out_of_step_is_a_hang, state_dict_difference

pytestmark = pytest.mark.multiprocess

BATCH = 2  # per rank; flair's trainer reads 2 * BATCH
COMMON = {
    "max_epochs": 2,
    "learning_rate": 0.1,
    "shuffle": False,
    "use_final_model_for_eval": True,
    "create_file_logs": False,
    "save_final_model": False,  # flair cannot save a Lemmatizer without embeddings
    "eval_batch_size": 1,  # dev batches dealt one by one: rank 1 predicts the odd ones (nothing, for some models)
    "embeddings_storage_mode": "none",
}
# docs/ddp-communication.md: 2-rank weights within 1e-5 of flair's one-process training on the union. Measured
# (docs/testing.md): weights at most 2.4e-7 apart, train losses 1.1e-7 relative, predicted scores and numbers 7.2e-7
WITHIN = 1e-5


class _TrainLosses(TrainerPlugin):
    """Appends every epoch's train loss, at full precision as the loggers get it, to a file (global rank 0 only)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def attach_to_all_processes(self) -> bool:
        return False

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        if record.name == "train/loss":
            with self.path.open("a") as stream:
                stream.write(f"{float(record.value)!r}\n")


def _recording(extra: dict[str, Any], path: Path) -> dict[str, Any]:
    """The model's extra train arguments with a :class:`_TrainLosses` writing to ``path`` among its plugins."""
    return {**extra, "plugins": [*extra.get("plugins", []), _TrainLosses(path)]}


def _assert_same_train_losses(folder: Path, reference: Path) -> None:
    """The train losses of two runs: as recorded (full precision) within ``WITHIN`` relative, and loss.tsv's column
    (4 decimals: values within 1e-5 may round one unit apart)."""
    ours, flairs = ([float(value) for value in (where / "losses").read_text().split()] for where in (folder, reference))
    assert len(ours) == COMMON["max_epochs"], "a train loss per epoch was recorded"
    assert ours == pytest.approx(flairs, rel=WITHIN)
    assert _train_losses(folder / "run") == pytest.approx(_train_losses(reference / "run"), abs=1e-4)


def _train_losses(run_dir: Path) -> list[float]:
    """The TRAIN_LOSS column of flair's loss.tsv."""
    rows = [line.split("\t") for line in (run_dir / "loss.tsv").read_text().splitlines()]
    column = rows[0].index("TRAIN_LOSS")
    return [float(row[column]) for row in rows[1:]]


def _predictions(model: flair.nn.Model, corpus: flair.data.Corpus) -> list[tuple[str, str, float]]:
    """What ``model`` predicts for the test split: (what is labelled, label, score)."""
    sentences = list(corpus.test)
    model.predict(sentences, label_name="zoo_prediction", mini_batch_size=4)
    labels = [label for point in sentences for label in point.get_labels("zoo_prediction")]
    for point in sentences:
        point.remove_labels("zoo_prediction")
    return [(label.data_point.unlabeled_identifier, label.value, label.score) for label in labels]


def _same_predictions(ours: list[tuple[str, str, float]], flairs: list[tuple[str, str, float]]) -> bool:
    if [(where, value) for where, value, _ in ours] != [(where, value) for where, value, _ in flairs]:
        # a regressor predicts a number: compare it as one
        return all(
            where == other_where and abs(float(value) - float(other_value)) < WITHIN
            for (where, value, _), (other_where, other_value, _) in zip(ours, flairs, strict=True)
        )
    return all(abs(score - other) < WITHIN for (_, _, score), (_, _, other) in zip(ours, flairs, strict=True))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_two_ranks_train_like_flair_on_the_union(name: str, tmp_path: Path) -> None:
    reference, corpus, extra = ZOO[name](tmp_path / "reference")
    ModelTrainer(reference, corpus).train(
        tmp_path / "flair" / "run",
        mini_batch_size=2 * BATCH,
        **COMMON,
        **_recording(extra, tmp_path / "flair" / "losses"),
    )

    model, corpus, extra = ZOO[name](tmp_path / "fabric")
    if name in NOTHING_TO_LEARN_ON_ODD:  # the layout this test is about: rank 1's batches learn nothing
        assert all(learns_nothing(model, batch) for batch in rank_batches(list(corpus.train), rank=1))
    trainer = FabricTrainer(model, corpus)
    with out_of_step_is_a_hang():
        trainer.train(
            tmp_path / "fabric" / "run",
            mini_batch_size=BATCH,
            devices=2,
            accelerator="cpu",
            strategy="ddp_fork",
            collective_timeout=20,  # a rank left waiting fails the test quickly
            **COMMON,
            **_recording(extra, tmp_path / "fabric" / "losses"),
        )
    assert state_dict_difference(model.state_dict(), reference.state_dict()) < WITHIN
    # the epoch's train loss is the mean over all data points of both ranks (rank 1 learns nothing for some models)
    _assert_same_train_losses(tmp_path / "fabric", tmp_path / "flair")
    # the caller's model comes back from the forked workers as flair's trainer leaves it
    assert model.training is reference.training is False
    assert model.model_card is not None and set(model.model_card) == set(reference.model_card)
    untrained = ZOO[name](tmp_path / "untrained")[0].state_dict()
    assert state_dict_difference(model.state_dict(), untrained) > 1e-3, "training changed nothing: nothing is proved"
    assert _same_predictions(_predictions(model, corpus), _predictions(reference, corpus))


def _odd_size(size: int) -> int:
    """The largest train size up to ``size`` that leaves 3 points for the last step of 2 ranks with batches of 2."""
    return size - (size - 3) % 4


CHUNKED_RUNS = [  # strategy, balance_batches, the ranks whose memory holds one data point per pass
    *[pytest.param(name, "ddp", True, (1,), id=f"{name}-ddp") for name in NOTHING_TO_LEARN_ON_ODD],
    *[pytest.param(name, "fsdp", True, (0, 1), id=f"{name}-fsdp") for name in NOTHING_TO_LEARN_ON_ODD],
    pytest.param("relation_extractor", "ddp", False, (0, 1), id="relation_extractor-ddp-unbalanced"),
]


@pytest.mark.parametrize(("name", "strategy", "balance_batches", "limited_ranks"), CHUNKED_RUNS)
def test_chunks_that_learn_nothing_and_uneven_chunk_counts_keep_the_ranks_together(
    name: str, strategy: str, balance_batches: bool, limited_ranks: tuple[int, ...], tmp_path: Path
) -> None:
    """Chunks of one point: every chunk of rank 1 learns nothing; with 4k + 3 train points rank 0's last batch has
    2 points (2 chunks) where rank 1's has 1 (1 chunk, padded with an empty one that learns nothing).

    The model runs out of memory on a pass of more than one data point (on one rank or on both), as a GPU that
    holds one chunk would: no pass flair-fabric adds (the stand-in search, the unused-parameter probe, the stand-in
    pass of a step that learns nothing) may hold more than one chunk, or the run dies before or while it trains."""
    reference, corpus, extra = ZOO[name](tmp_path / "reference")
    corpus._train = Subset(corpus.train, range(_odd_size(len(corpus.train))))
    unclipped = {**COMMON, "max_grad_norm": None}  # clipping would hide a wrongly scaled gradient
    ModelTrainer(reference, corpus).train(
        tmp_path / "flair" / "run",
        mini_batch_size=2 * BATCH,
        mini_batch_chunk_size=2,
        **unclipped,
        **_recording(extra, tmp_path / "flair" / "losses"),
    )
    model, corpus, extra = ZOO[name](tmp_path / "fabric")
    corpus._train = Subset(corpus.train, range(_odd_size(len(corpus.train))))
    limit_passes(model, most_points=1, ranks=limited_ranks)
    stalled_after = timedelta(seconds=20)  # a rank left waiting fails the test quickly
    chosen = (
        FlairDDPStrategy(start_method="fork", timeout=stalled_after)
        if strategy == "ddp"
        else FlairFSDPStrategy(start_method="fork", timeout=stalled_after)
    )
    try:
        with out_of_step_is_a_hang():
            FabricTrainer(model, corpus).train(
                tmp_path / "fabric" / "run",
                mini_batch_size=BATCH,
                mini_batch_chunk_size=1,
                balance_batches=balance_batches,
                devices=2,
                accelerator="cpu",
                strategy=chosen,
                **unclipped,
                **_recording(extra, tmp_path / "fabric" / "losses"),
            )
    except ProcessRaisedException as error:
        if "out of memory (injected" in str(error):
            pytest.fail(f"a pass held more data points than one chunk: {error}")
        raise
    assert state_dict_difference(model.state_dict(), reference.state_dict()) < WITHIN
    _assert_same_train_losses(tmp_path / "fabric", tmp_path / "flair")
    untrained = ZOO[name](tmp_path / "untrained")[0].state_dict()
    assert state_dict_difference(model.state_dict(), untrained) > 1e-3, "training changed nothing: nothing is proved"


@pytest.mark.parametrize("name", NOTHING_TO_LEARN_ON_ODD)
def test_auto_chunks_where_one_rank_has_nothing_to_learn(name: str, tmp_path: Path) -> None:
    """``mini_batch_chunk_size="auto"``: rank 0 runs out of memory on any pass of more than one data point and redoes
    its steps in chunks of one, while every batch of rank 1 learns nothing (it sends zeros for every gradient). The
    run ends with the weights and train losses of flair's own trainer on the union of the batches."""
    reference, corpus, extra = ZOO[name](tmp_path / "reference")
    ModelTrainer(reference, corpus).train(
        tmp_path / "flair" / "run",
        mini_batch_size=2 * BATCH,
        **COMMON,
        **_recording(extra, tmp_path / "flair" / "losses"),
    )
    model, corpus, extra = ZOO[name](tmp_path / "fabric")
    limit_passes(model, most_points=1, ranks=(0,))
    try:
        with out_of_step_is_a_hang():
            FabricTrainer(model, corpus).train(
                tmp_path / "fabric" / "run",
                mini_batch_size=BATCH,
                mini_batch_chunk_size="auto",
                devices=2,
                accelerator="cpu",
                strategy="ddp_fork",
                collective_timeout=20,
                **COMMON,
                **_recording(extra, tmp_path / "fabric" / "losses"),
            )
    except ProcessRaisedException as error:
        if "out of memory (injected" in str(error):
            pytest.fail(f"a step that ran out of memory was not redone in chunks: {error}")
        raise
    assert state_dict_difference(model.state_dict(), reference.state_dict()) < WITHIN
    _assert_same_train_losses(tmp_path / "fabric", tmp_path / "flair")
    untrained = ZOO[name](tmp_path / "untrained")[0].state_dict()
    assert state_dict_difference(model.state_dict(), untrained) > 1e-3, "training changed nothing: nothing is proved"
