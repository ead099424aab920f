"""Resume after a kill, checkpoints that survive a crash, bad resume input (2 CPU ranks on gloo)."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.util
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.models import TextClassifier
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricTrainer
from flair_fabric.distributed.stalls import wait_for_global_zero
from flair_fabric.launch.config import make_launch_config

from ..plugin_support import FailAt
from ..support import (
    REPO,
    SCRIPTS,
    RunHung,
    expect_success,
    run_on_ranks,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
    write_config,
)

pytestmark = pytest.mark.multiprocess

# shuffled batches and dropout: an exact resume needs the data order and every rank's random number generators
RESUMABLE = {
    "max_epochs": 4,
    "mini_batch_size": 4,
    "learning_rate": 0.5,
    "devices": 2,
    "accelerator": "cpu",
    "checkpoint_every_n_epochs": 1,
    # flair's default "cpu" keeps the dev sentences' one-hot embeddings from the first evaluation (under no_grad
    # nothing looks trainable) and reuses them later: a resumed run, which computes them afresh, would differ
    "embeddings_storage_mode": "none",
    "use_final_model_for_eval": True,  # compare the weights after the last epoch, not a reloaded best epoch
}
MODEL_OPTIONS = {"dropout": 0.3}


@dataclass
class Job:
    """What a finished job left: its exit code, its output, its wall time and its process group."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    pid: int

    def no_process_left(self, within: float = 10.0) -> bool:
        """Whether every process of the job's process group (the job leads its own group) has exited, or exits
        within ``within`` seconds (a process may still be shutting down when the job's main process has ended)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False


def start_job(config: Path) -> subprocess.Popen:
    """The test script as a job of its own (its own session and process group, so it can be signalled whole)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(SCRIPTS / "ddp_runs.py"), str(config)]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )


def finish(process: subprocess.Popen, started: float, timeout: float = 300) -> Job:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise RunHung(f"the job did not end within {timeout} s:\n{stderr[-3000:]}") from None
    return Job(process.returncode, stdout, stderr, time.monotonic() - started, process.pid)


def run_job(config: Path, timeout: float = 300) -> Job:
    started = time.monotonic()
    return finish(start_job(config), started, timeout)


def _config(out: Path, name: str, **run: Any) -> Path:
    runs = [{"name": name, "method": "train", "kwargs": {**RESUMABLE, **run.pop("kwargs", {})}, **run}]
    return write_config(
        out / f"{name}-{len(list(out.glob('*.json')))}.json",
        {"out": str(out), "model_options": MODEL_OPTIONS, "runs": runs},
    )


def _loss_rows(run_dir: Path) -> list[list[str]]:
    """loss.tsv without its TIMESTAMP column."""
    lines = [line.split("\t") for line in (run_dir / "loss.tsv").read_text().splitlines()]
    timestamp = lines[0].index("TIMESTAMP")
    return [line[:timestamp] + line[timestamp + 1 :] for line in lines]


@pytest.mark.parametrize(
    "fails",
    [
        [{"rank": 1, "how": "raise"}],
        [{"rank": 1, "how": "kill"}],
        # the guards alone end these: the other rank keeps its sockets open, so gloo would not notice
        [{"rank": 0, "how": "raise"}, {"rank": 1, "how": "stop"}],  # rank 0 kills the copies it started
        [{"rank": 0, "how": "kill"}, {"rank": 1, "how": "stall"}],  # a copy exits when its starter is gone
    ],
    ids=["rank1-raises", "rank1-dies", "rank0-raises-rank1-stopped", "rank0-dies-rank1-stalls"],
)
def test_a_dying_rank_ends_the_whole_job(tmp_path: Path, fails: list[dict[str, Any]]) -> None:
    fails = [{"epoch": 2, **fail} for fail in fails]
    job = run_job(_config(tmp_path, "failing", fails=fails, kwargs={"max_epochs": 50}), timeout=240)
    assert job.returncode != 0
    raising = [fail["rank"] for fail in fails if fail["how"] == "raise"]
    if raising:
        assert f"RuntimeError: injected failure on rank {raising[0]} in epoch 2" in job.stderr
    assert job.no_process_left(within=30), "no rank may outlive the job"


def test_a_stalled_rank_ends_the_job_after_the_collective_timeout_with_an_error_that_says_where(tmp_path: Path) -> None:
    """A forked rank that stops making progress without closing its sockets (gloo would wait): the other rank's
    collective times out after 3 s, its error says where it was, and the stalled rank is ended too. (Forked workers:
    the rendezvous must also finish within the timeout, which a relaunched script's imports would not. The stalled
    rank holds the SIGTERM with which torch ends it, so it would be killed 30 s later; it stalls for 12 s and then
    finds its peer gone, which ends it sooner. Without the timeout, the other rank would wait those 12 s and train
    on: no error.)"""
    rank = 1
    corpus = small_trec()
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    started = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="waited longer than collective_timeout") as raised:
        trainer.train(
            tmp_path,
            max_epochs=50,
            mini_batch_size=4,
            devices=2,
            accelerator="cpu",
            strategy="ddp_fork",
            collective_timeout=3,
            plugins=[FailAt(epoch=2, rank=rank, how="stall", stall_seconds=12)],
        )
    assert time.monotonic() - started < 60, "the timeout must end the job"
    assert f"global rank {1 - rank} of 2" in str(raised.value)
    assert "in epoch 2: the agreement on stops at the start of the epoch" in str(raised.value)
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children(), "the stalled rank must not outlive the job"


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_job_stops_every_rank_and_saves_the_final_model_once(
    tmp_path: Path, signal_number: signal.Signals
) -> None:
    run_dir = tmp_path / "interrupted"
    started = time.monotonic()
    kwargs = {"max_epochs": 200, "checkpoint_every_n_epochs": 0, "use_final_model_for_eval": True}
    process = start_job(_config(tmp_path, "interrupted", kwargs=kwargs))
    log_file = run_dir / "training.log"
    while not (log_file.exists() and "EPOCH 2 done" in log_file.read_text()):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() - started < 120, "training did not reach epoch 2"
        time.sleep(0.2)
    os.killpg(process.pid, signal_number)  # what Ctrl-C in a terminal or a scheduler's SIGTERM does
    job = finish(process, started, timeout=120)

    expect_success(job.returncode, "the job", job.stderr)
    log = log_file.read_text()
    assert f"{signal_number.name} received by rank" in log and "Exiting from training early." in log
    assert log.count("Saving model ...") == 1
    epochs = [int(line.split("EPOCH ")[1].split()[0]) for line in log.splitlines() if " done: loss" in line]
    assert 2 <= len(epochs) < 200
    for rank in (0, 1):  # both ranks stopped after the same number of steps, with the same weights
        summary = json.loads((run_dir / f"summary-rank{rank}.json").read_text())
        assert len(summary["lr_trace"]) == len(json.loads((run_dir / "summary-rank0.json").read_text())["lr_trace"])
    final = TextClassifier.load(run_dir / "final-model.pt")  # the weights both ranks stopped with
    for rank in (0, 1):
        assert state_dict_difference(final.state_dict(), torch.load(run_dir / f"weights-rank{rank}.pt")["final"]) == 0
    assert not list(run_dir.glob(".*.tmp")), "no half-written file is left"
    assert job.no_process_left()


@pytest.mark.parametrize(
    ("differ", "message"),
    [
        ("corpus", r"rank 1's corpus differs from rank 0's in dev, test, train"),
        ("labels", r"rank 1's model differs from rank 0's in dictionary .label_dictionary"),
    ],
)
def test_ranks_that_would_train_different_things_are_refused(tmp_path: Path, differ: str, message: str) -> None:
    config = _config(tmp_path, "differing")
    write_config(config, {**json.loads(config.read_text()), "differ_on_rank1": differ})
    job = run_job(config, timeout=120)
    assert job.returncode != 0 and job.seconds < 60
    assert re.search(message, job.stderr), job.stderr[-3000:]
    assert "the processes would not train the same thing" in job.stderr
    assert not (tmp_path / "differing" / "loss.tsv").exists(), "refused before training"
    assert job.no_process_left()


def test_ctrl_c_with_forked_workers_stops_them_together_and_hands_back_the_final_model(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(SCRIPTS / "interrupted_workers.py"), str(tmp_path)]
    started = time.monotonic()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    job = finish(process, started, timeout=120)
    expect_success(job.returncode, "the job", job.stderr)
    assert "final-model.pt differs from the caller's model by 0.0" in job.stdout
    log = (tmp_path / "training.log").read_text()
    assert "SIGINT received by rank" in log and log.count("Saving model ...") == 1
    assert job.no_process_left()


class _SlowOwnEvaluate(TextClassifier):
    """A model with its own evaluate (not shardable: rank 0 evaluates alone) that takes longer than the collective
    timeout of the run below."""

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(5)
        return super().evaluate(*args, **kwargs)


def test_work_of_rank_zero_alone_does_not_trip_the_collective_timeout(tmp_path: Path) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_SlowOwnEvaluate)
    try:
        FabricTrainer(model, corpus).train(
            tmp_path,
            max_epochs=1,
            mini_batch_size=4,
            devices=2,
            accelerator="cpu",
            strategy="ddp_fork",
            collective_timeout=3,  # rank 1 waits 5 s for each of rank 0's evaluations
        )
    except Exception as error:
        if "waited longer than collective_timeout" in str(error):
            pytest.fail(f"rank 0's work alone tripped the collective timeout: {error}")
        raise
    assert "evaluating on global rank 0 only" in (tmp_path / "training.log").read_text()
    assert (tmp_path / "test.tsv").is_file()


# --- the runner's process groups: made before every job, ended after it in workers ------------------------------------


def _rank_0_fails_before_rank_1_waits_for_its_file_work(fabric: Any, argument: None) -> None:
    if fabric.global_rank == 0:
        raise RuntimeError("rank 0 failed before its first file work")
    wait_for_global_zero(fabric)


def test_a_job_whose_rank_0_fails_at_once_does_not_leave_the_others_waiting_half_a_minute() -> None:
    """Every job makes the gloo group that rank 0's file work is waited for on before the job starts: rank 1 then waits
    in a barrier that ends when rank 0's sockets close, not in the group's making, where nothing ends it until torch's
    launcher kills it 30 s after rank 0 failed (it holds SIGTERM)."""
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_fork", precision=None)
    started = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 0 failed before its first file work"):
        run_on_ranks(config, _rank_0_fails_before_rank_1_waits_for_its_file_work, None)
    assert time.monotonic() - started < 20, "rank 1 sat in the making of the group until it was killed"


def _note_the_process_group_when_the_worker_ends(fabric: Any, folder: Path) -> None:
    rank = fabric.global_rank

    def note() -> None:  # (multiprocessing runs it as the worker process ends, after the runner's code)
        (folder / f"rank-{rank}.txt").write_text(str(torch.distributed.is_initialized()))

    multiprocessing.util.Finalize(None, note, exitpriority=100)


def test_a_worker_ends_its_process_groups_when_its_job_is_done(tmp_path: Path) -> None:
    """reliability.md: gloo's threads must not outlive a worker's Python (they can abort its finalization)."""
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_fork", precision=None)
    run_on_ranks(config, _note_the_process_group_when_the_worker_ends, tmp_path)
    assert [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)] == ["False", "False"]
