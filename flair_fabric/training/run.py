"""One rank's training run, read top-down as flair's ``train_custom``: set up, resume, fit (epoch, step, evaluate),
test. Every rank runs it; it owns all state of the run, and the one progress record is what a checkpoint stores.

The loop never asks which strategy it has (see :mod:`flair_fabric.strategies`); "only on global rank 0" is decided
where plugins are attached and where files are written (:mod:`flair_fabric.state`), not in the loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from flair.trainers.plugins import MetricRecord, TrainingInterrupt
from flair.training_utils import identify_dynamic_embeddings, log_line, store_embeddings
from lightning.fabric import Fabric
from lightning.fabric.utilities.throughput import Throughput

from flair_fabric.distributed.fingerprints import check_ranks_agree, model_fingerprint
from flair_fabric.distributed.lockstep import Lockstep
from flair_fabric.distributed.sharded_state import whole_tensor
from flair_fabric.distributed.stalls import Position
from flair_fabric.launch.failures import graceful_interrupts
from flair_fabric.plugins.flair_fixes import EveryRankReduceTransformerVocabPlugin
from flair_fabric.state.progress import RunProgress
from flair_fabric.state.training_state import (
    checkpoint_folder,
    keep_loss_rows_up_to,
    load_training_state,
    save_training_state,
    set_rng_state,
)
from flair_fabric.strategies import training_strategy
from flair_fabric.training.arguments import TrainArguments
from flair_fabric.training.evaluating import evaluate_epoch, test_final_model
from flair_fabric.training.loss import GlobalLoss, LossTracker
from flair_fabric.training.participation import Participation, chunks_for_every_rank, find_stand_in_batch
from flair_fabric.training.progress_bar import EpochProgressBar
from flair_fabric.training.sampling import ShardedBatchSampler, shared_seed, steps_per_epoch, train_loader
from flair_fabric.training.setup import attach_plugins, base_path_ready, log_setup, make_optimizer, training_data

if TYPE_CHECKING:
    from flair_fabric.trainer import FabricTrainer

log = logging.getLogger("flair")


class TrainingRun:
    """flair's training loop on one rank, with Fabric doing devices, wrapping, precision and collectives."""

    def __init__(self, trainer: FabricTrainer, fabric: Fabric, arguments: TrainArguments) -> None:
        self.trainer, self.fabric, self.arguments = trainer, fabric, arguments
        self.flair_arguments = arguments.flair
        self.base_path = arguments.flair.base_path
        self.strategy = training_strategy(fabric.strategy)
        self.position = Position()  # where this rank is, for the error a stalled collective raises
        self.lockstep: Lockstep | None = None  # where the ranks agree on stops (several processes only)
        self.progress = RunProgress(arguments.start_epoch, 0, 0.0, 0, fabric.world_size)
        self.dynamic_embeddings: list[str] | None = None

    # --- the run, top-down --------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train; every rank returns global rank 0's return values."""
        trainer = self.trainer
        with contextlib.ExitStack() as context_stack:
            trainer.context_stack = context_stack
            parameters = self.set_up()
            trainer.dispatch("after_setup", **parameters)
            log_setup(trainer.model, trainer.corpus, self.fabric, self.arguments, self.data, self.plugins)
            rng = self.resume() if self.arguments.resume_folder is not None else None
            self.lockstep = Lockstep(self.fabric) if self.fabric.world_size > 1 else None
            try:
                if rng is not None:
                    set_rng_state(rng)  # last, so the first resumed epoch draws what the interrupted run drew
                with graceful_interrupts(self.on_signal):
                    self.fit()
            finally:
                self.lockstep = None
            self.test()
            trainer.model = self.strategy.hand_back(trainer.model)
        trainer.dispatch("after_training")
        return_values = self.fabric.broadcast(trainer.return_values, src=0)
        trainer.reset_training_attributes()
        return return_values

    def set_up(self) -> dict[str, Any]:
        """flair's set-up, in flair's order: plugins, model card, data, evaluation splits, model and optimizer."""
        fabric, trainer, a = self.fabric, self.trainer, self.flair_arguments
        check_ranks_agree(fabric, trainer.corpus, trainer.model)
        base_path_ready(self.base_path)
        self.plugins = attach_plugins(trainer, fabric, self.arguments)
        training_parameters = self.arguments.training_parameters(self.plugins)
        trainer.model.model_card = trainer._initialize_model_card(**training_parameters)
        self.data = training_data(trainer, trainer.corpus, a)

        # a step that learns nothing on one rank must still take part in the others' collectives
        stand_in = (
            find_stand_in_batch(trainer.model, self.data.train, a.mini_batch_size) if fabric.world_size > 1 else None
        )
        probe = stand_in or [self.data.train[i] for i in range(min(a.mini_batch_size, self.data.size))]
        prepared = self.strategy.set_up(
            fabric,
            trainer.model,
            lambda model: make_optimizer(model, a),
            probe_batch=probe,
            before_wrapping=self._before_wrapping,
            max_grad_norm=a.max_grad_norm,
        )
        self.module, trainer.optimizer, trainer.model = prepared.module, prepared.optimizer, prepared.model
        self.participation = Participation(trainer.model, stand_in) if fabric.world_size > 1 else None
        self.steps_per_epoch = steps_per_epoch(self.data.size, a.mini_batch_size, fabric.world_size)
        self.progress.seed = shared_seed(fabric) if fabric.world_size > 1 else 0
        self.progress.best_epoch_score = 0 if self.data.best_by_dev_score else float("inf")

        if self.progress.epoch >= a.max_epochs:
            log.warning(f"Starting at epoch {self.progress.epoch + 1}/{a.max_epochs}. No training will be done.")
        if self.progress.epoch == 0 and fabric.is_global_zero:
            trainer.check_for_and_delete_previous_best_models(self.base_path)
        return {"dataset_size": self.data.size, **training_parameters}

    def _before_wrapping(self, optimizer: torch.optim.Optimizer) -> None:
        """flair's vocabulary reduction swaps the embedding in ``trainer.optimizer``: on every rank, before wrapping."""
        self.trainer.optimizer = optimizer
        for plugin in self.trainer.plugins:
            if isinstance(plugin, EveryRankReduceTransformerVocabPlugin):
                plugin.reduce_before_wrapping()

    def resume(self) -> dict[str, Any] | None:
        """Load the checkpoint the run continues from; return this rank's random number generator state."""
        folder = self.arguments.resume_folder
        assert folder is not None
        progress, rng = load_training_state(
            self.fabric, folder, self.module, self.trainer.optimizer, self.trainer.plugins
        )
        self.progress.batch_count, self.progress.best_epoch_score = progress.batch_count, progress.best_epoch_score
        self.progress.seed = progress.seed
        if self.fabric.is_global_zero:
            keep_loss_rows_up_to(self.base_path / "loss.tsv", progress.epoch)
        log.info(f"resumed from {folder} after epoch {progress.epoch} ({progress.batch_count} steps)")
        return rng

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
                self.evaluate(epoch, train_loss)
                self.progress.epoch = epoch
                every = self.arguments.checkpoint_every_n_epochs
                if every and epoch % every == 0:
                    self.save_training_state()
            trainer.dispatch("after_training_loop")
            if a.save_final_model:
                trainer.save_model(final_model, checkpoint=a.save_optimizer_state)
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
                trainer.save_model(final_model, checkpoint=a.save_optimizer_state)
            log.info("Done.")
        except Exception:
            trainer.dispatch("_training_exception")
            raise
        finally:
            trainer.dispatch("_training_finally")

    def train_epoch(self, epoch: int) -> tuple[float, str]:
        """Train one epoch; returns the global train loss and the last learning-rate log text."""
        fabric, a, trainer, progress = self.fabric, self.flair_arguments, self.trainer, self.progress
        log_line(log)
        self.position.at("the agreement on stops at the start of the epoch", epoch, 0)
        trainer.dispatch("before_training_epoch", epoch=epoch)
        self.agree_on_stopping()
        trainer.model.model_card["training_parameters"]["epoch"] = epoch  # type: ignore[index]
        lr_info, _ = trainer._get_current_lr_and_momentum(progress.batch_count)

        shuffle_this_epoch = self.data.shuffle and not (not a.shuffle_first_epoch and epoch == 1)
        batch_loader = train_loader(
            self.data.train,
            mini_batch_size=a.mini_batch_size,
            shuffle=shuffle_this_epoch,
            sampler=self.data.sampler,
            epoch=epoch,
            seed=progress.seed,
            rank=fabric.global_rank,
            world_size=fabric.world_size,
        )
        batches = batch_loader.batch_sampler
        largest_batches = batches.largest_batches if isinstance(batches, ShardedBatchSampler) else None
        trainer.model.train()
        epoch_loss = LossTracker(fabric.device)
        epoch_start_time = time.time()
        total = len(batch_loader)
        log_modulo = max(1, int(total / 10))

        bar = EpochProgressBar(self.arguments.progress_bar and fabric.is_global_zero, epoch, total)
        throughput = Throughput(window_size=3)  # Lightning's: samples/s over the last log points, for the bar
        try:
            for batch_no, batch in enumerate(batch_loader):
                progress.batch_count += 1
                self.position.at("forward and backward (the gradient collectives)", epoch, batch_no + 1)
                batch_kw = {
                    "batch_no": batch_no,
                    "batch": batch,
                    "total_number_of_batches": total,
                    "epoch": epoch,
                    "batch_count": progress.batch_count,
                }
                largest_batch = largest_batches[batch_no] if largest_batches is not None else len(batch)
                batch_loss, gradient_norm = self.train_step(batch, batch_kw, largest_batch)
                if batch_loss.data_points > 0:
                    trainer._record(
                        MetricRecord.scalar(("train", "batch_loss"), batch_loss.mean(), progress.batch_count)
                    )
                    if gradient_norm is not None:
                        trainer._record(
                            MetricRecord.scalar(("train", "gradient_norm"), gradient_norm, progress.batch_count)
                        )
                    epoch_loss.add(batch_loss.loss_sum, batch_loss.data_points)

                if (batch_no + 1) % log_modulo == 0:
                    self.position.at("the train loss all-reduce at a log point")
                    so_far = self.global_loss(epoch_loss)
                    elapsed = time.time() - epoch_start_time
                    lr_info, momentum_info = trainer._get_current_lr_and_momentum(progress.batch_count)
                    log.info(
                        f"epoch {epoch}"
                        f" - iter {batch_no + 1}/{total}"
                        f" - loss {so_far.mean:.8f}"
                        f" - time (sec): {elapsed:.2f}"
                        f" - samples/sec: {so_far.data_points / elapsed:.2f}"
                        f"{lr_info}{momentum_info}"
                    )
                    throughput.update(time=elapsed, batches=batch_no + 1, samples=so_far.data_points)
                    recent = throughput.compute().get("device/samples_per_sec", so_far.data_points / elapsed)
                    bar.report(so_far.mean, recent)  # the counts are global already: the rate is the job's
                trainer.dispatch("after_training_batch", **batch_kw)
                bar.step()
        finally:
            bar.close()

        self.position.at("the train loss all-reduce at the end of the epoch")
        train_loss = self.global_loss(epoch_loss).mean
        trainer._record(MetricRecord.scalar(("train", "loss"), train_loss, epoch))
        return train_loss, lr_info

    def train_step(self, batch: list, batch_kw: dict, largest_batch: int) -> tuple[LossTracker, torch.Tensor | None]:
        """Forward, backward (chunked, gradient sync on the last chunk only), clip and step for one mini-batch.

        Every rank runs as many chunks as the largest batch of this step has on any rank, and a chunk that learns
        nothing still takes part in the collectives (:mod:`flair_fabric.training.participation`)."""
        fabric, a, module, trainer = self.fabric, self.flair_arguments, self.module, self.trainer
        optimizer = trainer.optimizer
        assert optimizer is not None
        trainer.model.zero_grad()
        optimizer.zero_grad()
        trainer.dispatch("before_training_batch", **batch_kw)

        batch_loss = LossTracker(fabric.device)
        chunks = chunks_for_every_rank(batch, a.mini_batch_chunk_size, largest_batch)
        for chunk_no, chunk in enumerate(chunks):
            with fabric.no_backward_sync(module, enabled=chunk_no < len(chunks) - 1):
                with fabric.autocast():
                    if self.participation is None:
                        loss, data_points = module.forward_loss(chunk)
                    else:
                        loss, data_points = self.participation.loss(module.forward_loss, chunk)
                batch_loss.add(loss, data_points)
                # flair's losses are sums over data points; DDP averages gradients over ranks, so scaling by the
                # world size gives the gradient of the sum over all ranks' batches.
                trainer._backward(loss * fabric.world_size if fabric.world_size > 1 else loss)
            if self.dynamic_embeddings is None and chunk:
                self.dynamic_embeddings = identify_dynamic_embeddings(batch)
            store_embeddings(chunk, a.embeddings_storage_mode, self.dynamic_embeddings)

        trainer.dispatch("before_training_optimizer_step", **batch_kw)
        gradient_norm = None
        if a.max_grad_norm is not None and not self.strategy.clips_gradients_in_engine:
            norm = fabric.clip_gradients(module, optimizer, max_norm=a.max_grad_norm, error_if_nonfinite=False)
            gradient_norm = whole_tensor(norm) if norm is not None else None
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        scale_before = scaler.get_scale() if scaler is not None else 1.0
        optimizer.step()
        scale_after = scaler.get_scale() if scaler is not None else 1.0
        batch_kw["optimizer_was_run"] = scale_before <= scale_after
        return batch_loss, gradient_norm

    def evaluate(self, epoch: int, train_loss: float) -> None:
        """Score the evaluation splits, choose the best model (identically on every rank) and save it once."""
        evaluate_epoch(self, epoch, train_loss)

    def test(self) -> None:
        """Load the best model on every rank (if there is one) and score the test split, as flair does."""
        test_final_model(self)

    # --- agreement, checkpoints ---------------------------------------------------------------------------------

    def global_loss(self, loss: LossTracker) -> GlobalLoss:
        """The loss all-reduced over the ranks; with several processes the same collective is where the ranks
        agree on stops raised by plugins during the steps since the last one (no extra collective per step)."""
        if self.lockstep is None:
            return loss.global_loss(self.fabric)
        count = torch.tensor(loss.data_points, device=self.fabric.device)
        loss_sum, data_points = self.lockstep.agree(loss.loss_sum, count)
        return GlobalLoss.of(loss_sum, data_points)

    def agree_on_stopping(self) -> None:
        """Every rank raises ``TrainingInterrupt`` here if a plugin on any rank stopped since the last agreement."""
        if self.lockstep is not None:
            self.lockstep.agree()

    def on_signal(self, name: str) -> None:
        """Ctrl-C or SIGTERM during training: with several processes every rank stops at the next agreement point;
        in one process at once. Either way flair's interrupt handling saves the final model."""
        if self.lockstep is None:
            raise KeyboardInterrupt(f"{name} received")
        log.warning(f"{name} received: every process stops at the next agreement point (send it again to stop now)")
        self.lockstep.interrupt(name)

    def save_training_state(self) -> None:
        """Everything a resumed run needs to continue exactly, in base_path/checkpoint."""
        self.position.at("saving the training state", self.progress.epoch, 0)
        self.progress.model_fingerprint = model_fingerprint(self.strategy.caller_model(self.trainer.model))
        folder = checkpoint_folder(self.base_path)
        trainer = self.trainer
        save_training_state(self.fabric, folder, self.module, trainer.optimizer, trainer.plugins, self.progress)
        log.info(f"saved the training state after epoch {self.progress.epoch} to {folder}")
