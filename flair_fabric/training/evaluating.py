"""Evaluation during a run, as flair's trainer does it: the monitored splits after every epoch (best-model choice,
identical on every rank) and the final test, each split across the ranks and scored once by flair's own code.

With ``val_check_interval`` the same evaluation also runs inside epochs, every n optimizer steps (Lightning's name and
meaning: an int is a number of steps of the epoch, a float that fraction of the epoch's steps). The epoch's end is
evaluated as in flair; an interval that falls on the epoch's last step is that evaluation, not a second one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flair.trainers.plugins import MetricRecord
from flair.training_utils import Result, log_line
from torch.utils.data import Dataset

from flair_fabric.evaluation.sharded import evaluate_across_ranks
from flair_fabric.state.training_state import rng_state, set_rng_state

if TYPE_CHECKING:
    from flair_fabric.distributed.lockstep import Agreed
    from flair_fabric.training.loss import LossTracker
    from flair_fabric.training.run_interface import Run

log = logging.getLogger("flair")


def steps_between_evaluations(val_check_interval: int | float | None, steps_in_epoch: int) -> int | None:
    """The optimizer steps from one evaluation inside an epoch to the next (``None``: at epoch ends only); an
    interval longer than the epoch, or a fraction of it shorter than one step, is refused with the fix."""
    if val_check_interval is None:
        return None
    if isinstance(val_check_interval, float):
        steps = int(steps_in_epoch * val_check_interval)
        if steps == 0:
            raise ValueError(
                f"val_check_interval={val_check_interval} of an epoch of {steps_in_epoch} optimizer step(s) is less"
                f" than one step: pass a fraction of at least {1 / steps_in_epoch:.3g}, or an int number of steps."
            )
        return steps
    if val_check_interval > steps_in_epoch:
        raise ValueError(
            f"val_check_interval={val_check_interval} steps is longer than an epoch ({steps_in_epoch} optimizer"
            f" steps with this mini_batch_size and number of processes): pass at most {steps_in_epoch}, a fraction"
            " of an epoch (a float in (0, 1]), or None to evaluate at epoch ends only."
        )
    return val_check_interval


def evaluation_due(interval: int | None, step_in_epoch: int, steps_in_epoch: int) -> bool:
    """Whether an evaluation inside the epoch follows step ``step_in_epoch`` (the epoch's last step has its own)."""
    return interval is not None and step_in_epoch % interval == 0 and step_in_epoch < steps_in_epoch


def evaluate_inside_epoch(run: Run, epoch: int, epoch_loss: LossTracker) -> Agreed:
    """``val_check_interval``: after this step, what flair does after an epoch (the epoch's train loss so far, the
    evaluations, the best model, ``after_evaluation``), then back to training where the epoch stands: train mode, the
    same data order and the same random number generators. Returns what the ranks agreed on in the train loss
    all-reduce (checkpoints, preemptions)."""
    trainer, step = run.trainer, run.progress.batch_count
    run.position.at("the train loss all-reduce before an evaluation", epoch, run.progress.step_in_epoch)
    so_far, agreed = run.global_loss(epoch_loss)
    log_line(log)
    log.info(f"EPOCH {epoch} step {step}: evaluating (val_check_interval); loss so far {so_far.mean:.4f}")
    trainer._get_current_lr_and_momentum(step)  # records the learning rate of this evaluation's row
    trainer._record(MetricRecord.scalar(("train", "loss"), so_far.mean, step))
    generators = rng_state()  # evaluating draws from them (each DataLoader a seed): training draws what it would have
    try:
        evaluate_epoch(run, epoch, so_far.mean, step)
    finally:
        set_rng_state(generators)
    trainer.model.train()
    return agreed


def evaluate_epoch(run: Run, epoch: int, train_loss: float, global_step: int) -> None:
    """Score the evaluation splits, choose the best model (identically on every rank) and save it once; the scores
    are recorded at ``global_step`` (flair's epoch, or the optimizer step with ``val_check_interval``)."""
    a, trainer, progress = run.flair_arguments, run.trainer, run.progress
    trainer.model.eval()
    is_best = False
    validation_scores: tuple = ()
    for split, split_data in run.data.evaluation_splits.items():
        run.position.at(f"the evaluation of the {split} split", epoch, progress.step_in_epoch)
        result = evaluate_split(run, split_data, run.base_path / f"{split}.tsv", embeddings_storage=True)
        log.info(
            f"{split.upper()} : loss {result.loss}"
            f" - {a.main_evaluation_metric[1]}"
            f" ({a.main_evaluation_metric[0]})"
            f"  {round(result.main_score, 4)}"
        )
        trainer._publish_eval_result(result, split, global_step=global_step)
        if run.data.best_by_dev_score and split == "dev":
            validation_scores = result.main_score, result.loss
            if result.main_score > progress.best_epoch_score:
                is_best, progress.best_epoch_score = True, result.main_score
    if not run.data.best_by_dev_score:
        validation_scores = (train_loss,)
        if train_loss < progress.best_epoch_score:
            is_best, progress.best_epoch_score = True, train_loss
    trainer.dispatch(
        "after_evaluation", epoch=epoch, current_model_is_best=is_best, validation_scores=validation_scores
    )
    run.agree_on_stopping()
    if run.data.save_best_model and is_best:
        log.info("saving best model")
        run.save_model(run.base_path / "best-model.pt", checkpoint=a.save_optimizer_state)


def evaluate_split(run: Run, data: Dataset, out_path: Path, embeddings_storage: bool, **overrides: Any) -> Result:
    """flair's evaluation of a split, split across the ranks, with the model the strategy evaluates with."""
    a = run.flair_arguments
    options: dict[str, Any] = {
        "gold_label_type": run.trainer.model.label_type,
        "mini_batch_size": a.eval_batch_size,
        "main_evaluation_metric": a.main_evaluation_metric,
        "gold_label_dictionary": a.gold_label_dictionary_for_eval,
        "exclude_labels": a.labels_excluded,
    }
    if embeddings_storage:  # during training, as flair's trainer evaluates
        options |= {
            "embedding_storage_mode": a.embeddings_storage_mode,
            "embeddings_storage_mode": a.embeddings_storage_mode,
        }
        options["gold_label_dictionary_for_eval"] = a.gold_label_dictionary_for_eval
    options |= overrides
    with run.strategy.model_for_inference(run.trainer.model) as model:
        return evaluate_across_ranks(run.fabric, model, data, out_path=out_path, **options)


def test_final_model(run: Run) -> None:
    """Load the best model on every rank (if there is one) and score the test split, as flair does."""
    a, trainer, corpus = run.flair_arguments, run.trainer, run.trainer.corpus
    best_model = run.base_path / "best-model.pt"
    if corpus.test and not a.train_with_test:
        log_line(log)
        trainer.model.eval()
        if run.load_model(best_model):
            log.info("Loading model from best epoch ...")
        else:
            log.info("Testing using last state of model ...")
        run.position.at("the final evaluation of the test split", 0, 0)
        results = evaluate_split(
            run,
            corpus.test,
            run.base_path / "test.tsv",
            embeddings_storage=False,
            embedding_storage_mode="none",
            return_loss=False,
        )
        log.info(results.detailed_results)
        log_line(log)
        trainer.return_values["test_score"] = results.main_score
    else:
        if run.load_model(best_model):
            log.info("Loading model from best epoch ...")
        trainer.return_values["test_score"] = 0
        log.info("Test data not provided setting final score to 0")
