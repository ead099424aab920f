"""Ray Train as an engine (docs/elastic.md): a training function under ``TorchTrainer`` on a local Ray cluster of two
nodes (every listener on 127.0.0.1, no dashboard) trains as one process does while its world changes 2 -> 1 -> 2
workers, reports its checkpoints and metrics to Ray, and continues from the newest complete checkpoint after each
restart; the train command submits a config."""

from __future__ import annotations

import csv
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray  # the dev extra holds ray[train]: where it is missing these tests fail, they never skip
import torch
from ray.cluster_utils import Cluster
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer

from . import ray_jobs

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[2]
RAY_TIMEOUT_S = 45
"""Ray's process group's timeout in these tests: a collective that waits for a lost worker fails after it."""
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
"""A node of the test cluster: one worker's CPU, its listeners on the loopback address only (Ray binds its servers
to all interfaces unless the node's address is 127.0.0.1)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One local Ray cluster for the module: a head node and a worker node of 1 CPU each, on 127.0.0.1, no dashboard;
    its files and its address file in a folder of its own (RAY_TMPDIR), so that no ray.init() elsewhere on the machine
    finds it; the workers import the tests. ray.init keeps 127.0.0.1 as it is only where Ray was imported with
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (tests/conftest.py), else it connects to the machine's address."""
    environment = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", folder)
        nodes = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        try:
            nodes.add_node(**NODE)
            ray.init(address=nodes.address, runtime_env={"env_vars": environment}, log_to_driver=False)
            _start_the_autoscaling_coordinator()
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()
            shutil.rmtree(folder, ignore_errors=True)


def _start_the_autoscaling_coordinator() -> None:
    """Ray Train's elastic runs ask an actor of Ray Data's for the cluster's resources, and Ray starts it at the first
    one; a request that waits for it fails and is sent again (12 s lost, seen on 2 loaded cores): started with the
    cluster, it is up when the elastic test asks. Where Ray has it elsewhere, nothing is started."""
    try:
        from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator
    except ImportError:
        return
    default_autoscaling_coordinator.get_or_create_autoscaling_coordinator()


def _trainer(train_func: Any, config: dict, storage: Path, scaling: ScalingConfig, **run: Any) -> TorchTrainer:
    """A TorchTrainer of CPU workers."""
    return TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=scaling,
        torch_config=TorchConfig(backend="gloo", timeout_s=RAY_TIMEOUT_S),
        run_config=RunConfig(storage_path=str(storage), name="run", **run),
    )


def _fit_changing_the_world(trainer: TorchTrainer, nodes: Cluster, folder: Path) -> Any:
    """``trainer.fit()`` in a thread while this one changes the cluster at the run's requests
    (:class:`ray_jobs.ChangeTheWorld`): the worker node removed at ``folder/shrink``, a node added at ``folder/grow``
    (Ray starts a node from the main thread only). The run must end without error (its error fails the test)."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # re-raised below, in the test's thread
            outcome["error"] = error

    running = threading.Thread(target=fit)
    running.start()

    def asked(request: str) -> bool:
        while not (folder / request).exists():
            if not running.is_alive():
                return False
            time.sleep(0.2)
        return True

    try:
        if asked("shrink"):
            nodes.remove_node(next(iter(nodes.worker_nodes)))
        if asked("grow"):
            nodes.add_node(**NODE)
    finally:
        running.join()
        if not nodes.worker_nodes:  # the next test's 2 workers need both nodes
            nodes.add_node(**NODE)
    if isinstance(outcome.get("error"), TrainingFailedError):  # a worker's error, or a hang past Ray's timeout
        pytest.fail(f"the Ray run failed: {outcome['error']}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


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


def test_an_elastic_ray_run_through_2_1_2_workers_trains_as_one_process_reports_to_ray_and_refuses_bad_input(
    cluster: Cluster, reference: tuple[torch.nn.Module, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ScalingConfig(num_workers=(1, 2)) on two nodes of 1 CPU: 2 workers until the checkpoint after step 2 is
    complete; the worker node is removed before that checkpoint reaches Ray, and Ray restarts the run on 1 worker
    (FailureConfig), which continues base_path's checkpoint (Ray has committed none); after step 4 (its checkpoint
    reported) a node is added and Ray resizes the run to 2 workers, which continue from step 4. Steps 5 and 6 end at
    the weights of the uninterrupted one-process run (global_batch_size), without a relaunch. devices, num_nodes and a
    resume_from that contradict the run are refused in every worker before anything starts; the step checkpoints
    reach Ray's storage_path (num_to_keep applies) and the evaluations' metrics Ray's result, from each world."""
    corpus = ray_jobs.small_trec(train_size=12, dev_size=2, test_size=2)  # another vocabulary: another model
    ray_jobs.FabricTrainer(ray_jobs.tiny_text_classifier(corpus), corpus).fine_tune(
        tmp_path / "other", max_epochs=1, checkpoint_every_n_epochs=1, accelerator="cpu"
    )
    foreign = next((tmp_path / "other" / "checkpoints").iterdir())
    config = {
        "base_path": str(tmp_path / "run"),
        "foreign_checkpoint": str(foreign),
        "folder": str(tmp_path),
        "shrink_after": 2,
        "grow_after": 4,
    }
    # after a lost node Ray tries the old size until its view of the cluster is renewed (every 20 s): each try waits
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "2")
    trainer = _trainer(
        ray_jobs.train,
        config,
        tmp_path / "ray",
        ScalingConfig(num_workers=(1, 2), use_gpu=False, elastic_resize_monitor_interval_s=1),
        checkpoint_config=CheckpointConfig(num_to_keep=2),
        failure_config=FailureConfig(max_failures=1),
        callbacks=[ray_jobs.ReportsToFile(str(tmp_path / "reports.jsonl"))],
    )
    result = _fit_changing_the_world(trainer, cluster, tmp_path)
    ran = [tuple(map(int, line.split())) for line in (tmp_path / "steps").read_text().splitlines()]
    assert ran == [(2, 1), (2, 2), (1, 3), (1, 4), (2, 5), (2, 6)], "(workers, step): each restart continued"
    answers = result.return_value
    assert "devices=3" in answers["devices"] and "Ray Train started 2 worker process(es)" in answers["devices"]
    assert "devices=2 or devices='auto'" in answers["devices"], answers["devices"]  # one address: one node to Ray
    assert "num_nodes=2" in answers["num_nodes"] and "num_nodes=1" in answers["num_nodes"], answers["num_nodes"]
    assert "written for another model" in answers["resume_from"], answers["resume_from"]
    assert answers["children"] == [], "Fabric started processes inside a Ray worker"
    model, folder = reference
    _assert_same_weights(answers["weights"], model)
    kept = [Path(checkpoint.path) for checkpoint, _ in result.best_checkpoints]
    steps = [json.loads((each / "progress.json").read_text())["batch_count"] for each in kept]
    assert steps == [4, 6], f"Ray keeps the newest 2 checkpoints it committed (none of step 2): {steps}"
    assert all(each.parent == tmp_path / "ray" / "run" for each in kept), "in Ray's storage_path"
    assert json.loads((Path(result.checkpoint.path) / "progress.json").read_text())["batch_count"] == 6
    assert result.metrics.get("step") == 6 and result.metrics.get("epoch") == 2, result.metrics
    assert "dev/loss" in result.metrics, result.metrics
    reports = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    got = [(each["workers"], each["metrics"]["step"], each["checkpoint"]) for each in reports]
    assert got == [(1, 3, False), (1, 4, True), (2, 6, False), (2, 6, True)], "every worker reports, in each world"
    assert "dev/loss" in reports[2]["metrics"], "the last evaluation reached Ray without a checkpoint"
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


def test_the_train_command_submits_its_config_to_ray_and_trains_as_one_process(
    cluster: Cluster, tmp_path: Path
) -> None:
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
