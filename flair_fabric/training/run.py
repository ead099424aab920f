"""One rank's training run, read top-down as flair's ``train_custom``: set up, resume, fit (epoch, step, evaluate),
test. Every rank runs it; it owns all state of the run, and the one progress record is what a checkpoint stores.

The loop never asks which strategy it has (see :mod:`flair_fabric.strategies`); "only on global rank 0" is decided
where plugins are attached and where files are written (:mod:`flair_fabric.state`), not in the loop.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import MetricRecord, TrainingInterrupt
from flair.training_utils import log_line
from lightning.fabric import Fabric

from flair_fabric.distributed.fingerprints import check_ranks_agree, corpus_fingerprint, model_fingerprint
from flair_fabric.distributed.lockstep import Agreed, Lockstep
from flair_fabric.distributed.stalls import Position
from flair_fabric.launch.failures import graceful_interrupts
from flair_fabric.plugins.flair_fixes import EveryRankReduceTransformerVocabPlugin
from flair_fabric.state.adapter_files import delete_previous_best_models
from flair_fabric.state.adapters import has_adapters, weights_from_merged
from flair_fabric.state.model_files import load_from_global_zero, save_on_global_zero
from flair_fabric.state.run_state import EpochEnd, RunState
from flair_fabric.state.uploads import Uploads, all_uploaded
from flair_fabric.strategies import keeps_whole_model, no_pass_synchronises, training_strategy
from flair_fabric.strategies.base import SetUp
from flair_fabric.training.arguments import TrainArguments
from flair_fabric.training.checkpointing import Checkpointing, Preempted
from flair_fabric.training.continuing import checkpoint_to_read_here
from flair_fabric.training.evaluating import (
    evaluate_epoch,
    evaluate_inside_epoch,
    evaluation_due,
    steps_between_evaluations,
    test_final_model,
)
from flair_fabric.training.grouping import Grouping
from flair_fabric.training.interface import FlairTrainer
from flair_fabric.training.lengths import data_point_lengths, length_counter
from flair_fabric.training.log_points import EpochLog
from flair_fabric.training.loss import GlobalLoss, LossTracker
from flair_fabric.training.out_of_memory import ChunksOnOutOfMemory
from flair_fabric.training.participation import Participation, stand_in_and_probe
from flair_fabric.training.progress_bar import EpochProgressBar
from flair_fabric.training.sampling import EpochBatches, epoch_batches, steps_per_epoch
from flair_fabric.training.setup import (
    attach_plugins,
    base_path_ready,
    clear_stored_embeddings,
    log_setup,
    make_optimizer,
    training_data,
)
from flair_fabric.training.step import train_step

log = logging.getLogger("flair")

AGREE_EVERY = 20
"""Steps between the ranks' agreements inside an epoch besides flair's log points: a checkpoint asked for by time or
a preemption signal is taken within seconds, at the cost of one small all-reduce every 20 steps."""


class TrainingRun:
    """flair's training loop on one rank, with Fabric doing devices, wrapping, precision and collectives."""

    def __init__(
        self, trainer: FlairTrainer, fabric: Fabric, arguments: TrainArguments, position: Position | None = None
    ) -> None:
        self.trainer, self.fabric, self.arguments = trainer, fabric, arguments
        self.flair_arguments = arguments.flair
        self.base_path = arguments.flair.base_path
        self.strategy = training_strategy(fabric.strategy)
        self.position = position or Position()  # where this rank is, for the error a stalled collective raises
        self.progress = RunState(  # the one record of the run
            arguments.start_epoch,
            0,
            0.0,
            fabric.world_size,
            global_batch_size=arguments.global_batch_size,
            global_batch_size_given=arguments.global_batch_size_given,
            group_by_length_window=arguments.group_by_length_window if arguments.group_by_length else 0,
        )
        self.lockstep = Lockstep(fabric, self.progress.flags)  # where the ranks agree (no collective in one process)
        self.checkpointing = Checkpointing(self)
        self.dynamic_embeddings: list[str] | None = None
        self.lengths: list[int] | None = None  # per data point, when each step is dealt to the ranks by length
        self.grouping: Grouping | None = None  # group_by_length
        self.uploads = machine_uploads(fabric, arguments)  # base_path in a store: this machine's uploads, if it has any

    # --- the run, top-down --------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train; every rank returns global rank 0's return values."""
        trainer = self.trainer
        with contextlib.ExitStack() as context_stack:
            trainer.context_stack = context_stack
            if self.arguments.launch.precision != "32-true":  # embeddings stored in another dtype, before and after
                clear_stored_embeddings(trainer.corpus)
                context_stack.callback(clear_stored_embeddings, trainer.corpus)
            parameters = self.set_up()
            if self.chunks_on_out_of_memory is not None:  # its hooks leave the parameters when the run ends
                context_stack.callback(self.chunks_on_out_of_memory.close)
            trainer.dispatch("after_setup", **parameters)
            log_setup(
                trainer.model,
                trainer.corpus,
                self.fabric,
                self.arguments,
                self.data,
                self.plugins,
                dealt_by_length=self.lengths is not None,
            )
            resume_folder = checkpoint_to_read_here(self.fabric, self.arguments, self.strategy)
            if resume_folder is not None:
                self.progress.resume = self.checkpointing.resume(resume_folder)
            preemption = self.arguments.checkpoints.requeue_signal
            with all_uploaded(self.uploads):  # base_path in a store: the job ends when its files are there
                with graceful_interrupts(self.on_signal, self.lockstep.preempt, preemption):
                    self.fit()
                test_final_model(self)
            trainer.model = self.strategy.hand_back(trainer.model)
        trainer.dispatch("after_training")
        return_values = self.fabric.broadcast(trainer.return_values, src=0)
        trainer.reset_training_attributes()
        return return_values

    def set_up(self) -> dict[str, Any]:
        """flair's set-up, in flair's order: plugins, model card, data, evaluation splits, model and optimizer."""
        fabric, trainer, a = self.fabric, self.trainer, self.flair_arguments
        check_ranks_agree(
            fabric, {"corpus": corpus_fingerprint(trainer.corpus), "model": model_fingerprint(trainer.model)}
        )
        base_path_ready(self.base_path)
        self.plugins = attach_plugins(trainer, fabric, self.arguments, lambda: self.progress.batch_count)
        training_parameters = self.arguments.training_parameters(self.plugins)
        trainer.model.model_card = trainer._initialize_model_card(**training_parameters)
        self.data = training_data(trainer, trainer.corpus, a)
        # sharded strategies keep strided shards: FSDP's collectives mismatched with batches of different sizes
        balanced = fabric.world_size > 1 and self.arguments.balance_batches and keeps_whole_model(fabric.strategy)
        grouped = self.arguments.group_by_length
        lengths = data_point_lengths(self.data.train, trainer.model) if balanced or grouped else None
        self.lengths = lengths if balanced else None
        self.length_of = length_counter(trainer.model)  # for the tokens counted at log points
        self.grouping = Grouping(lengths, self.arguments.group_by_length_window) if lengths and grouped else None

        # a step that learns nothing must take part in the others' collectives (unless no pass synchronises)
        auto_chunks, several = self.arguments.chunks_on_out_of_memory, fabric.world_size > 1
        stand_in, probe = stand_in_and_probe(
            trainer.model, self.data.train, a.mini_batch_size, a.mini_batch_chunk_size, several, auto_chunks
        )
        if auto_chunks:  # no DDP pass synchronises: no search for parameters without a gradient, no buffer broadcast
            no_pass_synchronises(fabric.strategy)
        prepared = self.strategy.set_up(
            SetUp(
                fabric,
                trainer.model,
                lambda model: make_optimizer(model, a),
                probe,
                self._before_wrapping,
                a.max_grad_norm,
            )
        )
        self.module, trainer.optimizer, trainer.model = prepared.module, prepared.optimizer, prepared.model
        self.participation = Participation(trainer.model, stand_in) if several and not auto_chunks else None
        self.chunks_on_out_of_memory = ChunksOnOutOfMemory.if_asked(fabric, self.progress, self.module, self.arguments)
        self.steps_per_epoch = steps_per_epoch(self.data.size, self.arguments.global_batch_size)
        self.evaluation_interval = steps_between_evaluations(self.arguments.val_check_interval, self.steps_per_epoch)
        self.progress.best_epoch_score = 0 if self.data.best_by_dev_score else float("inf")

        if self.progress.epoch >= a.max_epochs:
            log.warning(f"Starting at epoch {self.progress.epoch + 1}/{a.max_epochs}. No training will be done.")
        if self.progress.epoch == 0 and fabric.is_global_zero:
            delete_previous_best_models(self.base_path, trainer.check_for_and_delete_previous_best_models)
        return {"dataset_size": self.data.size, **training_parameters}

    def _before_wrapping(self, optimizer: torch.optim.Optimizer) -> None:
        """flair's vocabulary reduction swaps the embedding in ``trainer.optimizer``: on every rank, before wrapping."""
        self.trainer.optimizer = optimizer
        for plugin in self.trainer.plugins:
            if isinstance(plugin, EveryRankReduceTransformerVocabPlugin):
                plugin.reduce_before_wrapping()

    def fit(self) -> None:
        """flair's epoch loop with its interrupt handling; final-model.pt is written once."""
        a, trainer = self.flair_arguments, self.trainer
        final_model = self.base_path / "final-model.pt"
        try:
            for epoch in range(self.progress.epoch + 1, a.max_epochs + 1):
                train_loss, lr_info = self.train_epoch(epoch)
                log_line(log)
                log.info(f"EPOCH {epoch} done: loss {train_loss:.4f}{lr_info}")
                trainer.dispatch("after_training_epoch", epoch=epoch)
                self.agree_on_stopping()
                if self.evaluation_interval is not None:  # the row's learning rate now, as inside the epoch
                    trainer._get_current_lr_and_momentum(self.progress.batch_count)
                evaluate_epoch(self, epoch, train_loss, self.metric_step(epoch))
                self.progress.epoch = epoch
                epoch_end, self.progress.epoch_end = self.progress.epoch_end, EpochEnd.NOTHING
                if self.checkpointing.due_after_epoch(epoch) or epoch_end is not EpochEnd.NOTHING:
                    self.checkpointing.save(None)
                if epoch_end is EpochEnd.PREEMPTED:  # a preemption agreed at the epoch's last step
                    raise Preempted(self.progress.preempted_by or "preempted")
            trainer.dispatch("after_training_loop")
            if a.save_final_model:
                self.save_model(final_model, checkpoint=a.save_optimizer_state)
        except (KeyboardInterrupt, TrainingInterrupt) as stop:
            log_line(log)
            if isinstance(stop, TrainingInterrupt):
                log.info(str(stop))
                log_line(log)
            else:
                if str(stop):  # a signal agreed by the ranks (a plain Ctrl-C in one process has no message)
                    log.info(str(stop))
                log.info("Exiting from training early.")
            trainer.dispatch("training_interrupt")
            if a.save_final_model:
                log.info("Saving model ...")
                self.save_model(final_model, checkpoint=a.save_optimizer_state)
            log.info("Done.")
        except Exception:
            trainer.dispatch("_training_exception")
            raise
        finally:
            trainer.dispatch("_training_finally")

    def train_epoch(self, epoch: int) -> tuple[float, str]:
        """Train one epoch (or, after a mid-epoch resume, the rest of it); returns the global train loss and the
        last learning-rate log text."""
        fabric, trainer, progress = self.fabric, self.trainer, self.progress
        log_line(log)
        self.position.at("the agreement on stops at the start of the epoch", epoch, 0)
        trainer.dispatch("before_training_epoch", epoch=epoch)
        self.agree_on_stopping()
        trainer.model.model_card["training_parameters"]["epoch"] = epoch  # type: ignore[index]
        lr_info, _ = trainer._get_current_lr_and_momentum(progress.batch_count)
        epoch_loss = LossTracker(fabric.device)
        plan = self._batches_of(epoch, epoch_loss)
        trainer.model.train()
        log_modulo = max(1, int(plan.total / 10))
        epoch_log = EpochLog(self, epoch, plan.total, plan.first_step, epoch_loss)

        bar = EpochProgressBar(
            self.arguments.progress_bar and fabric.is_global_zero, epoch, plan.total, plan.first_step
        )
        try:
            for batch_no, batch in enumerate(plan.batches, start=plan.first_step):
                progress.batch_count += 1
                progress.step_in_epoch = batch_no + 1
                progress.epoch_position += plan.step_sizes[batch_no] if plan.step_sizes else len(batch)
                self.position.at("forward and backward (the gradient collectives)", epoch, batch_no + 1)
                batch_kw = {
                    "batch_no": batch_no,
                    "batch": batch,
                    "total_number_of_batches": plan.total,
                    "epoch": epoch,
                    "batch_count": progress.batch_count,
                }
                largest = plan.largest_batches[batch_no] if plan.largest_batches is not None else len(batch)
                batch_loss, gradient_norm = train_step(self, batch, batch_kw, largest)
                step = progress.batch_count
                if batch_loss.data_points > 0:
                    trainer._record(MetricRecord.scalar(("train", "batch_loss"), batch_loss.mean(), step))
                    if gradient_norm is not None:
                        trainer._record(MetricRecord.scalar(("train", "gradient_norm"), gradient_norm, step))
                    epoch_loss.add(batch_loss.loss_sum, batch_loss.data_points)
                epoch_log.after_step(batch)

                agreed: Agreed | None = None
                if (batch_no + 1) % log_modulo == 0:
                    self.position.at("the train loss all-reduce at a log point")
                    agreed, lr_info = epoch_log.log_point(batch_no, epoch_loss, bar)
                elif (batch_no + 1) % AGREE_EVERY == 0:  # checkpoints by time and preemption, within seconds
                    self.position.at("the agreement on stops and checkpoints")
                    agreed = self.lockstep.agree()
                trainer.dispatch("after_training_batch", **batch_kw)
                bar.step()
                if evaluation_due(self.evaluation_interval, batch_no + 1, plan.total):
                    agreed = Agreed.either(agreed, evaluate_inside_epoch(self, epoch, epoch_loss))
                self.checkpointing.after_step(agreed, epoch_loss, last=batch_no + 1 == plan.total)
        finally:
            bar.close()

        self.position.at("the train loss all-reduce at the end of the epoch")
        train_loss = self.global_loss(epoch_loss)[0].mean
        trainer._record(MetricRecord.scalar(("train", "loss"), train_loss, self.metric_step(epoch)))
        progress.step_in_epoch = progress.epoch_position = 0
        progress.chunk_size = None  # a chunk size an out-of-memory step needed holds for the rest of its epoch
        return train_loss, lr_info

    def metric_step(self, epoch: int) -> int:
        """The step losses and evaluations are recorded at: the epoch, or the step with ``val_check_interval``."""
        return epoch if self.evaluation_interval is None else self.progress.batch_count

    def _batches_of(self, epoch: int, epoch_loss: LossTracker) -> EpochBatches:
        """This rank's batches of ``epoch``; after a mid-epoch resume only those not trained yet, never read."""
        fabric, a, progress = self.fabric, self.flair_arguments, self.progress
        point, progress.resume = progress.resume, None
        resumed = point if point is not None and point.step_in_epoch > 0 else None
        remaining = self.checkpointing.continue_epoch(resumed, epoch_loss, epoch) if resumed else None
        self.checkpointing.at_epoch_start()
        plan = epoch_batches(
            self.data.train,
            fabric,
            global_batch_size=self.arguments.global_batch_size,
            shuffle=self.shuffles(epoch),
            sampler=self.data.sampler,
            first_step=resumed.step_in_epoch if resumed else 0,
            remaining_order=remaining,
            lengths=self.lengths,
            chunk_size=a.mini_batch_chunk_size,
            grouping=self.grouping,
        )
        if resumed:  # the order is drawn: the generators where the interrupted run left them
            self.checkpointing.after_epoch_is_drawn(resumed)
        if resumed and not resumed.same_processes:  # the rest of the epoch, numbered as in the epoch it began
            progress.epoch_position, progress.step_in_epoch = resumed.epoch_position, resumed.step_in_epoch
        return plan

    def shuffles(self, epoch: int) -> bool:
        """Whether ``epoch`` is shuffled: flair's ``shuffle``, not in a first epoch if ``shuffle_first_epoch=False``."""
        return self.data.shuffle and not (not self.flair_arguments.shuffle_first_epoch and epoch == 1)

    def save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        """Write the model being trained once, from global rank 0 (a sharded model is gathered first); every rank."""
        self.position.at(f"saving {Path(model_file).name}")
        weights = self.strategy.whole_weights(self.trainer.model)
        save_on_global_zero(self.fabric, self.trainer.model, model_file, checkpoint, weights, self.arguments)
        if self.uploads is not None:
            self.uploads.run_files()

    def load_model(self, model_file: str | Path) -> bool:
        """Load ``model_file`` (read on global rank 0) into the model on every rank; whether the file existed."""
        model = self.trainer.model
        current = self.strategy.whole_weights(model) if has_adapters(model) else None  # a collective when sharded

        def load(state: dict[str, torch.Tensor] | None) -> None:
            if state is not None and has_adapters(model):  # the file holds the adapters merged (docs/peft.md)
                state = weights_from_merged(model, state, current if current is not None else model.state_dict())
            self.strategy.load_whole_weights(self.fabric, model, state)

        return load_from_global_zero(self.fabric, model, model_file, load)

    def global_loss(self, loss: LossTracker, *also: float) -> tuple[GlobalLoss, Agreed]:
        """The loss (and the numbers ``also``, after it in the agreed values) all-reduced over the ranks; the same
        collective is where the ranks agree on stops, checkpoints and preemptions held since the last one (no extra
        collective per step)."""
        agreed = self.lockstep.agree(loss.loss_sum, float(loss.data_points), *also)
        loss_sum, data_points = agreed.values[:2]
        return GlobalLoss.of(loss_sum, data_points), agreed

    def agree_on_stopping(self) -> None:
        """Every rank raises ``TrainingInterrupt`` here if a plugin on any rank stopped since the last agreement."""
        if self.fabric.world_size > 1:
            self.lockstep.agree()

    def on_signal(self, name: str) -> None:
        """Ctrl-C or SIGTERM during training: with several processes every rank stops at the next agreement point;
        in one process at once. Either way flair's interrupt handling saves the final model."""
        if self.fabric.world_size == 1:
            raise KeyboardInterrupt(f"{name} received")
        log.warning(f"{name} received: every process stops at the next agreement point (send it again to stop now)")
        self.lockstep.interrupt(name)


def machine_uploads(fabric: Fabric, arguments: TrainArguments) -> Uploads | None:
    """With ``base_path`` in a store: the uploads of this machine (its local rank 0; ``None`` elsewhere), and global
    rank 0's staging folder made to hold the store's run files (``loss.tsv``, ...; a resumed run's all) to continue."""
    if arguments.store is None or fabric.local_rank != 0:
        return None
    if fabric.is_global_zero:
        arguments.store.download_run_files(resuming=arguments.resume_folder is not None)
    return Uploads(
        arguments.store,
        node_rank=fabric.node_rank,
        num_nodes=int(getattr(fabric.strategy, "num_nodes", 1)),
        is_global_zero=fabric.is_global_zero,
        keep=arguments.checkpoints.keep,
        timeout=arguments.collective_timeout.total_seconds(),
    )
