"""Resume after a kill, checkpoints that survive a crash, bad resume input (2 CPU ranks on gloo)."""

from __future__ import annotations

import contextlib
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

import flair.nn
import pytest
import torch
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricTrainer
from flair_fabric.distributed.stalls import wait_for_global_zero
from flair_fabric.evaluation.api import EvaluationJob
from flair_fabric.language_model.job import LanguageModelJob
from flair_fabric.launch import runner
from flair_fabric.launch.config import make_launch_config
from flair_fabric.prediction.api import PredictionJob
from flair_fabric.training.job import TrainingInWorkers, TrainingJob

from ..plugin_support import FailAt
from ..support import (
    REPO,
    SCRIPTS,
    RunCrashed,
    RunHung,
    counting_saves,
    processes,
    recording_new_groups,
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
        within ``within`` seconds (a process may still be shutting down when the job's main process has ended).
        What is left after that is killed, so that the test leaves nothing running."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        return False


def start_process(command: list[str], folder: Path) -> subprocess.Popen:
    """``command`` as a job of its own (its own session and process group, so it can be signalled whole), its output
    written to files in ``folder``: not to pipes, which a process the job leaves behind would hold open, so that
    waiting for the output would wait for that process too."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    folder.mkdir(parents=True, exist_ok=True)
    number = len(list(folder.glob("job-*.stdout")))
    outputs = [folder / f"job-{number}.stdout", folder / f"job-{number}.stderr"]
    with outputs[0].open("w") as stdout, outputs[1].open("w") as stderr:
        process = subprocess.Popen(
            command, env=env, stdout=stdout, stderr=stderr, text=True, cwd=REPO, start_new_session=True
        )
    process.outputs = outputs  # type: ignore[attr-defined]
    return process


def start_job(config: Path) -> subprocess.Popen:
    """The test script ``ddp_runs.py`` with ``config`` as a job of its own (:func:`start_process`)."""
    return start_process([sys.executable, str(SCRIPTS / "ddp_runs.py"), str(config)], config.parent)


def finish(process: subprocess.Popen, started: float, timeout: float = 300) -> Job:
    """Wait for the job's main process (a process of :func:`start_process`) to end: :class:`RunHung` if it does not
    within ``timeout``. Processes it leaves behind are not waited for: ``Job.no_process_left`` tells."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise RunHung(f"the job did not end within {timeout} s:\n{_output(process)[1][-3000:]}") from None
    stdout, stderr = _output(process)
    return Job(process.returncode, stdout, stderr, time.monotonic() - started, process.pid)


def _output(process: subprocess.Popen) -> tuple[str, str]:
    stdout, stderr = process.outputs  # type: ignore[attr-defined]
    return stdout.read_text(errors="replace"), stderr.read_text(errors="replace")


def wait_for_log_line(process: subprocess.Popen, log_file: Path, line: str, started: float, within: float) -> None:
    """Wait until ``log_file`` holds ``line``; the job ending first is a crash, taking longer than ``within`` s a
    hang (neither is what a test checks)."""
    while not (log_file.exists() and line in log_file.read_text()):
        if process.poll() is not None:
            raise RunCrashed(f"the job ended before {line!r} was logged:\n{_output(process)[1][-3000:]}")
        if time.monotonic() - started > within:
            os.killpg(process.pid, signal.SIGKILL)
            raise RunHung(f"{line!r} was not logged within {within} s")
        time.sleep(0.2)


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


def test_spawned_workers_exit_when_the_process_that_started_them_is_killed(tmp_path: Path) -> None:
    """The script's own process is SIGKILLed while its spawned workers hang where no signal reaches them: each worker
    notices that its starter is gone and exits."""
    command = [sys.executable, str(SCRIPTS / "killed_caller.py"), str(tmp_path)]
    started = time.monotonic()
    job = finish(start_process(command, tmp_path / "job"), started, timeout=180)
    if job.returncode != -signal.SIGKILL:  # the script failed before it was killed: nothing is shown
        raise RunCrashed(f"the script ended with {job.returncode} before it was killed:\n{job.stderr[-3000:]}")
    assert job.no_process_left(within=15), "a spawned worker outlived the process that started it"


@pytest.mark.parametrize(
    ("stall", "where"),
    [
        ({}, r"in epoch 2: the agreement on stops at the start of the epoch"),
        ({"step": 3}, r"in epoch 2, step 3: forward and backward"),
    ],
    ids=["at-an-epoch-start", "at-a-step"],
)
def test_a_stalled_rank_ends_the_job_after_the_collective_timeout_with_an_error_that_says_where(
    tmp_path: Path, stall: dict[str, int], where: str
) -> None:
    """A forked rank that stops making progress without closing its sockets (gloo would wait), at the start of epoch
    2 or before step 3 of it: the other rank's collective times out after 3 s, its error says where it was, and the
    stalled rank is ended too. (Forked workers: the rendezvous must also finish within the timeout, which a
    relaunched script's imports would not. The stalled rank holds the SIGTERM with which torch ends it, so it would
    be killed 30 s later; it stalls for 12 s and then finds its peer gone, which ends it sooner. Without the timeout,
    the other rank would wait those 12 s and train on: no error.)"""
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
            plugins=[FailAt(epoch=2, rank=rank, how="stall", stall_seconds=12, **stall)],
        )
    assert time.monotonic() - started < 60, "the timeout must end the job"
    assert f"global rank {1 - rank} of 2" in str(raised.value)
    assert re.search(where, str(raised.value)), str(raised.value)
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children(), "the stalled rank must not outlive the job"


def _relaunched_rank(process: subprocess.Popen) -> int:
    """The pid of the copy of the script that rank 0 (``process``) relaunched as rank 1."""
    copies = [
        info.pid
        for info in processes()
        if info.parent == process.pid and b"ddp_runs.py" in Path(f"/proc/{info.pid}/cmdline").read_bytes()
    ]
    assert len(copies) == 1, copies
    return copies[0]


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_job_stops_every_rank_and_saves_the_final_model_once(
    tmp_path: Path, signal_number: signal.Signals
) -> None:
    """SIGINT to the whole job (what Ctrl-C in a terminal does), SIGTERM to rank 1 alone (a scheduler's signal to one
    task): the ranks agree on it and all stop at the same step, final-model.pt is written once, by global rank 0, with
    the weights every rank stopped with, and the job exits 0."""
    run_dir = tmp_path / "interrupted"
    started = time.monotonic()
    kwargs = {
        "max_epochs": 200,
        "checkpoint_every_n_epochs": 0,
        "use_final_model_for_eval": True,
        "collective_timeout": 30,  # a rank that trains on alone leaves the other waiting no longer than this
    }
    process = start_job(_config(tmp_path, "interrupted", kwargs=kwargs, count_saves=True))
    log_file = run_dir / "training.log"
    wait_for_log_line(process, log_file, "EPOCH 2 done", started, within=120)
    if signal_number == signal.SIGINT:
        os.killpg(process.pid, signal_number)
    else:
        os.kill(_relaunched_rank(process), signal_number)
    job = finish(process, started, timeout=120)

    assert job.returncode == 0, job.stderr[-3000:]  # the claim: an agreed interrupt ends the job with exit code 0
    log = log_file.read_text()
    received_by = "rank" if signal_number == signal.SIGINT else "rank 1"
    assert f"{signal_number.name} received by {received_by}" in log and "Exiting from training early." in log
    assert log.count("Saving model ...") == 1
    saves = (run_dir / "saves.txt").read_text().splitlines()
    assert [line for line in saves if line.endswith(" final-model.pt")] == ["0 final-model.pt"], saves
    epochs = [int(line.split("EPOCH ")[1].split()[0]) for line in log.splitlines() if " done: loss" in line]
    assert 2 <= len(epochs) < 200
    steps = [len(json.loads((run_dir / f"summary-rank{rank}.json").read_text())["lr_trace"]) for rank in (0, 1)]
    assert steps[0] == steps[1], "both ranks stopped after the same number of steps"
    final = TextClassifier.load(run_dir / "final-model.pt")  # the weights both ranks stopped with
    for rank in (0, 1):
        assert state_dict_difference(final.state_dict(), torch.load(run_dir / f"weights-rank{rank}.pt")["final"]) == 0
    assert not list(run_dir.glob(".*.tmp")), "no half-written file is left"
    assert job.no_process_left()


class _SignalsItselfAfterEpoch2(TrainerPlugin):
    """Sends ``signal_number`` to its own process after epoch 2 (a scheduler's SIGTERM to a one-process job)."""

    def __init__(self, signal_number: signal.Signals) -> None:
        super().__init__()
        self.signal_number = signal_number

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        if epoch == 2:
            os.kill(os.getpid(), self.signal_number)
            time.sleep(0.5)  # the handler runs here


def test_sigterm_in_one_process_ends_training_like_ctrl_c_and_saves_the_final_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process SIGTERM is handled like Ctrl-C: flair's interrupt handling ends the run early ("Exiting from
    training early.") and writes final-model.pt once, with the weights training stopped with; train() returns."""

    def not_held(signum: int, frame: object) -> None:  # what runs if training leaves SIGTERM alone
        raise AssertionError("SIGTERM was not handled by the run")

    previous = signal.signal(signal.SIGTERM, not_held)  # (not the default action, which would end pytest itself)
    try:
        corpus = small_trec()
        model = tiny_text_classifier(corpus)
        saves = tmp_path / "saves.txt"
        monkeypatch.setattr(flair.nn.Model, "save", counting_saves(saves, flair.nn.Model.save))
        stopped_by: BaseException | None = None
        try:
            FabricTrainer(model, corpus).train(
                tmp_path / "run",
                max_epochs=50,
                mini_batch_size=8,
                accelerator="cpu",
                devices=1,
                use_final_model_for_eval=True,
                plugins=[_SignalsItselfAfterEpoch2(signal.SIGTERM)],
            )
        except (KeyboardInterrupt, SystemExit) as error:  # what reaches the caller instead of flair's handling
            stopped_by = error
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped_by is None, f"SIGTERM ended the run with {stopped_by!r} instead of flair's interrupt handling"
    log = (tmp_path / "run" / "training.log").read_text()
    assert "Exiting from training early." in log and "EPOCH 3 done" not in log
    assert [line for line in saves.read_text().splitlines() if line.endswith(" final-model.pt")] == ["0 final-model.pt"]
    final = TextClassifier.load(tmp_path / "run" / "final-model.pt")
    assert state_dict_difference(final.state_dict(), model.state_dict()) == 0


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
    assert job.returncode != 0
    assert re.search(message, job.stderr), job.stderr[-3000:]
    assert "the processes would not train the same thing" in job.stderr
    assert not (tmp_path / "differing" / "loss.tsv").exists(), "refused before training"
    assert job.no_process_left()


def test_ctrl_c_with_forked_workers_stops_them_together_and_hands_back_the_final_model(tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPTS / "interrupted_workers.py"), str(tmp_path)]
    started = time.monotonic()
    job = finish(start_process(command, tmp_path / "job"), started, timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]  # the claim: an agreed interrupt ends the run with exit code 0
    assert "final-model.pt differs from the caller's model by 0.0" in job.stdout
    log = (tmp_path / "training.log").read_text()
    assert "SIGINT received by rank" in log and log.count("Saving model ...") == 1
    saves = (tmp_path / "saves.txt").read_text().splitlines()
    assert [line for line in saves if line.endswith(" final-model.pt")] == ["0 final-model.pt"], saves
    assert job.no_process_left()


class _SlowRankZeroWork(TextClassifier):
    """A model whose work on global rank 0 alone takes longer than the collective timeout of the run below: its own
    evaluate (not shardable: rank 0 evaluates alone), writing a model file, reading one."""

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(4)
        return super().evaluate(*args, **kwargs)

    def save(self, model_file: Any, checkpoint: bool = False) -> None:
        time.sleep(4)
        super().save(model_file, checkpoint)

    @classmethod
    def load(cls, model_path: Any) -> Any:
        time.sleep(4)
        return super().load(model_path)


def test_work_of_rank_zero_alone_does_not_trip_the_collective_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 waits 4 s for each of rank 0's evaluations of dev and test, its writes of best-model.pt and
    final-model.pt and its read of best-model.pt, with a collective timeout of 3 s: on a gloo group with a 2-hour
    limit, made on every rank."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_SlowRankZeroWork)
    groups = tmp_path / "groups.txt"
    recording_new_groups(monkeypatch, groups)
    try:
        FabricTrainer(model, corpus).train(
            tmp_path / "run",
            max_epochs=1,
            mini_batch_size=4,
            devices=2,
            accelerator="cpu",
            strategy="ddp_fork",
            collective_timeout=3,
        )
    except ProcessRaisedException as error:
        if "waited longer than collective_timeout" in str(error):
            pytest.fail(f"rank 0's work alone tripped the collective timeout: {error}")
        raise
    log = (tmp_path / "run" / "training.log").read_text()
    assert "evaluating on global rank 0 only" in log and "Loading model from best epoch" in log
    assert all((tmp_path / "run" / name).is_file() for name in ("best-model.pt", "final-model.pt", "test.tsv"))
    patient = [line for line in groups.read_text().splitlines() if line.endswith(" gloo 7200.0")]
    assert sorted(patient) == ["0 gloo 7200.0", "1 gloo 7200.0"], groups.read_text()


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


@pytest.mark.parametrize(
    "job_class",
    [TrainingJob, TrainingInWorkers, LanguageModelJob, PredictionJob, EvaluationJob],
    ids=lambda job_class: job_class.__name__,
)
def test_every_kind_of_job_runs_after_the_group_for_rank_0s_file_work_is_made(
    monkeypatch: pytest.MonkeyPatch, job_class: type[runner.Job]
) -> None:
    """Training (in the caller's process and in workers), the language model, predict and evaluate: the runner makes
    the group before the job's own work starts (here in one process, where the job's work is a stand-in)."""
    happened: list[str] = []
    monkeypatch.setattr(runner, "prepare_patient_group", lambda fabric: happened.append("group made"))
    monkeypatch.setattr(job_class, "run_on_rank", lambda job, fabric: happened.append("job runs"))
    job = job_class.__new__(job_class)  # (the job's own state is not used: its work is the stand-in)
    runner.Job.__init__(job)
    config = make_launch_config(accelerator="cpu", devices=1, num_nodes=1, strategy="auto", precision=None)
    runner.run_job(job, config)
    assert happened == ["group made", "job runs"]


def _note_the_process_group_when_the_worker_ends(fabric: Any, folder: Path) -> None:
    rank = fabric.global_rank

    def note() -> None:  # (multiprocessing runs it as the worker process ends, after the runner's code)
        (folder / f"rank-{rank}.txt").write_text(str(torch.distributed.is_initialized()))

    multiprocessing.util.Finalize(None, note, exitpriority=100)


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_a_worker_ends_its_process_groups_when_its_job_is_done(tmp_path: Path, strategy: str) -> None:
    """reliability.md: gloo's threads must not outlive a worker's Python (they can abort its finalization)."""
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, precision=None)
    run_on_ranks(config, _note_the_process_group_when_the_worker_ends, tmp_path)
    assert [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)] == ["False", "False"]
