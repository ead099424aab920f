"""Checkpoints during a run: when to take one (every n epochs, every n steps, every n minutes by global rank 0's
clock, on a preemption signal), what each rank adds to it, how a run continues from one, mid-epoch too, and what a
preempted run does at the end (requeue itself under SLURM, or exit with :data:`REQUEUE_EXIT_CODE`)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flair_fabric.distributed.fingerprints import model_fingerprint
from flair_fabric.launch.ray_train import ray_run
from flair_fabric.plugins.lightning_loggers import LightningLoggerPlugin
from flair_fabric.plugins.ray_report import CHECKPOINT_SAVED
from flair_fabric.state.policy import REQUEUE_EXIT_CODE
from flair_fabric.state.run_state import EpochEnd, ResumePoint
from flair_fabric.state.training_state import (
    checkpoint_name,
    keep_loss_rows_up_to,
    load_training_state,
    plugin_schedulers,
    rng_state,
    save_training_state,
    set_rng_state,
)
from flair_fabric.training.sampling import epoch_order_of_one_process

if TYPE_CHECKING:
    from flair_fabric.distributed.lockstep import Agreed
    from flair_fabric.training.loss import LossTracker
    from flair_fabric.training.run_interface import Run

log = logging.getLogger("flair")


class Preempted(BaseException):
    """The ranks agreed on a preemption signal; the checkpoint is written. Ends the run for a requeue."""


class Checkpointing:
    """A run's checkpoints: triggers, saving with each rank's own state, resuming."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.policy = run.arguments.checkpoints

    # --- triggers -----------------------------------------------------------------------------------------------

    def at_epoch_start(self) -> None:
        """Remember the generators that decide this epoch's order (in one process: flair's loader draws it)."""
        self.run.progress.epoch_start_generators = rng_state()

    def due_after_step(self, batch_count: int) -> bool:
        """A checkpoint by steps: the same decision on every rank, no collective."""
        return bool(self.policy.every_n_steps) and batch_count % self.policy.every_n_steps == 0

    def watch_the_clock(self) -> None:
        """Global rank 0 asks for a checkpoint when its clock says so; the ranks take it at their next agreement."""
        minutes = self.policy.every_n_minutes
        clock = time.monotonic() - self.run.progress.last_checkpoint
        if minutes and self.run.fabric.is_global_zero and clock >= minutes * 60:
            self.run.lockstep.request_checkpoint()

    def after_step(self, agreed: Agreed | None, epoch_loss: LossTracker, last: bool) -> None:
        """Take a checkpoint if one is due after this step: by steps, by rank 0's clock or for a preemption (agreed
        by all ranks); after a preemption, end the run for its requeue. One due after an epoch's last step is taken
        when the epoch is complete (evaluated), as an epoch's checkpoint."""
        progress = self.run.progress
        by_agreement = agreed is not None and agreed.checkpoint
        if not (self.due_after_step(progress.batch_count) or by_agreement):
            self.watch_the_clock()  # (not when a checkpoint is taken now: it restarts the clock)
            return
        preempted = agreed.preempted if agreed is not None else None
        if last:
            progress.epoch_end = EpochEnd.PREEMPTED if preempted else EpochEnd.CHECKPOINT
            progress.preempted_by = preempted
            return
        self.save(epoch_loss)
        if preempted:
            raise Preempted(preempted)

    def due_after_epoch(self, epoch: int) -> bool:
        """A checkpoint by epochs."""
        return bool(self.policy.every_n_epochs) and epoch % self.policy.every_n_epochs == 0

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self, epoch_loss: LossTracker | None) -> None:
        """Write a checkpoint now (every rank): the run's progress, and this rank's generators and part of the
        epoch's loss."""
        run = self.run
        progress = run.progress
        run.position.at("saving the training state", progress.epoch + (1 if progress.step_in_epoch else 0))
        progress.model_fingerprint = model_fingerprint(run.strategy.caller_model(run.trainer.model))
        progress.ray_run = ray_run()  # a restart by Ray continues the checkpoints its run wrote
        rank_state = {
            "tracker_runs": [plugin.tracker_runs() for plugin in _logger_plugins(run.trainer)],
            "epoch_start_rng": progress.epoch_start_generators,
            "loss_sum": float(epoch_loss.loss_sum) if epoch_loss is not None else 0.0,
            "data_points": epoch_loss.data_points if epoch_loss is not None else 0,
        }
        trainer = run.trainer
        name = checkpoint_name(progress.batch_count)
        if run.uploads is not None:  # the previous upload is done; one of the same name is no longer complete
            run.uploads.before_checkpoint(name)
        folder = save_training_state(
            run.fabric,
            run.base_path,
            run.module,
            trainer.optimizer,
            plugin_schedulers(trainer.plugins),
            progress,
            rank_state,
            self.policy.keep,
            model_keys=run.strategy.checkpoint_keys(run.trainer.model),
        )
        if run.uploads is not None:  # this machine's files of it (under FSDP a node's shards may still be unrenamed)
            temporary = folder.parent / f".{name}.tmp"
            run.uploads.checkpoint(folder if folder.is_dir() else temporary if temporary.is_dir() else None, name)
        progress.last_checkpoint = time.monotonic()
        trainer.dispatch(CHECKPOINT_SAVED, folder=folder, epoch=progress.epoch, step=progress.batch_count)
        where = f"step {progress.step_in_epoch} of epoch {progress.epoch + 1}" if progress.step_in_epoch else ""
        log.info(f"saved the training state after {where or f'epoch {progress.epoch}'} to {folder}")

    # --- resuming -----------------------------------------------------------------------------------------------

    def resume(self, folder: Path) -> ResumePoint:
        """Load the checkpoint in ``folder`` into model, optimizer, schedulers and progress."""
        run = self.run
        trainer = run.trainer
        run.strategy.load_checkpoint(run.fabric, folder / "state.ckpt", run.module, trainer.optimizer)
        saved, every_rank, _ = load_training_state(run.fabric, folder, plugin_schedulers(trainer.plugins))
        progress = run.progress
        progress.epoch, progress.batch_count = saved.epoch, saved.batch_count
        progress.best_epoch_score = saved.best_epoch_score
        progress.step_in_epoch, progress.epoch_position = saved.step_in_epoch, saved.epoch_position
        progress.chunk_size = saved.chunk_size
        if run.fabric.is_global_zero:
            keep_loss_rows_up_to(run.base_path / "loss.tsv", saved.epoch, saved.batch_count)
        saved.check_same_grouping(progress.group_by_length_window)
        changed = saved.global_batch_changes(progress.global_batch_size, progress.global_batch_size_given)
        same = saved.world_size == run.fabric.world_size and changed is None
        if changed is not None or saved.world_size != run.fabric.world_size:
            resuming = f"resuming a checkpoint of {saved.world_size} process(es) on {run.fabric.world_size}"
            if changed is None:  # the same global batch: the same steps, global rank 0 draws the orders on
                log.info(f"{resuming}, global_batch_size={progress.global_batch_size}: the run goes on as it was")
            else:
                log.warning(
                    f"{resuming}: {changed} Model, optimizer and schedulers continue from their saved state and the"
                    " interrupted epoch goes on with the data not read yet; a schedule counted in steps counts this"
                    " run's steps, so the rest of the run differs from the one the checkpoint was written in."
                )
        where = (
            f"step {saved.step_in_epoch} of epoch {saved.epoch + 1}" if saved.step_in_epoch else f"epoch {saved.epoch}"
        )
        log.info(f"resumed from {folder} after {where} ({saved.batch_count} steps)")
        for plugin, runs in zip(_logger_plugins(trainer), every_rank[0].get("tracker_runs", []), strict=False):
            plugin.continue_runs(runs)  # (global rank 0's plugins: the loggers are attached there only)
        point = ResumePoint(saved.step_in_epoch, saved.epoch_position, every_rank, same)
        if not point.step_in_epoch:
            self.after_epoch_is_drawn(point)  # the next epoch draws what it drew
        return point

    def continue_epoch(self, point: ResumePoint, epoch_loss: LossTracker, epoch: int) -> list[int] | None:
        """Before the resumed epoch's batches are built: this rank's part of the epoch's loss, its generators, and,
        on another number of processes, the data points of the epoch not read yet (else ``None``)."""
        run = self.run
        rank = run.fabric.global_rank
        if point.same_processes:
            mine = point.every_rank[rank]
            epoch_loss.add(torch.tensor(mine["loss_sum"]), int(mine["data_points"]))
            set_rng_state(mine["epoch_start_rng"])  # the epoch's order is drawn again as it was
            return None
        if rank == 0:  # the epoch's loss so far, all of it counted once
            epoch_loss.add(
                torch.tensor(sum(state["loss_sum"] for state in point.every_rank)),
                sum(int(state["data_points"]) for state in point.every_rank),
            )
        return self._epoch_order_as_written(point, epoch)[point.epoch_position :]

    def after_epoch_is_drawn(self, point: ResumePoint) -> None:
        """The generators where the interrupted run left them: each rank the ones its rank had (global rank 0's draw
        the orders of the epochs to come; a rank the interrupted run did not have keeps its own)."""
        rank = self.run.fabric.global_rank
        if rank < len(point.every_rank):
            set_rng_state(point.every_rank[rank]["rng"])

    def _epoch_order_as_written(self, point: ResumePoint, epoch: int) -> list[int]:
        """The interrupted epoch's order, drawn again on every rank from the generators global rank 0 drew it from."""
        run = self.run
        shuffle = run.shuffles(epoch)
        now = rng_state()
        set_rng_state(point.every_rank[0]["epoch_start_rng"])  # as one process's loader drew it (every start path)
        order = epoch_order_of_one_process(
            run.data.train,
            global_batch_size=run.arguments.global_batch_size,
            shuffle=shuffle,
            sampler=run.data.sampler,
            grouping=run.grouping,
        )
        set_rng_state(now)
        return order

    # --- preemption ---------------------------------------------------------------------------------------------

    def requeue(self, reason: str) -> int:
        """After a preemption: ask SLURM to requeue the job (global rank 0, where ``scontrol`` exists), say how to
        continue, and return the exit code every rank ends with."""
        run = self.run
        job = os.environ.get("SLURM_JOB_ID")
        scontrol = shutil.which("scontrol")
        if run.fabric.is_global_zero:
            if job and scontrol:
                completed = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True)
                outcome = "requeued" if completed.returncode == 0 else f"not requeued ({completed.stderr.strip()})"
                log.warning(f"{reason}: checkpoint written; SLURM job {job} {outcome}; exit code {REQUEUE_EXIT_CODE}")
            else:
                log.warning(
                    f"{reason}: checkpoint written in {run.base_path / 'checkpoints'}; exiting with code"
                    f" {REQUEUE_EXIT_CODE}: start the job again with resume_from='auto' (the default after a torchrun"
                    " restart), e.g. `scontrol requeue $SLURM_JOB_ID` in the job script when it sees this code."
                )
        return REQUEUE_EXIT_CODE


def _logger_plugins(trainer: Any) -> list[LightningLoggerPlugin]:
    """The trainer's ``LightningLoggerPlugin``s, in order (attached on global rank 0 only)."""
    return [plugin for plugin in trainer.plugins if isinstance(plugin, LightningLoggerPlugin)]
