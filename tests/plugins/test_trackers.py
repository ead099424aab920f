"""Experiment trackers through LightningLoggerPlugin (MLflow's file store, W&B offline; the real packages): one
tracker run per 2-rank job, the metrics of loss.tsv, the hyperparameters, and the same run continued after a
resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flair_fabric import FabricTrainer, LightningLoggerPlugin, MLflowTracker, WandbTracker

from ..support import loss_file_column, small_trec, tiny_text_classifier
from .wandb_log import history

pytestmark = pytest.mark.multiprocess
RUN: dict[str, Any] = {
    "learning_rate": 0.1,
    "mini_batch_size": 4,
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "ddp_fork",
    "checkpoint_every_n_epochs": 1,
}


def _train(folder: Path, tracker: Any, max_epochs: int, **options: Any) -> None:
    corpus = small_trec(train_size=24)
    model = tiny_text_classifier(corpus)
    plugins = [LightningLoggerPlugin(tracker)]
    FabricTrainer(model, corpus).train(folder, max_epochs=max_epochs, plugins=plugins, **RUN, **options)


def test_mlflow_gets_one_run_per_job_with_the_loss_files_metrics_and_a_resume_continues_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store (kept for tests: no database)

    uri = f"file:{tmp_path / 'mlruns'}"
    tracker = MLflowTracker(experiment_name="trec", tracking_uri=uri, log_model_files=True)
    _train(tmp_path / "run", tracker, max_epochs=2)
    _train(tmp_path / "run", tracker, max_epochs=3, resume_from="auto")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("trec")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one tracker run for both jobs of the run, none per rank"
    run = runs[0]
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [metric.step for metric in losses] == [3, 6, 9], "at each epoch's last optimizer step (24 questions / 8)"
    expected = loss_file_column(tmp_path / "run", "TRAIN_LOSS")
    assert [metric.value for metric in losses] == pytest.approx(expected, abs=1e-4)
    assert run.data.params["mini_batch_size"] == "4" and run.data.params["devices"] == "2"
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert "final-model.pt" in artifacts


def test_wandb_offline_gets_one_run_per_job_and_a_resume_continues_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(project="trec", save_dir=str(tmp_path), offline=True)
    _train(tmp_path / "run", tracker, max_epochs=2)
    first = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(first) == 1, "one tracker run per job, none per rank"
    rows = history(first[0])
    steps = [row["trainer/global_step"] for row in rows]
    assert steps == sorted(steps), "one step axis, never going back (W&B drops rows logged at an earlier step)"
    losses = [(row["trainer/global_step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert [step for step, _ in losses] == [3, 6], "each epoch's loss at its last optimizer step (24 questions / 8)"
    assert [loss for _, loss in losses] == pytest.approx(loss_file_column(tmp_path / "run", "TRAIN_LOSS"), abs=1e-4)
    scores = [row["dev/accuracy"] for row in rows if "dev/accuracy" in row]
    assert scores == pytest.approx(loss_file_column(tmp_path / "run", "DEV_ACCURACY"), abs=1e-4)
    _train(tmp_path / "run", tracker, max_epochs=3, resume_from="auto")
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {path.name.rsplit("-", 1)[1] for path in runs} == {first[0].name.rsplit("-", 1)[1]}


def test_a_missing_tracker_package_names_the_extra(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def without_mlflow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_mlflow)
    with pytest.raises(ImportError, match=r"pip install 'flair-fabric\[mlflow\]'"):
        MLflowTracker().make(None)


def test_flairs_own_wandb_logger_cannot_be_attached_to_flairs_trainer(tmp_path: Path) -> None:
    """docs/fixed-in-flair.md: the defect WandbTracker replaces (if flair fixes it, this test says so)."""
    import wandb
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins.loggers.wandb import WandbLogger

    corpus = small_trec(train_size=8)
    with pytest.raises(RuntimeError, match="after_training_setup"):
        ModelTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path, max_epochs=1, plugins=[WandbLogger(wandb)])
