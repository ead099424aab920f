"""Ray Train as an engine (docs/elastic.md): a training function under ``TorchTrainer`` with 2 workers on a local
Ray cluster (its dashboard off) trains as one process does, reports its checkpoints and metrics to Ray, and
continues from the newest complete checkpoint after Ray restarts a lost worker; the train command submits a config."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray  # the dev extra holds ray[train]: where it is missing these tests fail, they never skip
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer

from . import ray_jobs

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[2]
RAY_TIMEOUT_S = 45
"""Ray's process group's timeout in these tests: a collective that waits for a lost worker fails after it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """One local Ray cluster for the module: 2 CPUs, no dashboard, on 127.0.0.1; the workers import the tests."""
    environment = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": environment},
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def _fit(train_func: Any, config: dict, storage: Path, **run: Any) -> Any:
    """A TorchTrainer of 2 CPU workers; the run must end without error (its error fails the test)."""
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo", timeout_s=RAY_TIMEOUT_S),
        run_config=RunConfig(storage_path=str(storage), name="run", **run),
    )
    try:
        return trainer.fit()
    except TrainingFailedError as error:  # a worker's error, or a hang past Ray's timeout
        pytest.fail(f"the Ray run failed: {error}")


def _assert_same_weights(got: dict[str, list], reference: torch.nn.Module) -> None:
    expected = reference.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(got[name], dtype=value.dtype), value, rtol=0, atol=1e-5, msg=name)


def _last_dev_loss(base_path: Path) -> float:
    with (base_path / "loss.tsv").open() as rows:
        return float(list(csv.DictReader(rows, delimiter="\t"))[-1]["DEV_LOSS"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """The same run in one process, without Ray: its model and its folder."""
    folder = tmp_path_factory.mktemp("one-process")
    model, _ = ray_jobs.fine_tune(folder, devices=1)
    return model, folder


def test_two_ray_workers_train_as_one_process_report_to_ray_resume_after_a_lost_worker_and_refuse_bad_input(
    cluster: None, reference: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    """One Ray run of 2 workers, global rank 1 lost after step 5 of 6 on the first attempt: devices, num_nodes and a
    resume_from that contradict the run are refused in every worker before anything starts; Ray restarts the group
    (FailureConfig), which resumes from the newest complete checkpoint (step 4), runs steps 5 and 6 only, and ends at
    the weights of the uninterrupted one-process run (global_batch_size), without a relaunch; the step checkpoints
    reach Ray's storage_path (num_to_keep applies) and the evaluation's metrics Ray's result."""
    corpus = ray_jobs.small_trec(train_size=12, dev_size=2, test_size=2)  # another vocabulary: another model
    ray_jobs.FabricTrainer(ray_jobs.tiny_text_classifier(corpus), corpus).fine_tune(
        tmp_path / "other", max_epochs=1, checkpoint_every_n_epochs=1, accelerator="cpu"
    )
    foreign = next((tmp_path / "other" / "checkpoints").iterdir())
    config = {
        "base_path": str(tmp_path / "run"),
        "foreign_checkpoint": str(foreign),
        "folder": str(tmp_path),
        "lose_after": 5,
    }
    result = _fit(
        ray_jobs.train,
        config,
        tmp_path / "ray",
        checkpoint_config=CheckpointConfig(num_to_keep=2),
        failure_config=FailureConfig(max_failures=1),
        callbacks=[ray_jobs.ReportsToFile(str(tmp_path / "reports.jsonl"))],
    )
    answers = result.return_value
    assert "devices=3" in answers["devices"] and "Ray Train started 2 worker process(es)" in answers["devices"]
    assert "devices=2 or devices='auto'" in answers["devices"], answers["devices"]
    assert "num_nodes=2" in answers["num_nodes"] and "num_nodes=1" in answers["num_nodes"], answers["num_nodes"]
    assert "written for another model" in answers["resume_from"], answers["resume_from"]
    assert answers["children"] == [], "Fabric started processes inside a Ray worker"
    assert (tmp_path / "lost").exists(), "the first attempt lost its worker"
    assert (tmp_path / "steps-after-restart").read_text().split() == ["5", "6"]
    model, folder = reference
    _assert_same_weights(answers["weights"], model)
    kept = [Path(checkpoint.path) for checkpoint, _ in result.best_checkpoints]
    steps = [json.loads((each / "progress.json").read_text())["batch_count"] for each in kept]
    assert len(steps) == 2 and steps[-1] == 6, f"Ray keeps the newest 2 checkpoints it committed: {steps}"
    assert all(each.parent == tmp_path / "ray" / "run" for each in kept), "in Ray's storage_path"
    assert json.loads((Path(result.checkpoint.path) / "progress.json").read_text())["batch_count"] == 6
    assert result.metrics.get("step") == 6 and result.metrics.get("epoch") == 2, result.metrics
    assert "dev/loss" in result.metrics, result.metrics
    reports = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert all(report["workers"] == 2 for report in reports), "every worker reports"
    evaluations = {each["metrics"]["step"]: each["metrics"] for each in reports if not each["checkpoint"]}
    assert 6 in evaluations and "dev/loss" in evaluations[6], "the last evaluation reached Ray without a checkpoint"
    assert result.metrics["dev/loss"] == pytest.approx(_last_dev_loss(folder), abs=1e-5)


CONFIG = """\
seed: 5
corpus:
  class_path: flair_fabric.datasets.WNUT16
  init_args: {train_size: 16, dev_size: 4, test_size: 4}
embeddings:
  class_path: flair.embeddings.OneHotEmbeddings.from_corpus
  init_args: {min_freq: 1, embedding_length: 8}
model:
  class_path: flair.models.SequenceTagger
  init_args: {tag_type: ner, hidden_size: 8, use_crf: false, dropout: 0.0, word_dropout: 0.0, locked_dropout: 0.0}
dictionary: {add_dev_test: true}
trainer: {base_path: BASE, max_epochs: 1, global_batch_size: 8, mini_batch_size: null, accelerator: cpu}
"""


def test_the_train_command_submits_its_config_to_ray_and_trains_as_one_process(cluster: None, tmp_path: Path) -> None:
    """``--engine ray --ray.num_workers 2``: each Ray worker runs the command on Ray's world of 2 (its checkpoint
    reported to Ray), to the final model of the same config trained here in one process (--engine local,
    devices 1)."""
    from flair.models import SequenceTagger

    from flair_fabric.shell.command import train

    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.replace("BASE", str(tmp_path / "BASE")), encoding="utf-8")
    train([str(config), "--trainer.base_path", str(tmp_path / "here"), "--trainer.devices", "1"])
    submitted = ["--engine", "ray", "--ray.num_workers", "2", "--ray.storage_path", str(tmp_path / "ray")]
    submitted += ["--trainer.checkpoint_every_n_epochs", "1"]  # reported to Ray: the run was Ray's
    try:
        train([str(config), "--trainer.base_path", str(tmp_path / "on-ray"), *submitted])
    except TrainingFailedError as error:  # a worker's error, or a hang past Ray's timeout
        pytest.fail(f"the Ray run failed: {error}")
    reported = list((tmp_path / "ray").glob("*/checkpoint_*/progress.json"))
    assert len(reported) == 1, "the epoch's checkpoint reached Ray's storage_path"
    assert json.loads(reported[0].read_text())["world_size"] == 2, "trained on Ray's world of 2"
    here = SequenceTagger.load(tmp_path / "here" / "final-model.pt").state_dict()
    on_ray = SequenceTagger.load(tmp_path / "on-ray" / "final-model.pt").state_dict()
    assert set(here) == set(on_ray)
    for name, value in here.items():
        torch.testing.assert_close(on_ray[name], value, rtol=0, atol=1e-5, msg=name)
