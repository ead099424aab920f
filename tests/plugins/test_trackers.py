"""Experiment trackers through LightningLoggerPlugin (MLflow's file store, W&B offline; the real packages): one
tracker run per 2-rank job, the metrics of loss.tsv, the hyperparameters, and the same run continued after a
resume."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
from flair.trainers import ModelTrainer
from flair.trainers.plugins import MetricRecord, TrainerPlugin
from lightning.fabric.loggers import Logger

from flair_fabric import FabricTrainer, LightningLoggerPlugin, MLflowTracker, WandbTracker
from flair_fabric.plugins.trackers import Tracker

from ..support import loss_file_column, small_trec, tiny_text_classifier
from .wandb_log import history

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


@pytest.mark.multiprocess
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
    assert (tmp_path / "run" / "best-model.pt").is_file(), "the run writes both model files"
    assert artifacts == {"best-model.pt", "final-model.pt"}


@pytest.mark.multiprocess
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
    from flair.trainers.plugins.loggers.wandb import WandbLogger

    corpus = small_trec(train_size=8)
    with pytest.raises(RuntimeError, match="after_training_setup"):
        ModelTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path, max_epochs=1, plugins=[WandbLogger(wandb)])


# --- MLflow's file store, checked before training ------------------------------------------------------------------


def _mlflow_refuses(uri: str) -> bool:
    """The reference: whether MLflow's own client refuses the store (it makes the store when it is made)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri)
    except (MlflowException, ValueError):
        return True
    return False


def test_mlflows_file_store_without_its_variable_is_refused_when_the_tracker_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow 3.13+ refuses a folder as its store unless MLFLOW_ALLOW_FILE_STORE=true (a run would die at its first
    logged number): MLflowTracker(...) refuses the same stores MLflow's own client refuses, at once, naming the
    variable, and sets nothing itself; a server, or the variable set, is taken."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    folders = [f"file:{tmp_path / 'uri'}", str(tmp_path / "plain"), "relative-folder"]
    for uri in folders:
        assert _mlflow_refuses(uri), f"MLflow refuses {uri!r} without the variable"
        with pytest.raises(ValueError, match=r"MLFLOW_ALLOW_FILE_STORE=true") as refused:
            MLflowTracker(tracking_uri=uri)
        assert repr(uri) in str(refused.value)
    with pytest.raises(ValueError, match=r"'file:\./mlruns'.*MLFLOW_ALLOW_FILE_STORE=true"):
        MLflowTracker()  # Lightning's default store is a folder too
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'from-env'}")
    with pytest.raises(ValueError, match=r"from-env.*MLFLOW_ALLOW_FILE_STORE=true"):
        MLflowTracker()  # the store MLflow's variable names
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "no store made, nothing written"
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ, "the variable is the user's to set"

    server = "http://127.0.0.1:9"  # not contacted when made
    assert not _mlflow_refuses(server)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    assert MLflowTracker().make(None)._tracking_uri == server  # type: ignore[attr-defined]
    assert MLflowTracker(tracking_uri=server).tracking_uri == server
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "yes")  # not a value MLflow reads: refused by both
    assert _mlflow_refuses(folders[0])
    with pytest.raises(ValueError, match=r"MLFLOW_ALLOW_FILE_STORE"):
        MLflowTracker(tracking_uri=folders[0])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for uri in folders:
        assert not _mlflow_refuses(uri)
        assert MLflowTracker(tracking_uri=uri).tracking_uri == uri


# --- what LightningLoggerPlugin gives a tracker, in one process -----------------------------------------------------


class _RecordingLogger(Logger):
    """A logger that keeps what it is given in its tracker's ``runs``, by run id."""

    def __init__(self, runs: dict[str, dict[str, Any]], run_id: str) -> None:
        super().__init__()
        self.runs, self.id = runs, run_id

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return self.id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.runs[self.id]["metrics"].extend((name, step) for name in metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.runs[self.id]["hyperparameters"].append(dict(params))


class _RecordingTracker(Tracker):
    """A tracker whose runs live in memory: which runs were made or continued, and what each got."""

    runs: ClassVar[dict[str, dict[str, Any]]] = {}
    made: ClassVar[list[str | None]] = []
    numbers = itertools.count(1)
    log_model_files = True

    def make(self, run_id: str | None) -> Logger:
        self.made.append(run_id)
        if run_id is None:
            run_id = f"run-{next(self.numbers)}"
            self.runs[run_id] = {"hyperparameters": [], "metrics": [], "files": []}
        return _RecordingLogger(self.runs, run_id)

    def run_id(self, logger: Logger) -> str:
        return logger.id  # type: ignore[attr-defined]

    def log_file(self, logger: Logger, path: Path) -> None:
        self.runs[self.run_id(logger)]["files"].append(path.name)


def _train_one_process(folder: Path, plugin: LightningLoggerPlugin, max_epochs: int, **options: Any) -> None:
    corpus = small_trec(train_size=16, dev_size=8, test_size=4)
    run = {"learning_rate": 0.1, "mini_batch_size": 4, "accelerator": "cpu", "devices": 1}
    options = {"checkpoint_every_n_epochs": 1, **options}
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        folder, max_epochs=max_epochs, plugins=[plugin], **run, **options
    )


def test_a_tracker_run_gets_the_parameters_of_its_start_and_a_resume_logs_into_it_without_new_ones(
    tmp_path: Path,
) -> None:
    """docs/plugins.md: the run gets the training parameters (or hyperparameters=...) as its hyperparameters once, at
    its start: a job resumed from a checkpoint continues the run and keeps them (MLflow refuses a changed one), and
    log_model_files stores best-model.pt and final-model.pt with the run; every numeric record is logged."""
    _RecordingTracker.runs.clear()
    _RecordingTracker.made.clear()
    _train_one_process(tmp_path / "run", LightningLoggerPlugin(_RecordingTracker()), max_epochs=1)
    _train_one_process(tmp_path / "run", LightningLoggerPlugin(_RecordingTracker()), max_epochs=2, resume_from="auto")
    assert _RecordingTracker.made == [None, "run-1"], "the resumed job continues the run its checkpoint recorded"
    assert list(_RecordingTracker.runs) == ["run-1"]
    run = _RecordingTracker.runs["run-1"]
    assert len(run["hyperparameters"]) == 1, "logged once, at the run's start; a resumed job logs none"
    parameters = run["hyperparameters"][0]
    assert parameters["max_epochs"] == 1 and parameters["mini_batch_size"] == 4, "the parameters of the run's start"
    assert parameters["base_path"] == str(tmp_path / "run"), "a value that is not a plain type, as text"
    names = {name for name, _ in run["metrics"]}
    expected = {"train/loss", "train/batch_loss", "dev/accuracy", "dev/loss", "learning_rate"}
    assert expected | {"train/tokens_per_second"} <= names
    assert [step for name, step in run["metrics"] if name == "train/loss"] == [4, 8], "both jobs' epochs, by step"
    assert (tmp_path / "run" / "best-model.pt").is_file()
    assert sorted(run["files"]) == ["best-model.pt", "best-model.pt", "final-model.pt", "final-model.pt"]

    given = {"config": "run.yaml", "seed": 42}
    _train_one_process(tmp_path / "given", LightningLoggerPlugin(_RecordingTracker(), hyperparameters=given), 1)
    assert _RecordingTracker.runs["run-2"]["hyperparameters"] == [given], "the ones given, instead of the parameters"


class _RecordSteps(TrainerPlugin):
    """flair's own view: every metric record's name and step, as flair's trainer dispatches it."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[str, int]] = []

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        self.steps.append((str(record.name), int(record.global_step)))


def test_under_flairs_own_trainer_each_record_is_logged_at_its_own_step(tmp_path: Path) -> None:
    """docs/plugins.md: under flair's ModelTrainer (which has no optimizer steps of ours), LightningLoggerPlugin logs
    each record at the step flair gave it (epochs for the epoch's metrics, batch counts for the per-step ones)."""
    corpus = small_trec(train_size=16, dev_size=8, test_size=4)
    runs: dict[str, dict[str, Any]] = {"flair": {"hyperparameters": [], "metrics": [], "files": []}}
    reference = _RecordSteps()
    plugin = LightningLoggerPlugin(_RecordingLogger(runs, "flair"))
    ModelTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path, max_epochs=2, mini_batch_size=4, plugins=[reference, plugin]
    )
    logged = runs["flair"]["metrics"]
    assert ("train/loss", 2) in logged and ("train/batch_loss", 8) in logged, "epochs and batch counts, as flair's"
    compared = [(name, step) for name, step in reference.steps if name in {name for name, _ in logged}]
    assert logged == compared
