"""Preemption-proof training (2 CPU ranks, gloo): step-level checkpoints, exact mid-epoch resume after SIGKILL,
SIGUSR1 with a SLURM requeue, torchrun restarts, retention, another number of processes, bad input."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import types
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import numpy
import pytest
import torch
from flair.trainers.plugins import TrainerPlugin
from lightning.fabric import Fabric
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException
from torch.utils.data import Dataset

from flair_fabric import FabricTrainer, FlairFSDPStrategy
from flair_fabric import trainer as trainer_module
from flair_fabric.state.run_state import RunState
from flair_fabric.state.training_state import (
    complete_checkpoints,
    find_checkpoint,
    newest_checkpoint,
    read_progress,
    save_training_state,
)
from flair_fabric.training import checkpointing

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
    """On global rank 0: the learning rate after every step, a number drawn from Python's and from numpy's generator
    after every step, and how many batches were embedded."""

    def __init__(self, out: Path, kill_at: int | None = None) -> None:
        super().__init__()
        self.out, self.kill_at = out, kill_at
        self.trace: list[tuple[int, float]] = []
        self.draws: list[tuple[float, float]] = []
        self.embedded = 0

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        if epoch == 1:  # the same streams from the start in every run (the launch draws from Python's unevenly)
            random.seed(2026)
            numpy.random.seed(2026)

    @TrainerPlugin.hook
    def before_training_batch(self, **kw: Any) -> None:
        self.embedded += 1

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        if batch_count == self.kill_at:  # every rank, at the same step: a job that dies without a chance to save
            os.kill(os.getpid(), signal.SIGKILL)
        self.trace.append((batch_count, self.trainer.optimizer.param_groups[0]["lr"]))
        self.draws.append((random.random(), float(numpy.random.rand())))  # where each generator stands

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.is_global_zero:
            recorded = {"trace": self.trace, "draws": self.draws, "embedded": self.embedded}
            (self.out / "steps.json").write_text(json.dumps(recorded))


class _ReadsLog(Dataset):
    """The train split, logging each data point read (``R <index>``) on this rank to ``<out>/reads-<tag>-rank<r>``;
    :class:`_ReadMarks` logs each epoch's start (``E <epoch>``) and each step's start (``S <step>``) there."""

    def __init__(self, data: Dataset, out: Path, tag: str) -> None:
        self.data, self.out, self.tag = data, out, tag

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        _log_read(self.out, self.tag, f"R {index}")
        return self.data[index]


def _log_read(out: Path, tag: str, line: str) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with (out / f"reads-{tag}-rank{rank}").open("a") as stream:
        stream.write(line + "\n")


class _ReadMarks(TrainerPlugin):
    def __init__(self, out: Path, tag: str) -> None:
        super().__init__()
        self.out, self.tag = out, tag

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        _log_read(self.out, self.tag, f"E {epoch}")

    @TrainerPlugin.hook
    def before_training_batch(self, batch_count: int, **kw: Any) -> None:
        _log_read(self.out, self.tag, f"S {batch_count}")


def _reads_by_step(folder: Path, tag: str, rank: int) -> dict[Any, list[int]]:
    """The indices a rank read for each step (the reads before the step's start), ``"setup"`` for those before the
    first epoch (the data points' lengths, on several processes) and ``"after"`` for any after the last step."""
    reads: dict[Any, list[int]] = {}
    pending: list[int] = []
    for kind, value in (line.split() for line in (folder / f"reads-{tag}-rank{rank}").read_text().splitlines()):
        if kind == "R":
            pending.append(int(value))
        elif kind == "E" and "setup" not in reads:
            reads["setup"], pending = pending, []
        elif kind == "S":
            reads[int(value)], pending = pending, []
    reads["after"] = pending
    return reads


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


class _ResumedState(TrainerPlugin):
    """On global rank 0, at the start of the first epoch the run trains: the plugins' schedulers' state and, in one
    process, the weights and the optimizer's state (with the parameters' names in the optimizer's order), saved to
    ``<out>/resumed-state.pt``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.saved = out, False

    @TrainerPlugin.hook
    def before_training_epoch(self, **kw: Any) -> None:
        if self.saved or not self.trainer.is_global_zero:
            return
        self.saved = True
        schedulers = [plugin.scheduler for plugin in self.trainer.plugins if getattr(plugin, "scheduler", None)]
        state: dict[str, Any] = {"schedulers": [copy.deepcopy(each.state_dict()) for each in schedulers]}
        if self.trainer.world_size == 1:
            optimizer = self.trainer.optimizer
            names = {id(parameter): name for name, parameter in self.model.named_parameters()}
            state["weights"] = {name: value.detach().clone() for name, value in self.model.named_parameters()}
            state["optimizer"] = copy.deepcopy(optimizer.state_dict())
            state["names"] = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        torch.save(state, self.out / "resumed-state.pt")


def _whole_checkpoint(folder: Path, names: list[str], out: Path) -> dict[str, Any]:
    """The model's and the optimizer's state in a checkpoint, read by torch (not by flair-fabric), by parameter name:
    a ddp checkpoint's ``state.ckpt`` file, or an fsdp one's sharded ``state.ckpt`` folder (torch's distributed
    checkpoint, converted to one file by torch's own ``dcp_to_torch_save``). ``names``: the parameters in the
    optimizer's order (a ddp checkpoint keys the optimizer's state by position)."""
    state = folder / "state.ckpt"
    if state.is_dir():
        dcp_to_torch_save(state, out)
        whole = torch.load(out, weights_only=False)
        return {"model": whole["model"], "optimizer": whole["optimizer"]["state"], "groups": whole["optimizer"]}
    whole = torch.load(state, weights_only=False)
    by_name = {names[position]: value for position, value in whole["optimizer"]["state"].items()}
    return {"model": whole["model"], "optimizer": by_name, "groups": whole["optimizer"]}


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
    plugins += [_ResumedState(folder)] if options.pop("record_resumed_state", False) else []
    plugins += options.pop("extra_plugins", [])
    reads = options.pop("record_reads", None)
    if reads:
        folder.mkdir(parents=True, exist_ok=True)
        corpus._train = _ReadsLog(corpus.train, folder, reads)
        plugins.append(_ReadMarks(folder, reads))
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
    """SIGKILL at three steps of epoch 2; the first kill resumes from the checkpoint's own folder
    (``checkpoints/step-...``, under fsdp a sharded ``state.ckpt`` folder), the others with resume_from="auto"."""
    reference = _train(tmp_path / "uninterrupted", strategy, record_reads="uninterrupted")
    expected = json.loads((tmp_path / "uninterrupted" / "steps.json").read_text())
    steps = STEPS * (2 if strategy == ONE_PROCESS else 1)
    assert len(expected["trace"]) == steps
    per_epoch = steps // 3
    kill_points = random.Random(2026).sample(range(per_epoch + 2, 2 * per_epoch), 3)  # steps of epoch 2
    for attempt, kill_at in enumerate(kill_points):
        folder = tmp_path / f"killed-at-{kill_at}"
        with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
            _train(folder, strategy, kill_at=kill_at)
        saved_after = (kill_at - 1) // 2 * 2  # the newest checkpoint the killed job completed
        assert newest_checkpoint(folder).name == f"step-{saved_after:09d}"
        assert (newest_checkpoint(folder) / "state.ckpt").is_dir() == (strategy == "fsdp")
        resume_from = newest_checkpoint(folder) if attempt == 0 else "auto"
        try:
            resumed = _train(folder, strategy, resume_from=resume_from, record_reads="resumed")
        except ValueError as refused:
            if not re.search(r"is not a flair-fabric checkpoint|nothing in it was run", str(refused)):
                raise
            pytest.fail(f"resume_from={resume_from} was refused: {refused}")
        assert state_dict_difference(reference.state_dict(), resumed.state_dict()) <= 1e-6, kill_at
        assert _loss_rows(folder) == _loss_rows(tmp_path / "uninterrupted")
        recorded = json.loads((folder / "steps.json").read_text())
        assert recorded["trace"] == expected["trace"][saved_after:], "the same learning rates from the resumed step"
        assert recorded["draws"] == expected["draws"][saved_after:], "Python's and numpy's generators continue"
        assert recorded["embedded"] == len(expected["trace"]) - saved_after, "only the unseen batches are embedded"
        for rank in range(1 if strategy == ONE_PROCESS else 2):  # and only the unseen batches are read
            uninterrupted = _reads_by_step(tmp_path / "uninterrupted", "uninterrupted", rank)
            unseen = {key: read for key, read in uninterrupted.items() if not isinstance(key, int) or key > saved_after}
            assert _reads_by_step(folder, "resumed", rank) == unseen, (kill_at, rank)


@pytest.mark.multiprocess
def test_a_preemption_signal_writes_one_checkpoint_requeues_and_the_requeued_job_continues_exactly(
    tmp_path: Path,
) -> None:
    """SIGUSR1 after step 9 (every step is an agreement point here: flair logs every step of a 6-step epoch): every
    rank stops after step 10 with one checkpoint, step 10; global rank 0 runs scontrol once; the job, and every rank
    of a script relaunch, exit with 75; the requeued job ends with the uninterrupted weights."""
    options = {**RESUMABLE, "devices": 2, "strategy": "ddp_fork"}  # checkpoints only when preempted
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    scontrol = bin_folder / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_CALLS"\n')  # one line per call
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{bin_folder}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
    }

    def job(name: str, out: Path = tmp_path, **config: Any) -> subprocess.CompletedProcess:
        out.mkdir(exist_ok=True)
        path = write_config(out / f"{name}.json", {"out": str(out), "kwargs": options, **config})
        command = [sys.executable, str(SCRIPTS / "preemptible.py"), str(path)]
        calls = {"SCONTROL_CALLS": str(out / "scontrol-called")}
        return subprocess.run(
            command, env={**env, **calls}, capture_output=True, text=True, timeout=240, start_new_session=True
        )

    def preempted_job(out: Path, strategy: str) -> subprocess.CompletedProcess:
        kept = {**options, "strategy": strategy, "keep_checkpoints": 100}  # every checkpoint it writes stays
        preempted = job("preempted", out, kwargs=kept, preempt_at=9, record=True)
        assert preempted.returncode == 75, preempted.stderr[-3000:]
        assert (out / "scontrol-called").exists(), "scontrol requeue was not called (is the job id read?)"
        assert (out / "scontrol-called").read_text().splitlines() == ["requeue 4242"], "once, by global rank 0"
        assert [path.name for path in complete_checkpoints(out / "run")] == ["step-000000010"], "one, mid-epoch"
        assert read_progress(complete_checkpoints(out / "run")[0]).step_in_epoch == 4
        for rank in (0, 1):  # every rank stopped at the agreement after the signal
            assert (out / f"steps-rank{rank}").read_text().split() == [str(step) for step in range(1, 11)], rank
        assert "SIGUSR1 received by rank" in preempted.stderr + preempted.stdout
        return preempted

    preempted_job(tmp_path, "ddp_fork")  # forked workers: the job's exit code is the caller's
    relaunched = tmp_path / "relaunch"
    preempted_job(relaunched, "ddp")  # the script relaunch: each rank is a process of its own
    assert [(relaunched / f"exit-rank{rank}").read_text() for rank in (0, 1)] == ["75", "75"]
    assert json.loads((relaunched / "relaunched-exits.json").read_text()) == [75], "rank 1's process exits with 75"

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
    assert re.search(r"resumed from \S*step-000000008 ", once.stdout + once.stderr), "the newest: step 8"
    reference = _train(tmp_path / "undisturbed", "ddp")
    assert state_dict_difference(reference.state_dict(), torch.load(tmp_path / "fails-once" / "weights.pt")) <= 1e-6

    always = job("always-fails", always_fail_at=9)
    assert always.returncode != 0
    assert "injected failure on rank 1 at step 9" in always.stdout + always.stderr


def test_resume_from_defaults_to_auto_only_when_torchrun_restarted_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCHELASTIC_RESTART_COUNT=0 (torchrun's first attempt): a fresh start although a checkpoint is there; 1 (a
    restart): the newest checkpoint, also with resume_from=None passed explicitly (the default)."""
    corpus = small_trec()
    options = {"max_epochs": 2, "mini_batch_size": 8, "accelerator": "cpu", "devices": 1, "create_file_logs": False}
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path, checkpoint_every_n_epochs=1, **options)
    newest = newest_checkpoint(tmp_path)
    assert newest is not None and newest.name == "step-000000012"
    resumed_from: list[Path | None] = []
    monkeypatch.setattr(trainer_module, "run_job", lambda job, launch: resumed_from.append(job.arguments.resume_folder))
    for count, passed in (("0", {}), ("1", {}), ("1", {"resume_from": None})):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path, **{**options, "max_epochs": 3}, **passed)
    assert resumed_from == [None, newest, newest]


class _AgentStore:
    """Stands in for torchrun's agent store, which every attempt shares: ``get`` of a key nobody set yet would wait
    (here it raises :class:`_WouldWait`)."""

    keys: ClassVar[dict[str, bytes]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def get(self, key: str) -> bytes:
        if key not in self.keys:
            raise _WouldWait(key)
        return self.keys[key]


class _WouldWait(Exception):
    """A rank would wait for a key global rank 0 of its attempt has not set yet."""


def test_every_torchrun_attempt_meets_at_a_store_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0's rank 0 announced its store; a rank of attempt 1 that asks before attempt 1's rank 0 announced its
    own waits (it does not go to attempt 0's dead store), then meets at attempt 1's store."""
    from flair_fabric.launch import rendezvous

    _AgentStore.keys.clear()
    hosted = iter([29001, 29002])
    monkeypatch.setattr(rendezvous, "TCPStore", _AgentStore)
    monkeypatch.setattr(rendezvous, "host_store", lambda timeout, address: types.SimpleNamespace(port=next(hosted)))
    monkeypatch.setattr(rendezvous, "_kept_for_this_process", [])
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)

    def meet(rank: int, attempt: int) -> str:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        with rendezvous.torchrun_rendezvous(timedelta(seconds=5), single_node=True):
            return os.environ["MASTER_PORT"]

    assert meet(rank=0, attempt=0) == "29001"
    with pytest.raises(_WouldWait):
        meet(rank=1, attempt=1)
    assert meet(rank=0, attempt=1) == "29002"
    assert meet(rank=1, attempt=1) == "29002", "attempt 1's own store"
    assert len(_AgentStore.keys) == 2, "a key of its own per attempt"


def test_resume_auto_takes_the_complete_checkpoint_with_the_most_steps(tmp_path: Path) -> None:
    """Written out of step order (step 8, then step 4), and a step-12 folder without its progress record (not
    complete): "auto" takes step 8."""
    model = tiny_text_classifier(small_trec())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", devices=1)
    for steps in (8, 4):
        progress = RunState(0, steps, 0.5, 1, {}, step_in_epoch=steps)
        save_training_state(fabric, tmp_path, model, optimizer, {}, progress, {}, keep=5)
    (tmp_path / "checkpoints" / "step-000000012").mkdir()
    assert find_checkpoint("auto", tmp_path) == tmp_path / "checkpoints" / "step-000000008"


def test_retention_keeps_the_newest_complete_checkpoints_and_a_crash_while_writing_leaves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_text_classifier(small_trec())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", devices=1)

    def save(steps: int) -> None:
        progress = RunState(0, steps, 0.5, 1, {}, step_in_epoch=steps)
        save_training_state(fabric, tmp_path, model, optimizer, {}, progress, {}, keep=2)

    save(2)
    save(4)

    def crash(path: Any, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("the disk is full")

    def kept() -> dict[str, bytes]:  # every file of the complete checkpoints
        return {
            str(path.relative_to(tmp_path)): path.read_bytes()
            for folder in complete_checkpoints(tmp_path)
            for path in sorted(folder.rglob("*"))
            if path.is_file()
        }

    before = kept()
    monkeypatch.setattr(fabric, "save", crash)
    with pytest.raises(OSError, match="the disk is full"):
        save(6)
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step-000000002", "step-000000004"]
    assert kept() == before, "the complete checkpoints are left byte for byte"
    assert find_checkpoint("auto", tmp_path).name == "step-000000004"
    with pytest.raises(OSError, match="the disk is full"):  # the same step saved again (an epoch end on a step trigger)
        save(4)
    assert kept() == before, "a crash while a step is saved again leaves its complete checkpoint"
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
    saved_schedulers = list(torch.load(newest_checkpoint(written) / "extras.pt")["schedulers"].values())
    levels = logging.FileHandler(tmp_path / "levels.log")  # the forked ranks inherit it
    levels.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("flair").addHandler(levels)
    try:
        for devices in (1, 3):
            folder = tmp_path / f"on-{devices}"
            shutil.copytree(written, folder)
            for record in folder.glob("trained-rank*.jsonl"):
                record.unlink()
            resumed_from = {"resume_from": "auto", "create_file_logs": True, "record": True}
            try:
                _train(folder, strategy, devices=devices, record_resumed_state=True, **resumed_from)
            except ProcessRaisedException as error:  # a rank could not read the checkpoint's model and optimizer
                if "state.ckpt" not in str(error):
                    raise
                pytest.fail(f"the checkpoint of 2 processes did not resume on {devices}: {error}")
            assert _trained_in(folder, epoch=2) == every_point - read_before, "the rest of the epoch, each point once"
            assert _trained_in(folder, epoch=3) == every_point, "the next epoch is whole"
            train_loss = _loss_rows(folder)[0].index("TRAIN_LOSS")
            losses = [float(row[train_loss]) for row in _loss_rows(folder)[1:]]
            assert len(losses) == 3 and losses[2] < losses[0], "training goes on"
            warning = f"resuming a checkpoint of 2 process(es) on {devices}"
            assert warning in (folder / "training.log").read_text()
            assert f"WARNING {warning}" in (tmp_path / "levels.log").read_text(), "logged as a warning"
            resumed = torch.load(folder / "resumed-state.pt", weights_only=False)
            assert resumed["schedulers"] == saved_schedulers, "the schedulers continue from their saved state"
            if devices == 1:  # the whole model and optimizer state of the 2 processes, read into one
                whole = _whole_checkpoint(newest_checkpoint(written), resumed["names"], tmp_path / "whole.pt")
                assert resumed["weights"].keys() == whole["model"].keys()
                assert all(torch.equal(value, whole["model"][name]) for name, value in resumed["weights"].items())
                optimizer = resumed["optimizer"]
                assert len(optimizer["state"]) == len(resumed["names"]) == len(whole["optimizer"]) > 0
                for position, name in enumerate(resumed["names"]):
                    mine, saved = optimizer["state"][position], whole["optimizer"][name]
                    assert mine.keys() == saved.keys(), name
                    same = [torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(saved[key])) for key in mine]
                    assert all(same), name
                assert optimizer["param_groups"][0]["lr"] == whole["groups"]["param_groups"][0]["lr"]
    finally:
        logging.getLogger("flair").removeHandler(levels)
        levels.close()


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


_CLOCK_STEP = [0]  # the step a rank is in, for its clock


class _ClockSteps(TrainerPlugin):
    @TrainerPlugin.hook
    def before_training_batch(self, batch_count: int, **kw: Any) -> None:
        _CLOCK_STEP[0] = batch_count


def _rank_0_runs_in_epoch_2(step: int, rank: int) -> bool:
    """Whose clock says "checkpoint" at a step: rank 0's in epoch 2 (steps 7 to 12) only, rank 1's in epochs 1 and 3
    only."""
    return (7 <= step <= 12) == (rank == 0)


@pytest.mark.multiprocess
def test_checkpoints_by_time_are_agreed_by_every_rank_inside_epochs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's clock jumps far ahead in some epochs only (rank 0's in epoch 2, rank 1's in epochs 1 and 3), with
    checkpoint_every_n_minutes tiny: the checkpoints follow rank 0's clock alone, taken by both ranks at the next
    agreement point (every step here: flair logs every step of a 6-step epoch), inside epoch 2 and at its end."""
    real = checkpointing.time.monotonic

    def rank_clock() -> float:  # far ahead of any checkpoint, or at 0: long before the run began
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return real() + 1e6 if _rank_0_runs_in_epoch_2(_CLOCK_STEP[0], rank) else 0.0

    monkeypatch.setattr(checkpointing, "time", types.SimpleNamespace(monotonic=rank_clock))  # the workers fork it
    _train(
        tmp_path,
        "ddp",
        checkpoint_every_n_steps=None,
        checkpoint_every_n_minutes=1e-6,
        keep_checkpoints=100,
        extra_plugins=[_ClockSteps()],
    )
    expected, asked = [], False
    for step in range(1, STEPS + 1):
        if asked:  # the agreement of this step takes it; the clock restarts
            expected.append(step)
            asked = False
        else:  # rank 0's clock, read after the step
            asked = _rank_0_runs_in_epoch_2(step, rank=0)
    assert expected == [8, 10, 12]
    taken = [read_progress(folder) for folder in complete_checkpoints(tmp_path)]
    assert [progress.batch_count for progress in taken] == expected, "rank 0's clock, and only it"
    assert [(progress.epoch, progress.step_in_epoch) for progress in taken] == [(1, 2), (1, 4), (2, 0)]
