"""The checkpoint arguments as docs/preemption.md documents them, in one process: the defaults, when a step
checkpoint due at an epoch's end is taken, the agreement points (flair's log points and every 20 steps, never
every step), preemption signals by name, ``resume_from="auto"`` without a checkpoint, the gradient scaler."""

from __future__ import annotations

import inspect
import os
import re
import signal
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers.plugins import TrainerPlugin
from lightning.fabric import Fabric

from flair_fabric import FabricTrainer
from flair_fabric.distributed.lockstep import Lockstep
from flair_fabric.state.policy import REQUEUE_EXIT_CODE, CheckpointPolicy
from flair_fabric.state.run_state import RunState
from flair_fabric.state.training_state import (
    checkpoint_to_resume,
    complete_checkpoints,
    find_checkpoint,
    load_training_state,
    read_progress,
    save_training_state,
)
from flair_fabric.training import checkpointing

from ..support import loss_file_column, small_trec, tiny_text_classifier

ONE_PROCESS = {"accelerator": "cpu", "devices": 1, "create_file_logs": False}


# --- defaults -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["train", "fine_tune"])
def test_a_run_with_the_default_arguments_writes_no_checkpoint(tmp_path: Path, method: str) -> None:
    """checkpoint_every_n_epochs=0, checkpoint_every_n_steps=None and checkpoint_every_n_minutes=None by default: a
    run that passes none of them writes no checkpoint at all."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    getattr(FabricTrainer(model, corpus), method)(tmp_path, max_epochs=2, mini_batch_size=8, **ONE_PROCESS)
    assert (tmp_path / "final-model.pt").is_file(), "the run trained"
    assert not (tmp_path / "checkpoints").exists()
    used = model.model_card["training_parameters"]  # what the run trained with (flair's model card)
    triggers = ("checkpoint_every_n_epochs", "checkpoint_every_n_steps", "checkpoint_every_n_minutes")
    assert {name: used[name] for name in triggers} == dict(zip(triggers, (0, None, None), strict=True))
    defaults = inspect.signature(getattr(FabricTrainer, method)).parameters
    assert [defaults[name].default for name in triggers] == [0, None, None], "the documented defaults"


def test_only_the_newest_checkpoint_is_kept_by_default(tmp_path: Path) -> None:
    """keep_checkpoints=1 by default: of the checkpoints after epochs 1, 2 and 3 only the last one is left."""
    corpus = small_trec()
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path, max_epochs=3, mini_batch_size=8, checkpoint_every_n_epochs=1, **ONE_PROCESS
    )
    kept = complete_checkpoints(tmp_path)
    assert len(kept) == 1 and read_progress(kept[0]).epoch == 3
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == [kept[0].name], "nothing else is left"


def test_checkpoints_every_n_epochs_are_taken_after_epochs_n_2n_in_base_path_checkpoints(tmp_path: Path) -> None:
    """README: checkpoint_every_n_epochs=2 over 5 epochs writes a complete checkpoint to base_path/checkpoints/ after
    epochs 2 and 4, and after no other epoch."""
    corpus = small_trec()
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path, max_epochs=5, mini_batch_size=16, checkpoint_every_n_epochs=2, keep_checkpoints=10, **ONE_PROCESS
    )
    saved = complete_checkpoints(tmp_path)
    assert [(read_progress(path).epoch, read_progress(path).step_in_epoch) for path in saved] == [(2, 0), (4, 0)]
    assert {path.parent for path in saved} == {tmp_path / "checkpoints"}
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == sorted(path.name for path in saved)


# --- a step checkpoint at an epoch's last step --------------------------------------------------------------------


STEP_CHECKPOINTS = {  # 6 steps per epoch: step k of the run is step k - 6 * epoch of its epoch
    3: (2, {3: (0, 3), 6: (1, 0), 9: (1, 3), 12: (2, 0)}),
    4: (3, {4: (0, 4), 8: (1, 2), 12: (2, 0), 16: (2, 4)}),
}


@pytest.mark.parametrize("every", sorted(STEP_CHECKPOINTS), ids=lambda n: f"every-{n}-steps")
def test_a_step_checkpoint_due_at_an_epochs_last_step_is_taken_after_its_evaluation(tmp_path: Path, every: int) -> None:
    """48 questions in batches of 8 (6 steps per epoch), a checkpoint after every optimizer step k divisible by n:
    with n=3, steps 3 and 9 are saved inside their epochs; steps 6 and 12 end their epochs and are saved as complete
    epochs, after the evaluation (they hold the epoch's dev score as the best so far). With n=4 over 3 epochs the
    run's steps 4, 8, 12 and 16 (steps 4 and 2 of epoch 2, the end of epoch 2, step 4 of epoch 3)."""
    epochs, expected = STEP_CHECKPOINTS[every]
    corpus = small_trec()
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=epochs,
        mini_batch_size=8,
        checkpoint_every_n_steps=every,
        keep_checkpoints=10,
        **ONE_PROCESS,
    )
    saved = {path.name: read_progress(path) for path in complete_checkpoints(tmp_path)}
    assert sorted(saved) == [f"step-{step:09d}" for step in expected]
    inside = {int(name.split("-")[1]): (p.epoch, p.step_in_epoch) for name, p in saved.items()}
    assert inside == expected
    dev_scores = loss_file_column(tmp_path, "DEV_F1")  # the main metric: micro F1
    for step, (epoch, step_in_epoch) in expected.items():
        if step_in_epoch == 0:  # an epoch's end: after its evaluation, the best dev score so far
            best = saved[f"step-{step:09d}"].best_epoch_score
            assert best == pytest.approx(max(dev_scores[:epoch]), abs=1e-4), step


# --- agreement points ---------------------------------------------------------------------------------------------

STEPS = 250  # batches of 1: flair's log points every 25 steps, further apart than the agreements every 20
AGREEMENTS = sorted(set(range(20, STEPS + 1, 20)) | set(range(25, STEPS + 1, 25)))


class _Steps(TrainerPlugin):
    """The step the run is in (1-based), for code that runs between a step's start and its end."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    @TrainerPlugin.hook
    def before_training_batch(self, batch_no: int, **kw: Any) -> None:
        self.step = batch_no + 1


def test_the_ranks_agree_at_log_points_and_every_20_steps_never_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch of 250 steps: the run agrees (one small all-reduce with several processes) at flair's log points and
    every 20 steps, and once at the epoch's end, nowhere else; a checkpoint asked for by rank 0's clock (due at
    every step here) is taken at each agreement point, the first after 20 steps."""
    steps = _Steps()
    agreed_at: list[int] = []
    agree = Lockstep.agree

    def counted(self: Lockstep, *values: Any) -> Any:
        agreed_at.append(steps.step)
        return agree(self, *values)

    monkeypatch.setattr(Lockstep, "agree", counted)
    corpus = small_trec(train_size=STEPS)
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=1,
        mini_batch_size=1,
        checkpoint_every_n_minutes=1e-9,
        keep_checkpoints=1000,
        plugins=[steps],
        **ONE_PROCESS,
    )
    assert agreed_at == [*AGREEMENTS, STEPS]  # the last: the epoch's train loss
    taken = [read_progress(path) for path in complete_checkpoints(tmp_path)]
    assert [progress.batch_count for progress in taken] == AGREEMENTS
    assert taken[0].step_in_epoch == 20


def test_checkpoints_by_time_come_every_n_minutes_of_rank_0s_clock_at_the_next_agreement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that advances one minute per step and checkpoint_every_n_minutes=45: the clock asks after 45 minutes
    since the last checkpoint (the run's start, then each checkpoint), and the checkpoint is taken at the next
    agreement point (flair's log points every 25 steps, and every 20 steps)."""
    steps = _Steps()
    started: list[float] = []

    def one_minute_per_step() -> float:
        started[:] = started or [checkpointing_time.monotonic()]  # (the run's start is read from the real clock)
        return started[0] + 60.0 * steps.step

    checkpointing_time = checkpointing.time
    monkeypatch.setattr(checkpointing, "time", types.SimpleNamespace(monotonic=one_minute_per_step))
    corpus = small_trec(train_size=STEPS)
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=1,
        mini_batch_size=1,
        checkpoint_every_n_minutes=45,
        keep_checkpoints=1000,
        plugins=[steps],
        **ONE_PROCESS,
    )
    expected, last, asked = [], 0, False
    for step in range(1, STEPS + 1):
        if asked and step in AGREEMENTS:  # (step 250, the epoch's last, is one)
            expected.append(step)
            last, asked = step, False
        asked = asked or step - last >= 45
    assert expected == [50, 100, 150, 200, 250]
    assert [read_progress(path).batch_count for path in complete_checkpoints(tmp_path)] == expected


@pytest.mark.parametrize(
    ("requeue_signal", "sent"),
    [(None, signal.SIGUSR1), ("SIGTERM", signal.SIGTERM), ("USR1", signal.SIGUSR1)],
    ids=["default", "SIGTERM", "USR1"],
)
def test_a_preemption_signal_is_taken_within_20_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requeue_signal: str | None, sent: signal.Signals
) -> None:
    """The preemption signal (SIGUSR1 by default, or one given by name) arrives at step 1; flair's first log point
    is at step 25, the run stops at the agreement after step 20: one checkpoint there, exit code 75."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    class SignalAtStepOne(TrainerPlugin):
        @TrainerPlugin.hook
        def after_training_batch(self, batch_no: int, **kw: Any) -> None:
            if batch_no == 0:
                os.kill(os.getpid(), sent)

    corpus = small_trec(train_size=STEPS)
    chosen = {} if requeue_signal is None else {"requeue_signal": requeue_signal}
    with pytest.raises(SystemExit) as exited:
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(
            tmp_path, max_epochs=1, mini_batch_size=1, plugins=[SignalAtStepOne()], **chosen, **ONE_PROCESS
        )
    assert exited.value.code == REQUEUE_EXIT_CODE
    taken = complete_checkpoints(tmp_path)
    assert [(read_progress(path).epoch, read_progress(path).step_in_epoch) for path in taken] == [(0, 20)]
    assert not (tmp_path / "final-model.pt").exists(), "a preempted run ends for its requeue"


def test_requeue_signal_none_leaves_sigusr1_to_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """requeue_signal=None: no preemption signal. SIGUSR1 at step 1 reaches the program's own handler, the run
    trains to its end (final-model.pt), writes no checkpoint and does not exit."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    received: list[int] = []

    class SignalAtStepOne(TrainerPlugin):
        @TrainerPlugin.hook
        def after_training_batch(self, batch_no: int, **kw: Any) -> None:
            if batch_no == 0:
                os.kill(os.getpid(), signal.SIGUSR1)

    corpus = small_trec()
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))
    try:
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(
            tmp_path, max_epochs=1, mini_batch_size=8, requeue_signal=None, plugins=[SignalAtStepOne()], **ONE_PROCESS
        )
    except SystemExit as exited:
        pytest.fail(f"requeue_signal=None took SIGUSR1 as a preemption (exit code {exited.code})")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [signal.SIGUSR1], "the program's own SIGUSR1 handler ran once"
    assert (tmp_path / "final-model.pt").is_file()
    assert complete_checkpoints(tmp_path) == [] and not (tmp_path / "checkpoints").exists()


# --- requeue_signal -----------------------------------------------------------------------------------------------


def _requeue_signal(value: Any) -> signal.Signals | None:
    try:
        return CheckpointPolicy.checked(requeue_signal=value).requeue_signal
    except ValueError as error:
        pytest.fail(f"requeue_signal={value!r} was refused: {error}")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("SIGTERM", signal.SIGTERM),
        ("TERM", signal.SIGTERM),
        ("SIGUSR1", signal.SIGUSR1),
        ("USR2", signal.SIGUSR2),
        (signal.SIGUSR1, signal.SIGUSR1),
        (int(signal.SIGTERM), signal.SIGTERM),
        (None, None),
    ],
)
def test_requeue_signal_takes_a_signal_its_name_with_or_without_sig_or_none(
    value: Any, expected: signal.Signals | None
) -> None:
    assert _requeue_signal(value) is expected


def test_requeue_signal_is_sigusr1_unless_given() -> None:
    """The documented default, for the policy and for the trainer's argument."""
    assert CheckpointPolicy.checked().requeue_signal is signal.SIGUSR1
    import inspect

    default = inspect.signature(FabricTrainer.train_custom).parameters["requeue_signal"].default
    assert _requeue_signal(default) is signal.SIGUSR1


# --- resume_from="auto" without a checkpoint ----------------------------------------------------------------------


AUTO_REFUSED = r"is not a flair-fabric checkpoint|nothing in it was run"


@pytest.mark.parametrize("earlier_run", [False, True], ids=["empty-folder", "run-without-checkpoints"])
def test_resume_auto_without_a_checkpoint_starts_afresh(tmp_path: Path, earlier_run: bool) -> None:
    """``resume_from="auto"`` in a folder with no complete checkpoint (empty, or a run that wrote none, with a
    broken write of one left behind) trains from the first epoch instead of failing."""
    corpus = small_trec()
    if earlier_run:
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path, max_epochs=1, **ONE_PROCESS)
        (tmp_path / "checkpoints" / ".step-000000003.tmp").mkdir(parents=True)
        for written in ("final-model.pt", "loss.tsv"):  # (flair appends a second table to an existing loss.tsv)
            (tmp_path / written).unlink()
    model = tiny_text_classifier(corpus)
    try:
        assert find_checkpoint("auto", tmp_path) is None, "no checkpoint to resume"
        assert checkpoint_to_resume(model, tmp_path, 0, "auto") == (None, 0), "a fresh start, from epoch 0"
        FabricTrainer(model, corpus).train(tmp_path, max_epochs=2, mini_batch_size=8, resume_from="auto", **ONE_PROCESS)
    except ValueError as error:
        if not re.search(AUTO_REFUSED, str(error)):
            raise
        pytest.fail(f'resume_from="auto" without a checkpoint was refused: {error}')
    assert (tmp_path / "final-model.pt").is_file()
    assert [line.split("\t")[0] for line in (tmp_path / "loss.tsv").read_text().splitlines()] == ["EPOCH", "1", "2"]


# --- the gradient scaler ------------------------------------------------------------------------------------------


def _fabric_with_scaler() -> tuple[Fabric, torch.amp.GradScaler]:
    fabric = Fabric(accelerator="cpu", devices=1)
    scaler = torch.amp.GradScaler("cpu")
    fabric.strategy.precision.scaler = scaler  # as under 16-mixed (CPU runs have none)
    return fabric, scaler


def test_a_checkpoint_holds_the_gradient_scaler_and_a_resume_restores_it(tmp_path: Path) -> None:
    """The scaler's scale and growth tracker (where a 16-mixed run's dynamic loss scaling stands) come back."""
    fabric, scaler = _fabric_with_scaler()
    scaler.load_state_dict(
        {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 17}
    )
    model = tiny_text_classifier(small_trec())
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    save_training_state(fabric, tmp_path, module, optimizer, {}, RunState(1, 6, 0.5, 1, {}), {}, keep=1)

    fabric, fresh = _fabric_with_scaler()
    assert fresh.get_scale() == 65536.0
    model = tiny_text_classifier(small_trec())
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    load_training_state(fabric, complete_checkpoints(tmp_path)[0], {})
    assert fresh.get_scale() == 1024.0
    assert fresh.state_dict()["_growth_tracker"] == 17


def test_an_older_checkpoint_written_inside_an_epoch_of_several_ranks_is_refused() -> None:
    """Ranks of older versions drew their own data order from a stored seed; such an epoch cannot be continued in
    the order of the job (drawn by rank 0 as one process draws it): refused, naming what to do. At an epoch's end,
    or from one process (whose order was flair's loader's), it resumes."""
    written = {"epoch": 1, "batch_count": 9, "best_epoch_score": 0.5, "world_size": 2, "seed": 1234}
    with pytest.raises(ValueError, match="older flair-fabric whose ranks drew their own data order"):
        RunState.from_stored({**written, "step_in_epoch": 3})
    assert RunState.from_stored({**written, "step_in_epoch": 0}).batch_count == 9
    assert RunState.from_stored({**written, "world_size": 1, "seed": 0, "step_in_epoch": 3}).step_in_epoch == 3
    assert "seed" not in RunState.from_stored(written).stored()
