"""Preemption-proof training (2 CPU ranks, gloo): step-level checkpoints, exact mid-epoch resume after SIGKILL,
SIGUSR1 with a SLURM requeue, torchrun restarts, retention, another number of processes, bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers.plugins import TrainerPlugin
from lightning.fabric import Fabric
from torch.multiprocessing.spawn import ProcessExitedException

from flair_fabric import FabricTrainer, FlairFSDPStrategy
from flair_fabric.state.run_state import RunState
from flair_fabric.state.training_state import (
    complete_checkpoints,
    find_checkpoint,
    newest_checkpoint,
    read_progress,
    save_training_state,
)

from ..support import (
    REPO,
    SCRIPTS,
    RunHung,
    expect_success,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
    write_config,
)

# AdamW with flair's linear schedule (fine_tune), shuffled batches, dropout, chunks of 2: 6 steps per epoch
RESUMABLE: dict[str, Any] = {
    "max_epochs": 3,
    "mini_batch_size": 4,
    "learning_rate": 0.05,
    "shuffle": True,
    "mini_batch_chunk_size": 2,
    "embeddings_storage_mode": "none",
    "accelerator": "cpu",
    "create_file_logs": False,
}
STEPS = 18


class _Steps(TrainerPlugin):
    """On global rank 0: the learning rate after every step and how many batches were embedded."""

    def __init__(self, out: Path, kill_at: int | None = None) -> None:
        super().__init__()
        self.out, self.kill_at = out, kill_at
        self.trace: list[tuple[int, float]] = []
        self.embedded = 0

    @TrainerPlugin.hook
    def before_training_batch(self, **kw: Any) -> None:
        self.embedded += 1

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        if batch_count == self.kill_at:  # every rank, at the same step: a job that dies without a chance to save
            os.kill(os.getpid(), signal.SIGKILL)
        self.trace.append((batch_count, self.trainer.optimizer.param_groups[0]["lr"]))

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.is_global_zero:
            (self.out / "steps.json").write_text(json.dumps({"trace": self.trace, "embedded": self.embedded}))


class _Trained(TrainerPlugin):
    """On every rank: the texts of each batch it trained, appended to ``<out>/trained-rank<r>.jsonl`` at once (a
    job killed later keeps what it wrote)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    @TrainerPlugin.hook
    def after_training_batch(self, batch: list, epoch: int, batch_count: int, **kw: Any) -> None:
        row = {"epoch": epoch, "step": batch_count, "texts": [point.to_original_text() for point in batch]}
        with (self.out / f"trained-rank{self.trainer.global_rank}.jsonl").open("a") as stream:
            stream.write(json.dumps(row) + "\n")


def _trained_in(folder: Path, epoch: int, up_to_step: int | None = None) -> Counter:
    """The data points every rank of the run in ``folder`` trained in ``epoch`` (up to a step), counted."""
    texts: Counter = Counter()
    for path in folder.glob("trained-rank*.jsonl"):
        for row in map(json.loads, path.read_text().splitlines()):
            if row["epoch"] == epoch and (up_to_step is None or row["step"] <= up_to_step):
                texts.update(row["texts"])
    return texts


def _strategy(name: str) -> Any:
    return FlairFSDPStrategy(start_method="fork") if name == "fsdp" else "ddp_fork"


ONE_PROCESS = "one process"  # flair's own loader: the epoch's order is drawn from the generators


def _train(folder: Path, strategy: str, devices: int = 2, **options: Any) -> torch.nn.Module:
    corpus = small_trec()
    model = tiny_text_classifier(corpus, dropout=0.3)
    kill_at = options.pop("kill_at", None)
    plugins = [_Steps(folder, kill_at), *([_Trained(folder)] if options.pop("record", False) else [])]
    kwargs = {**RESUMABLE, "checkpoint_every_n_steps": 2, **options}
    devices = 1 if strategy == ONE_PROCESS else devices
    chosen = _strategy(strategy) if devices > 1 else "ddp_fork"  # one forked worker: SIGKILL spares the test
    FabricTrainer(model, corpus).fine_tune(folder, strategy=chosen, devices=devices, plugins=plugins, **kwargs)
    return model


def _loss_rows(folder: Path) -> list[list[str]]:
    rows = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    timestamp = rows[0].index("TIMESTAMP")
    return [row[:timestamp] + row[timestamp + 1 :] for row in rows]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", ONE_PROCESS])
def test_a_job_killed_mid_epoch_resumes_to_the_weights_of_the_uninterrupted_run(tmp_path: Path, strategy: str) -> None:
    reference = _train(tmp_path / "uninterrupted", strategy)
    expected = json.loads((tmp_path / "uninterrupted" / "steps.json").read_text())
    steps = STEPS * (2 if strategy == ONE_PROCESS else 1)
    assert len(expected["trace"]) == steps
    per_epoch = steps // 3
    for kill_at in random.Random(2026).sample(range(per_epoch + 2, 2 * per_epoch), 3):  # steps of epoch 2
        folder = tmp_path / f"killed-at-{kill_at}"
        with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
            _train(folder, strategy, kill_at=kill_at)
        saved_after = (kill_at - 1) // 2 * 2  # the newest checkpoint the killed job completed
        assert newest_checkpoint(folder).name == f"step-{saved_after:09d}"
        assert (newest_checkpoint(folder) / "state.ckpt").is_dir() == (strategy == "fsdp")
        resumed = _train(folder, strategy, resume_from="auto")
        assert state_dict_difference(reference.state_dict(), resumed.state_dict()) <= 1e-6, kill_at
        assert _loss_rows(folder) == _loss_rows(tmp_path / "uninterrupted")
        recorded = json.loads((folder / "steps.json").read_text())
        assert recorded["trace"] == expected["trace"][saved_after:], "the same learning rates from the resumed step"
        assert recorded["embedded"] == len(expected["trace"]) - saved_after, "only the unseen batches are embedded"


@pytest.mark.multiprocess
def test_a_preemption_signal_writes_one_checkpoint_requeues_and_the_requeued_job_continues_exactly(
    tmp_path: Path,
) -> None:
    options = {**RESUMABLE, "devices": 2, "strategy": "ddp_fork"}  # checkpoints only when preempted
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    scontrol = bin_folder / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "scontrol-called"}\n')
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{bin_folder}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
    }

    def job(name: str, **config: Any) -> subprocess.CompletedProcess:
        path = write_config(tmp_path / f"{name}.json", {"out": str(tmp_path), "kwargs": options, **config})
        command = [sys.executable, str(SCRIPTS / "preemptible.py"), str(path)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)

    preempted = job("preempted", preempt_at=9)
    assert preempted.returncode == 75, preempted.stderr[-3000:]
    assert (tmp_path / "scontrol-called").exists(), "scontrol requeue was not called (is the job id read?)"
    assert (tmp_path / "scontrol-called").read_text().split() == ["requeue", "4242"]
    checkpoints = complete_checkpoints(tmp_path / "run")
    assert len(checkpoints) == 1 and read_progress(checkpoints[0]).step_in_epoch > 0
    assert "SIGUSR1 received by rank" in preempted.stderr + preempted.stdout

    requeued = job("requeued", kwargs={**options, "resume_from": "auto"})
    expect_success(requeued.returncode, "the requeued job", requeued.stderr)
    reference = _train(tmp_path / "uninterrupted", "ddp", checkpoint_every_n_steps=None)
    resumed = torch.load(tmp_path / "weights.pt")
    assert state_dict_difference(reference.state_dict(), resumed) <= 1e-6


@pytest.mark.multiprocess
def test_torchrun_restarts_continue_from_the_last_checkpoint_and_give_up_after_the_restarts(tmp_path: Path) -> None:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    options = {**RESUMABLE, "devices": 2, "checkpoint_every_n_steps": 2}
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("LOCAL_RANK", None)

    def job(name: str, **config: Any) -> subprocess.CompletedProcess:
        out = tmp_path / name
        out.mkdir()
        path = write_config(out / "config.json", {"out": str(out), "kwargs": options, **config})
        command = [torchrun, "--standalone", "--nproc_per_node=2", "--max-restarts=1", str(SCRIPTS / "preemptible.py")]
        try:  # a run takes about 10 s; a restarted attempt that cannot meet its peers waits until killed
            return subprocess.run([*command, str(path)], env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as stuck:
            raise RunHung(
                f"the torchrun job {name} did not end within 120 s (a restart that never met): {stuck}"
            ) from None

    once = job("fails-once", fail_once_at=9)
    expect_success(once.returncode, "the torchrun job that fails once", once.stderr)
    assert "resumed from" in once.stdout + once.stderr
    reference = _train(tmp_path / "undisturbed", "ddp")
    assert state_dict_difference(reference.state_dict(), torch.load(tmp_path / "fails-once" / "weights.pt")) <= 1e-6

    always = job("always-fails", always_fail_at=9)
    assert always.returncode != 0
    assert "injected failure on rank 1 at step 9" in always.stdout + always.stderr


def test_retention_keeps_the_newest_complete_checkpoints_and_a_crash_while_writing_leaves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_text_classifier(small_trec())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", devices=1)

    def save(steps: int) -> None:
        progress = RunState(0, steps, 0.5, 0, 1, {}, step_in_epoch=steps)
        save_training_state(fabric, tmp_path, model, optimizer, {}, progress, {}, keep=2)

    save(2)
    save(4)

    def crash(path: Any, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("the disk is full")

    monkeypatch.setattr(fabric, "save", crash)
    with pytest.raises(OSError, match="the disk is full"):
        save(6)
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step-000000002", "step-000000004"]
    assert find_checkpoint("auto", tmp_path).name == "step-000000004"
    monkeypatch.undo()
    save(8)
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step-000000004", "step-000000008"]
    assert not list((tmp_path / "checkpoints").glob(".*.tmp")), "the broken write is cleaned up by the next one"


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_of_two_processes_resumes_on_one_and_on_three(tmp_path: Path, strategy: str) -> None:
    """... and the interrupted epoch trains exactly the data points the two processes had not read yet."""
    written = tmp_path / "two"
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        _train(written, strategy, kill_at=9, record=True)  # a checkpoint in the middle of epoch 2
    saved = read_progress(newest_checkpoint(written))
    assert (saved.epoch, saved.step_in_epoch) == (1, 2)
    read_before = _trained_in(written, epoch=2, up_to_step=saved.batch_count)
    assert sum(read_before.values()) == saved.epoch_position == 16
    every_point = Counter(point.to_original_text() for point in small_trec().train)
    for devices in (1, 3):
        folder = tmp_path / f"on-{devices}"
        shutil.copytree(written, folder)
        for record in folder.glob("trained-rank*.jsonl"):
            record.unlink()
        _train(folder, strategy, devices=devices, resume_from="auto", create_file_logs=True, record=True)
        assert _trained_in(folder, epoch=2) == every_point - read_before, "the rest of the epoch, each point once"
        assert _trained_in(folder, epoch=3) == every_point, "the next epoch is whole"
        train_loss = _loss_rows(folder)[0].index("TRAIN_LOSS")
        losses = [float(row[train_loss]) for row in _loss_rows(folder)[1:]]
        assert len(losses) == 3 and losses[2] < losses[0], "training goes on"
        assert f"resuming a checkpoint of 2 process(es) on {devices}" in (folder / "training.log").read_text()


BAD_CHECKPOINT_ARGUMENTS = [
    ({"checkpoint_every_n_steps": 0}, r"checkpoint_every_n_steps=0 is not valid"),
    ({"checkpoint_every_n_minutes": -5}, r"checkpoint_every_n_minutes=-5 is not valid"),
    ({"keep_checkpoints": 0}, r"keep_checkpoints=0 is not valid"),
    ({"requeue_signal": "SIGNOPE"}, r"requeue_signal='SIGNOPE' is not a signal"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD_CHECKPOINT_ARGUMENTS)
def test_bad_checkpoint_arguments_are_refused_before_anything_starts(
    tmp_path: Path, arguments: dict[str, Any], message: str
) -> None:
    corpus = small_trec()
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    with pytest.raises(ValueError, match=message):
        trainer.train(tmp_path / "run", max_epochs=1, accelerator="cpu", devices=2, strategy="ddp_fork", **arguments)
    assert trainer.fabric is None and not (tmp_path / "run").exists()


@pytest.mark.multiprocess
def test_a_rank_that_dies_while_a_checkpoint_is_written_ends_the_job_and_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flair_fabric.state import training_state

    saved = training_state.rng_state

    def rank_one_dies_in_the_third_save() -> dict[str, Any]:
        if torch.distributed.get_rank() == 1 and len(complete_checkpoints(tmp_path / "run")) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return saved()

    monkeypatch.setattr(training_state, "rng_state", rank_one_dies_in_the_third_save)
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        _train(tmp_path / "run", "ddp", keep_checkpoints=5, collective_timeout=60)
    assert [path.name for path in complete_checkpoints(tmp_path / "run")] == ["step-000000002", "step-000000004"]


@pytest.mark.multiprocess
def test_checkpoints_by_time_are_agreed_by_every_rank_inside_epochs(tmp_path: Path) -> None:
    _train(tmp_path, "ddp", checkpoint_every_n_steps=None, checkpoint_every_n_minutes=1e-6, keep_checkpoints=100)
    inside = [read_progress(folder).step_in_epoch for folder in complete_checkpoints(tmp_path)]
    assert len(inside) >= 6 and any(step > 0 for step in inside), "rank 0's clock asked at the agreement points"
