"""``global_batch_size``: the data points of one optimizer step over all ranks. Runs on 1, 2 and 4 processes with the
same global batch train flair's one-process model with that batch size (steps, schedule, weights); a resume on
another number of processes continues the same run; bad input is refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.samplers import FlairSampler
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from flair_fabric import FabricTrainer, FlairFSDPStrategy
from flair_fabric.state.training_state import newest_checkpoint, read_progress

from ..support import GROUPED_BY_2, GroupedByLength, small_trec, state_dict_difference, tiny_text_classifier

# fine_tune: AdamW and flair's LinearScheduler with warm-up, counted in steps; shuffled
SETTINGS: dict[str, Any] = {
    "max_epochs": 2,
    "learning_rate": 0.05,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "create_file_logs": False,
}
ON_CPU: dict[str, Any] = {"accelerator": "cpu", "strategy": "ddp_fork"}
GROUPED = GROUPED_BY_2


class _LearningRates(TrainerPlugin):
    """On global rank 0: the learning rate after every step, written to ``<out>/lr.json`` after training."""

    def __init__(self, out: Path, kill_at: int | None = None) -> None:
        super().__init__()
        self.out, self.kill_at, self.trace = out, kill_at, []

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        if batch_count == self.kill_at:  # every rank, at the same step: a job that dies without a chance to save
            os.kill(os.getpid(), signal.SIGKILL)
        self.trace.append(self.trainer.optimizer.param_groups[0]["lr"])

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if getattr(self.trainer, "is_global_zero", True):
            (self.out / "lr.json").write_text(json.dumps(self.trace))


def _flair_one_process(
    out: Path, corpus: Any, batch_size: int, sampler: FlairSampler | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """flair's own trainer, one process, batch ``batch_size``: the reference weights and learning rates."""
    model = tiny_text_classifier(corpus)
    plugins = [_LearningRates(out)]
    ModelTrainer(model, corpus).fine_tune(out, mini_batch_size=batch_size, plugins=plugins, sampler=sampler, **SETTINGS)
    return model.state_dict(), json.loads((out / "lr.json").read_text())


def _train_losses(folder: Path) -> list[float]:
    rows = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    column = rows[0].index("TRAIN_LOSS")
    return [float(row[column]) for row in rows[1:]]


def _fabric(out: Path, corpus: Any, devices: int, **options: Any) -> torch.nn.Module:
    model = tiny_text_classifier(corpus)
    plugins = [_LearningRates(out, options.pop("kill_at", None))]
    run = {**SETTINGS, **ON_CPU, **options}
    FabricTrainer(model, corpus).fine_tune(out, devices=devices, plugins=plugins, **run)
    return model


@pytest.mark.multiprocess
def test_the_same_global_batch_on_one_two_and_four_ranks_trains_flairs_one_process_model(tmp_path: Path) -> None:
    """45 questions, global batch 6: 8 steps per epoch whatever the number of ranks (4 ranks read 2, 2, 1, 1 points
    per step, and in the last step of 3 points rank 3 reads none). Every run ends at the weights and learning rates
    of flair's trainer with batch 6 (within 1e-5: AdamW on sums added in another order)."""
    corpus = small_trec(train_size=45)
    flair_runs = {
        False: _flair_one_process(tmp_path / "flair", corpus, batch_size=6),
        True: _flair_one_process(tmp_path / "flair-grouped", corpus, batch_size=6, sampler=GroupedByLength(6, 2)),
    }
    assert len(flair_runs[False][1]) == 16
    assert state_dict_difference(flair_runs[False][0], flair_runs[True][0]) > 1e-3, "grouping changed the batches"
    runs: list[tuple[int, dict[str, Any]]] = [(1, {}), (2, {}), (4, {}), (4, {"balance_batches": False})]
    runs += [(2, {"strategy": "ddp_spawn"}), (2, {"strategy": FlairFSDPStrategy(start_method="fork")})]
    runs += [(devices, {**GROUPED, "val_check_interval": 3}) for devices in (1, 2, 4)]
    runs += [
        (2, {**GROUPED, "mini_batch_chunk_size": "auto"}),
        (2, {**GROUPED, "strategy": "ddp_spawn"}),
        (2, {**GROUPED, "strategy": FlairFSDPStrategy(start_method="fork")}),
    ]
    for number, (devices, options) in enumerate(runs):
        out = tmp_path / f"run-{number}"
        model = _fabric(out, corpus, devices, global_batch_size=6, **options)
        weights, learning_rates = flair_runs["group_by_length" in options]
        assert state_dict_difference(model.state_dict(), weights) <= 1e-5, (devices, options)  # AdamW: float order
        assert json.loads((out / "lr.json").read_text()) == pytest.approx(learning_rates, rel=1e-9), devices


@pytest.mark.multiprocess
@pytest.mark.parametrize(("first", "then", "grouped"), [(2, 1, False), (1, 2, False), (2, 2, True), (2, 1, True)])
def test_a_run_stopped_mid_epoch_resumes_on_another_number_of_ranks_to_the_uninterrupted_weights(
    tmp_path: Path, first: int, then: int, grouped: bool
) -> None:
    """Killed at step 11 (of 24, in epoch 2 of 3) with a checkpoint every 2 steps; resumed with the same
    global_batch_size (and grouping) on the other number of processes: the uninterrupted run's weights, learning
    rates and train losses (epoch 3's order drawn from the generators global rank 0 had)."""
    corpus = small_trec(train_size=45)
    options: dict[str, Any] = {"global_batch_size": 6, "max_epochs": 3, **(GROUPED if grouped else {})}
    uninterrupted = _fabric(tmp_path / "whole", corpus, first, **options).state_dict()
    expected = json.loads((tmp_path / "whole" / "lr.json").read_text())
    folder = tmp_path / "stopped"
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        _fabric(folder, corpus, first, **options, checkpoint_every_n_steps=2, kill_at=11)
    saved = read_progress(newest_checkpoint(folder))
    assert (saved.epoch, saved.step_in_epoch, saved.global_batch_size) == (1, 2, 6)
    try:
        resumed = _fabric(folder, corpus, then, **options, resume_from="auto")
    except ValueError as error:  # the checkpoint did not record what this run has
        pytest.fail(f"the same run's checkpoint was refused: {error}")
    assert state_dict_difference(resumed.state_dict(), uninterrupted) <= 1e-5
    assert _train_losses(folder) == pytest.approx(_train_losses(tmp_path / "whole"), rel=1e-5), "each point once"
    assert json.loads((folder / "lr.json").read_text()) == pytest.approx(expected[10:], rel=1e-9)
    with pytest.raises(ValueError, match=r"global_batch_size=6.*global_batch_size=8"):
        _fabric(folder, corpus, then, **{**options, "global_batch_size": 8}, resume_from="auto")
    other = {"group_by_length": False} if grouped else GROUPED
    with pytest.raises(ValueError, match=r"trained with group_by_length=.*this run has group_by_length="):
        _fabric(folder, corpus, then, **{**options, **other}, resume_from="auto")


def test_a_resume_that_changes_the_global_batch_is_refused_naming_both_values(tmp_path: Path) -> None:
    """A checkpoint of a run that named global_batch_size=6, resumed with 4, or with a mini_batch_size that gives
    another global batch, is refused before anything trains; a run by mini_batch_size resumed with a
    global_batch_size other than its own is refused too."""
    corpus = small_trec(train_size=12)
    named = tmp_path / "named"
    _fabric(named, corpus, 1, global_batch_size=6, max_epochs=1, checkpoint_every_n_epochs=1)
    for other, message in [
        ({"global_batch_size": 4}, r"trained with global_batch_size=6, this run has global_batch_size=4"),
        ({"mini_batch_size": 3}, r"trained with global_batch_size=6, this run has global_batch_size=3"),
    ]:
        with pytest.raises(ValueError, match=message):
            _fabric(named, corpus, 1, resume_from="auto", max_epochs=2, **other)
    by_process = tmp_path / "by-process"
    _fabric(by_process, corpus, 1, mini_batch_size=4, max_epochs=1, checkpoint_every_n_epochs=1)
    with pytest.raises(ValueError, match=r"global_batch_size=4 \(1 process\(es\) x mini_batch_size\).*=5"):
        _fabric(by_process, corpus, 1, resume_from="auto", max_epochs=2, global_batch_size=5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"global_batch_size": 8, "mini_batch_size": 3, "devices": 2}, r"mini_batch_size=3 disagrees with global_b"),
        ({"global_batch_size": 7, "mini_batch_size": 3, "devices": 2}, r"each reads 3 or 4 data points"),
        ({"global_batch_size": 1, "devices": 2}, r"global_batch_size=1 is smaller than the 2 processes"),
        ({"global_batch_size": 0}, r"global_batch_size=0 is not valid"),
        ({"global_batch_size": 2.5}, r"global_batch_size=2.5 is not valid"),
        ({"global_batch_size": True}, r"global_batch_size=True is not valid"),
        ({"mini_batch_size": None}, r"mini_batch_size=None is not valid"),
        ({"group_by_length": "yes"}, r"group_by_length='yes' is not valid"),
        ({"group_by_length": True, "group_by_length_window": 0}, r"group_by_length_window=0 is not valid"),
        ({"group_by_length": True, "sampler": GroupedByLength(6, 2)}, r"group_by_length=True with a sampler"),
    ],
)
def test_bad_batch_sizes_are_refused_before_anything_starts(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    """Refused by the caller with a ValueError naming the argument: an error raised in the ranks instead (forked
    here, so that a run that was let through trains and fails the test) is not a refusal before launch."""
    corpus = small_trec(train_size=12)
    with pytest.raises((ValueError, ProcessRaisedException)) as raised:
        trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
        trainer.train(tmp_path, accelerator="cpu", strategy="ddp_fork", max_epochs=1, **options)
    assert isinstance(raised.value, ValueError), f"refused in the ranks, not before launch: {raised.value!r}"
    assert re.search(message, str(raised.value)), str(raised.value)
    assert not (tmp_path / "loss.tsv").exists()


def test_a_mini_batch_size_that_agrees_with_the_global_batch_is_accepted_positionally_too(tmp_path: Path) -> None:
    """flair's ``fine_tune(base_path, warmup_fraction, learning_rate, decoder_learning_rate, mini_batch_size)``
    positionally: mini_batch_size=6 agrees with global_batch_size=6 on one process, 5 does not; left out, it follows
    from the global batch (not flair's default)."""
    corpus = small_trec(train_size=12)
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    on_cpu = {"max_epochs": 1, "global_batch_size": 6, "accelerator": "cpu", "create_file_logs": True}
    trainer.fine_tune(tmp_path / "positional", 0.1, 0.01, None, 6, **on_cpu)
    with pytest.raises(ValueError, match=r"mini_batch_size=5 disagrees"):
        trainer.fine_tune(tmp_path / "disagrees", 0.1, 0.01, None, 5, **on_cpu)
    for method, folder in [(trainer.fine_tune, tmp_path / "fine-tune"), (trainer.train, tmp_path / "train")]:
        try:
            method(folder, **on_cpu)
        except ValueError as error:  # flair's default mini_batch_size taken for one the caller gave
            pytest.fail(f"global_batch_size=6 without mini_batch_size was refused: {error}")
        log = (folder / "training.log").read_text()
        assert 'mini_batch_size: "6" per device' in log and 'global batch size: "6" (1 process(es))' in log
