"""``val_check_interval``: evaluations inside epochs, with everything flair does after an epoch.

References: flair's own ``evaluate`` of the weights a run had at each evaluated step (snapshots), flair's own
``ModelTrainer`` for the weights (evaluating must not change training), flair's ``AnnealOnPlateau`` fed with the
scores the run evaluated, and one process on the union of the ranks' batches."""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin
from flair.training_utils import AnnealOnPlateau
from lightning.fabric.loggers import Logger
from torch.multiprocessing.spawn import ProcessExitedException

import flair_fabric.trainer as trainer_module
from flair_fabric import FabricTrainer, FlairFSDPStrategy, LightningLoggerPlugin

from ..plugin_support import KillAtStep
from ..support import small_trec, state_dict_difference, tiny_text_classifier

# 48 questions in batches of 8: 6 steps per epoch; with val_check_interval=2 evaluations after steps 2 and 4 of every
# epoch and at its end (step 6)
ONE_PROCESS: dict[str, Any] = {
    "max_epochs": 3,
    "mini_batch_size": 8,
    "learning_rate": 0.05,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "create_file_logs": False,
    "use_final_model_for_eval": False,  # best-model.pt is written (fine_tune's default writes none)
}
EVALUATED_STEPS = [2, 4, 6, 8, 10, 12, 14, 16, 18]


def _rows(folder: Path) -> list[dict[str, str]]:
    """loss.tsv as dicts by column title, without the timestamps."""
    lines = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    return [{t: v for t, v in zip(lines[0], row, strict=True) if t != "TIMESTAMP"} for row in lines[1:]]


def _header(folder: Path) -> list[str]:
    return (folder / "loss.tsv").read_text().splitlines()[0].split("\t")


class _Snapshots(TrainerPlugin):
    """The weights after every step, the learning rate of every step and the scores each evaluation reported."""

    def __init__(self, best_model: Path | None = None) -> None:
        super().__init__()
        self.best_model = best_model
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.learning_rates: dict[int, float] = {}  # the one each step trained with
        self.learning_rates_after_epoch: dict[int, float] = {}  # after the epoch's last step
        self.evaluations: list[tuple[float, ...]] = []
        self.best_file_before: dict[int, dict[str, torch.Tensor]] = {}  # best-model.pt as a step found it

    @TrainerPlugin.hook
    def before_training_batch(self, **kw: Any) -> None:
        if self.best_model is not None and self.best_model.exists():
            python_state = random.getstate()
            with torch.random.fork_rng():  # building a model draws random numbers: the run must not see it
                self.best_file_before[len(self.weights) + 1] = TextClassifier.load(self.best_model).state_dict()
            random.setstate(python_state)

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        self.weights[batch_count] = copy.deepcopy(self.model.state_dict())
        self.learning_rates[batch_count] = self.trainer.optimizer.param_groups[0]["lr"]

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.learning_rates_after_epoch[epoch] = self.trainer.optimizer.param_groups[0]["lr"]

    @TrainerPlugin.hook
    def after_evaluation(self, validation_scores: tuple, **kw: Any) -> None:
        self.evaluations.append(tuple(validation_scores))


class _Recorded(Logger):
    """A Lightning logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorded"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _flair_evaluates(model: TextClassifier, weights: dict[str, torch.Tensor], corpus: Any) -> tuple[float, float]:
    """flair's own evaluation of the dev split by ``model`` with these weights: (main score, loss)."""
    model.load_state_dict(weights)
    result = model.evaluate(corpus.dev, gold_label_type=model.label_type, mini_batch_size=32)
    return result.main_score, float(result.loss)


def test_one_process_evaluates_inside_epochs_what_flair_evaluates_for_the_weights_of_those_steps(
    tmp_path: Path,
) -> None:
    corpus = small_trec()
    reference = tiny_text_classifier(corpus, dropout=0.3)
    ModelTrainer(reference, corpus).fine_tune(tmp_path / "flair", **ONE_PROCESS)

    model = tiny_text_classifier(corpus, dropout=0.3)
    snapshots, logger = _Snapshots(best_model=tmp_path / "fabric" / "best-model.pt"), _Recorded()
    FabricTrainer(model, corpus).fine_tune(
        tmp_path / "fabric",
        val_check_interval=2,
        accelerator="cpu",
        devices=1,
        plugins=[snapshots, LightningLoggerPlugin(logger)],
        **ONE_PROCESS,
    )
    # evaluating changes nothing about training: dropout, data order and schedule as in flair's run without them
    # (the final model; at the end both load their best model for the test split)
    flairs_final = TextClassifier.load(tmp_path / "flair" / "final-model.pt").state_dict()
    assert state_dict_difference(snapshots.weights[EVALUATED_STEPS[-1]], flairs_final) == 0.0
    ours_final = TextClassifier.load(tmp_path / "fabric" / "final-model.pt").state_dict()
    assert state_dict_difference(ours_final, flairs_final) == 0.0
    rows = _rows(tmp_path / "fabric")
    assert [int(row["STEP"]) for row in rows] == EVALUATED_STEPS
    assert [int(row["EPOCH"]) for row in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    scores = {}
    for row in rows:
        step = int(row["STEP"])
        scores[step], loss = _flair_evaluates(model, snapshots.weights[step], corpus)
        assert float(row["DEV_F1"]) == pytest.approx(scores[step], abs=1e-4), step
        assert float(row["DEV_LOSS"]) == pytest.approx(loss, abs=1e-4), step
    assert len(set(scores.values())) > 2, "the scores change from evaluation to evaluation: nothing is proved else"
    # the epoch-end rows keep flair's numbers: the train loss of the epoch, the dev score of the epoch's last weights
    flair_rows = _rows(tmp_path / "flair")
    assert [row["TRAIN_LOSS"] for row in rows[2::3]] == [row["TRAIN_LOSS"] for row in flair_rows]
    assert [row["DEV_F1"] for row in rows[2::3]] == [row["DEV_F1"] for row in flair_rows]
    # loss.tsv: flair's columns with STEP after EPOCH; the epoch-end rows are flair's rows in every column but STEP and
    # the learning rate, which is, in every row, the one after the row's step (the next step's), in flair's format
    header, flair_header = (_header(tmp_path / run) for run in ("fabric", "flair"))
    assert header == [flair_header[0], "STEP", *flair_header[1:]]
    for row, flair_row in zip(rows[2::3], flair_rows, strict=True):
        assert {t: v for t, v in row.items() if t not in ("STEP", "LEARNING_RATE")} == {
            t: v for t, v in flair_row.items() if t != "LEARNING_RATE"
        }
    after_step = {step: snapshots.learning_rates[step + 1] for step in EVALUATED_STEPS if step % 6}
    after_step |= {6 * epoch: rate for epoch, rate in snapshots.learning_rates_after_epoch.items()}
    learning_rates = [f"{after_step[int(row['STEP'])]:.4f}" for row in rows]
    assert [row["LEARNING_RATE"] for row in rows] == learning_rates
    assert len(set(learning_rates)) > 3, "the schedule changes the learning rate between rows: nothing is proved else"
    # best-model.pt holds the weights of the first evaluation with the best score so far, inside epochs too
    for evaluated in EVALUATED_STEPS[:-1]:
        so_far = max((step for step in EVALUATED_STEPS if step <= evaluated), key=lambda step: (scores[step], -step))
        assert evaluated + 1 in snapshots.best_file_before, f"no best-model.pt after the evaluation at step {evaluated}"
        difference = state_dict_difference(snapshots.best_file_before[evaluated + 1], snapshots.weights[so_far])
        assert difference == 0.0, f"best-model.pt after step {evaluated} is not step {so_far}'s"
    best_step = max(EVALUATED_STEPS, key=lambda step: (scores[step], -step))
    best = TextClassifier.load(tmp_path / "fabric" / "best-model.pt")
    assert state_dict_difference(best.state_dict(), snapshots.weights[best_step]) == 0.0
    # Lightning's loggers get the scores and train losses at the optimizer step they were evaluated after
    steps_of = {
        name: [step for step, metrics in logger.logged if name in metrics] for name in ("dev/loss", "train/loss")
    }
    assert steps_of == {"dev/loss": EVALUATED_STEPS, "train/loss": EVALUATED_STEPS}


def test_an_interval_that_does_not_divide_the_epoch_still_ends_every_epoch_with_one_evaluation(tmp_path: Path) -> None:
    """48 questions in batches of 4: 12 steps per epoch; every 5 steps, and at the epoch's end (step 12) once."""
    corpus = small_trec()
    FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(
        tmp_path,
        val_check_interval=5,
        accelerator="cpu",
        devices=1,
        **{**ONE_PROCESS, "mini_batch_size": 4, "max_epochs": 2},
    )
    rows = _rows(tmp_path)
    assert [int(row["STEP"]) for row in rows] == [5, 10, 12, 17, 22, 24]
    assert [int(row["EPOCH"]) for row in rows] == [1, 1, 1, 2, 2, 2]


def test_annealing_patience_and_early_stopping_count_evaluations(tmp_path: Path) -> None:
    """flair's annealing (patience 1, factor 0.5) stepped at every evaluation, as flair's AnnealOnPlateau steps when
    it is given flair's evaluate of the weights of each evaluated step; a learning rate below min_learning_rate stops
    training at that evaluation."""
    corpus = small_trec()
    snapshots = _Snapshots()
    learning_rate, factor = 0.5, 0.5
    FabricTrainer(tiny_text_classifier(corpus, dropout=0.3), corpus).train(
        tmp_path / "run",
        val_check_interval=2,
        patience=1,
        anneal_factor=factor,
        min_learning_rate=learning_rate * factor**3 * 1.01,  # stops at the third reduction
        accelerator="cpu",
        devices=1,
        plugins=[snapshots],
        **{**ONE_PROCESS, "max_epochs": 6, "learning_rate": learning_rate},
    )
    # what each evaluation handed to the annealing: flair's evaluate of the weights after that step (score, loss)
    scored = tiny_text_classifier(corpus)
    evaluated = [
        _flair_evaluates(scored, snapshots.weights[2 * (n + 1)], corpus) for n in range(len(snapshots.evaluations))
    ]
    assert [scores[0] for scores in snapshots.evaluations] == [score for score, _ in evaluated]
    assert [scores[1] for scores in snapshots.evaluations] == pytest.approx([loss for _, loss in evaluated], rel=1e-6)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=learning_rate)
    annealing = AnnealOnPlateau(optimizer, mode="max", factor=factor, patience=1)
    expected_lr, reductions, stopped_after = {}, [], None
    for evaluation, scores in enumerate(evaluated):
        step = 2 * (evaluation + 1)
        if annealing.step(*scores):
            reductions.append(step)
        if optimizer.param_groups[0]["lr"] < learning_rate * factor**3 * 1.01:
            stopped_after = step
            break
        expected_lr.update({later: optimizer.param_groups[0]["lr"] for later in (step + 1, step + 2)})
    assert stopped_after is not None and len(reductions) == 3, "the scores must make flair anneal three times"
    assert any(step % 6 for step in reductions), "a reduction inside an epoch, or nothing is proved"
    assert max(snapshots.learning_rates) == stopped_after, "training stops at the evaluation that anneals too far"
    assert {step: snapshots.learning_rates[step] for step in expected_lr if step <= stopped_after} == {
        step: lr for step, lr in expected_lr.items() if step <= stopped_after
    }
    assert len(snapshots.evaluations) == stopped_after // 2
    assert (tmp_path / "run" / "final-model.pt").exists()


@pytest.mark.parametrize(
    ("val_check_interval", "message"),
    [
        (0, r"val_check_interval=0 is not valid: pass a number of optimizer steps"),
        (1.5, r"val_check_interval=1.5 is not valid"),
        (True, r"val_check_interval=True is not valid"),
        ("10", r"val_check_interval='10' is not valid"),
        (7, r"val_check_interval=7 steps is longer than an epoch \(6 optimizer steps .*pass at most 6"),
        (0.1, r"val_check_interval=0.1 of an epoch of 6 optimizer step\(s\) is less than one step: pass a fraction of"),
    ],
)
def test_bad_intervals_are_refused_before_any_process_starts(
    tmp_path: Path, val_check_interval: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def started(*args: Any, **kwargs: Any) -> None:
        pytest.fail("the processes were started: the interval should have been refused before")

    monkeypatch.setattr(trainer_module, "run_job", started)
    corpus = small_trec()
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        trainer.train(  # forked workers if it were not refused (a script relaunch would start pytest again)
            tmp_path,
            val_check_interval=val_check_interval,
            accelerator="cpu",
            devices=2,
            strategy="ddp_fork",
            mini_batch_size=4,
            max_epochs=1,
        )
    assert time.monotonic() - started < 5 and trainer.fabric is None, "refused before any process started"


# --- several processes ----------------------------------------------------------------------------------------------

# 2 x 4 = one process's 8; SGD without a schedule (flair's linear schedule counts steps differently on one process)
UNION: dict[str, Any] = {**ONE_PROCESS, "shuffle": False, "mini_batch_size": 4, "patience": 100}


@pytest.mark.multiprocess
def test_two_ranks_evaluate_at_the_same_steps_as_one_process_on_the_union(tmp_path: Path) -> None:
    corpus = small_trec()
    one = tiny_text_classifier(corpus)
    FabricTrainer(one, corpus).train(
        tmp_path / "one", val_check_interval=0.34, accelerator="cpu", devices=1, **{**UNION, "mini_batch_size": 8}
    )
    two = tiny_text_classifier(corpus)
    FabricTrainer(two, corpus).train(
        tmp_path / "two", val_check_interval=0.34, accelerator="cpu", devices=2, strategy="ddp_fork", **UNION
    )
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [row["STEP"] for row in rows_two] == [str(step) for step in EVALUATED_STEPS]
    assert [row["STEP"] for row in rows_one] == [row["STEP"] for row in rows_two]
    for ours, union in zip(rows_two, rows_one, strict=True):
        assert ours.keys() == union.keys()
        for title in ours:
            assert float(ours[title]) == pytest.approx(float(union[title]), abs=2e-4), (title, ours["STEP"])
    assert (tmp_path / "one" / "best-model.pt").exists() and (tmp_path / "two" / "best-model.pt").exists()
    best_one = TextClassifier.load(tmp_path / "one" / "best-model.pt").state_dict()
    best_two = TextClassifier.load(tmp_path / "two" / "best-model.pt").state_dict()
    assert state_dict_difference(best_one, best_two) < 1e-5
    assert state_dict_difference(one.state_dict(), two.state_dict()) < 1e-5
    # docs/ddp-communication.md: 2 ranks end within 1e-5 of flair's own trainer on the union of their batches (the
    # evaluations inside epochs change nothing in training); the final model files, written before the best is loaded
    flairs = tiny_text_classifier(corpus)
    ModelTrainer(flairs, corpus).train(tmp_path / "flair", **{**UNION, "mini_batch_size": 8})
    final_flair = TextClassifier.load(tmp_path / "flair" / "final-model.pt").state_dict()
    final_two = TextClassifier.load(tmp_path / "two" / "final-model.pt").state_dict()
    assert state_dict_difference(final_two, final_flair) < 1e-5


class _BestDecisions(TrainerPlugin):
    """Appends ``<step> <whether it was the best so far>`` after every evaluation to a file (global rank 0): when
    best-model.pt was written, in a killed run and its resumed continuation alike."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path, self.step = path, 0

    @property
    def attach_to_all_processes(self) -> bool:
        return False

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        self.step = batch_count

    @TrainerPlugin.hook
    def after_evaluation(self, current_model_is_best: bool, **kw: Any) -> None:
        with self.path.open("a") as stream:
            stream.write(f"{self.step} {current_model_is_best}\n")


def _best_decisions(folder: Path) -> dict[int, str]:
    """Each evaluated step's best-model decision; a step evaluated again after a resume counts as decided then."""
    lines = (folder.parent / f"{folder.name}-best.txt").read_text().split("\n")
    return {int(step): best for step, best in (line.split() for line in lines if line)}


def _resumable_run(folder: Path, strategy: str, kill_at: int | None = None, **options: Any) -> TextClassifier:
    corpus = small_trec()
    model = tiny_text_classifier(corpus, dropout=0.3)
    chosen = FlairFSDPStrategy(start_method="fork") if strategy == "fsdp" else "ddp_fork"
    FabricTrainer(model, corpus).fine_tune(
        folder,
        val_check_interval=2,
        accelerator="cpu",
        devices=2,
        strategy=chosen,
        plugins=[KillAtStep(kill_at), _BestDecisions(folder.parent / f"{folder.name}-best.txt")],
        mini_batch_chunk_size=2,  # a step in chunks is one step
        **{**ONE_PROCESS, "mini_batch_size": 4},
        **options,
    )
    return model


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "every_n_steps"), [("ddp", 2), ("fsdp", 3)])
def test_a_run_killed_mid_epoch_after_interval_evaluations_resumes_to_the_same_rows_best_model_and_weights(
    tmp_path: Path, strategy: str, every_n_steps: int
) -> None:
    """Killed at step 11 (step 5 of epoch 2), after evaluations at steps 2, 4, 6, 8 and 10. With checkpoints every 2
    steps the newest (step 10) was written after that step's evaluation; every 3 steps the newest (step 9) lies
    between two evaluations and the resumed run evaluates step 10 itself."""
    reference = _resumable_run(tmp_path / "uninterrupted", strategy)
    folder = tmp_path / "killed"
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        _resumable_run(folder, strategy, kill_at=11, checkpoint_every_n_steps=every_n_steps)
    assert [row["STEP"] for row in _rows(folder)] == ["2", "4", "6", "8", "10"]
    resumed = _resumable_run(folder, strategy, resume_from="auto", checkpoint_every_n_steps=every_n_steps)
    assert _rows(folder) == _rows(tmp_path / "uninterrupted")
    # best-model.pt was written at the same evaluations: the resumed run knows the best score so far
    decisions = _best_decisions(tmp_path / "uninterrupted")
    assert _best_decisions(folder) == decisions
    resumed_at = every_n_steps * (10 // every_n_steps)  # the newest checkpoint before the kill
    first_after = min(step for step in decisions if step > resumed_at)
    assert decisions[first_after] == "False", "the resumed run's first evaluation is not the best: a run that forgot"
    assert state_dict_difference(resumed.state_dict(), reference.state_dict()) <= 1e-6
    assert (folder / "best-model.pt").exists() and (tmp_path / "uninterrupted" / "best-model.pt").exists()
    best = TextClassifier.load(folder / "best-model.pt").state_dict()
    best_reference = TextClassifier.load(tmp_path / "uninterrupted" / "best-model.pt").state_dict()
    assert state_dict_difference(best, best_reference) <= 1e-6
