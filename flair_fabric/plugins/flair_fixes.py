"""flair plugins under several processes: loggers on global rank 0 only, functional plugins on every rank.

flair's built-in logger plugins do their writing in the constructor too (``LogFilePlugin`` adds a file handler to
the ``flair`` logger, ``LossFilePlugin`` creates ``loss.tsv``), so refusing to *attach* them on other ranks, which
is all flair's ``attach_to_all_processes`` does, is not enough: here they are only *made* on global rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from flair.optim import LinearSchedulerWithWarmup
from flair.trainers.plugins import (
    AnnealingPlugin,
    CheckpointPlugin,
    DeepNCMPlugin,
    LinearSchedulerPlugin,
    LogFilePlugin,
    LossFilePlugin,
    ReduceTransformerVocabPlugin,
    TensorboardLogger,
    TrainerPlugin,
    WeightExtractorPlugin,
)
from lightning.fabric import Fabric

from flair_fabric.plugins.step_loss_file import StepLossFilePlugin

log = logging.getLogger("flair")


class ShardedLinearSchedulerPlugin(LinearSchedulerPlugin):
    """flair's linear warm-up/decay scheduler, sized to the optimizer steps each rank really runs.

    flair divides the single-process step count by the world size, which ignores how the split is cut into per-rank
    batches; this plugin reads the exact count from the trainer (``trainer.steps_per_epoch``).
    """

    @TrainerPlugin.hook
    def after_setup(self, max_epochs: int, epoch: int = 0, **kwargs: Any) -> None:
        """Create the scheduler for ``steps_per_epoch * max_epochs`` steps."""
        num_train_steps = self.trainer.steps_per_epoch * max_epochs
        num_warmup_steps = int(num_train_steps * self.warmup_fraction)
        self.scheduler = LinearSchedulerWithWarmup(
            num_train_steps=num_train_steps, num_warmup_steps=num_warmup_steps, optimizer=self.trainer.optimizer
        )
        self.store_learning_rate()


class BroadcastRestartAnnealingPlugin(AnnealingPlugin):
    """flair's anneal-on-plateau whose ``anneal_with_restarts`` takes the best model from rank 0.

    flair's plugin reloads ``best-model.pt`` from disk on every rank; on a node that does not share rank 0's disk the
    file is missing, the reload is silently skipped and the ranks' weights diverge. Here the reload goes through the
    trainer, which reads the file on global rank 0 only and broadcasts the weights.
    """

    def __init__(self, *, restart_from_best: bool, **kwargs: Any) -> None:
        super().__init__(anneal_with_restarts=False, **kwargs)
        self.restart_from_best = restart_from_best

    @TrainerPlugin.hook
    def after_evaluation(self, current_model_is_best: bool, validation_scores: tuple, **kw: Any) -> None:
        """flair's scheduler step; after a reduction of the learning rate, restart from the best model."""
        before = list(self.current_learning_rate)
        super().after_evaluation(current_model_is_best, validation_scores, **kw)
        reduced = any(after < previous for after, previous in zip(self.current_learning_rate, before, strict=True))
        if not (self.restart_from_best and reduced):
            return
        if self.trainer.load_model(Path(self.base_path) / "best-model.pt"):
            log.info("resetting to best model")

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "anneal_with_restarts": self.restart_from_best}


class EveryRankCheckpointPlugin(CheckpointPlugin):
    """flair's ``save_model_each_k_epochs`` checkpoints, written once by global rank 0 through the trainer.

    flair's plugin runs on rank 0 alone and saves there; a save that needs the other ranks (a sharded model's
    state) would then wait for ranks that are already in the next step's collectives, and the run would hang. Here
    every rank reaches the save together and the trainer writes the file once, atomically.
    """

    @property
    def attach_to_all_processes(self) -> bool:
        return True

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        """Save ``model_epoch_<epoch>.pt`` every k epochs."""
        if self.save_model_each_k_epochs > 0 and epoch % self.save_model_each_k_epochs == 0:
            log.info(
                f"Saving model at current epoch since 'save_model_each_k_epochs={self.save_model_each_k_epochs}'"
                " was set"
            )
            self.trainer.save_model(Path(self.base_path) / f"model_epoch_{epoch}.pt", self.save_optimizer_state)


class SummedPrototypesDeepNCMPlugin(DeepNCMPlugin):
    """flair's DeepNCM prototype updates from the batches of all ranks.

    Each rank's decoder accumulates the embeddings of its own batch; summing the accumulators over the ranks before
    the update gives every rank the prototypes one process computes on the union of the batches.
    """

    @TrainerPlugin.hook
    def after_training_batch(self, **kwargs: Any) -> None:
        """Sum the prototype updates over the ranks, then update the prototypes."""
        fabric: Fabric = self.trainer.fabric
        for decoder in self.decoders:
            updates, counts = decoder.prototype_updates, decoder.prototype_update_counts
            packed = torch.cat([updates.flatten(), counts.to(updates.dtype)])  # one collective for both
            summed = cast(torch.Tensor, fabric.all_reduce(packed, reduce_op="sum"))
            decoder.prototype_updates = summed[: updates.numel()].view_as(updates).clone()
            decoder.prototype_update_counts = summed[updates.numel() :].to(counts.dtype)
            decoder.update_prototypes()


class EveryRankReduceTransformerVocabPlugin(ReduceTransformerVocabPlugin):
    """flair's ``reduce_transformer_vocab=True`` for several processes.

    flair reduces the vocabulary in ``after_setup`` on rank 0 only, after the model was wrapped: rank 0's embedding
    matrix shrinks while the other ranks keep theirs, and the ranks' weights silently diverge. Here the trainer
    has this plugin run flair's reduction on every rank, from the same token list, before DDP wraps the model
    (:meth:`reduce_before_wrapping`), and writes the model files with the full vocabulary back at the end, once.
    """

    @property
    def attach_to_all_processes(self) -> bool:
        return True

    def register_transformer_smaller_training_vocab(self, **kw: Any) -> None:
        """Not a hook here (flair's runs in ``after_setup``, after wrapping): see :meth:`reduce_before_wrapping`."""

    def reduce_before_wrapping(self) -> None:
        """flair's own vocabulary reduction (it swaps the embedding in ``trainer.optimizer``), called by the trainer
        on every rank before the model is wrapped."""
        ReduceTransformerVocabPlugin.register_transformer_smaller_training_vocab(self)

    @TrainerPlugin.hook("after_training")
    def save_model_at_the_end(self, **kw: Any) -> None:
        """Rewrite best-model.pt (or final-model.pt) with the restored full vocabulary, once, on global rank 0."""
        if self.disabled:
            return
        fabric: Fabric = self.trainer.fabric
        for name in ("best-model.pt", "final-model.pt"):
            path = Path(self.base_path) / name
            if fabric.broadcast(path.exists() if fabric.is_global_zero else None, src=0):
                self.trainer.save_model(path, self.save_optimizer_state)
                return


def for_world_size(
    plugins: Sequence[TrainerPlugin], world_size: int, exact_schedule: bool = False
) -> list[TrainerPlugin]:
    """The user's plugins, with flair's plugins that break under distribution swapped for fixed ones.
    ``exact_schedule`` (a run that named ``global_batch_size``): flair's linear schedule counts the exact steps in
    one process too (flair's own rounds ``(n + b - 1) / b * max_epochs`` down), so that it does not depend on the
    number of processes."""
    if world_size == 1:
        return [_exact_version(plugin) if exact_schedule else plugin for plugin in plugins]
    return [_distributed_version(plugin) for plugin in plugins]


def _exact_version(plugin: TrainerPlugin) -> TrainerPlugin:
    if type(plugin) is LinearSchedulerPlugin:
        return ShardedLinearSchedulerPlugin(warmup_fraction=plugin.warmup_fraction)
    return plugin


def _distributed_version(plugin: TrainerPlugin) -> TrainerPlugin:
    if type(plugin) is CheckpointPlugin:
        return EveryRankCheckpointPlugin(plugin.save_model_each_k_epochs, plugin.save_optimizer_state, plugin.base_path)
    if type(plugin) is ReduceTransformerVocabPlugin:
        return EveryRankReduceTransformerVocabPlugin(plugin.base_path, plugin.save_optimizer_state)
    if type(plugin) is DeepNCMPlugin:
        return SummedPrototypesDeepNCMPlugin()
    if type(plugin) is LinearSchedulerPlugin:
        return ShardedLinearSchedulerPlugin(warmup_fraction=plugin.warmup_fraction)
    if type(plugin) is AnnealingPlugin and plugin.anneal_with_restarts:
        return BroadcastRestartAnnealingPlugin(
            base_path=plugin.base_path,
            min_learning_rate=plugin.min_learning_rate,
            anneal_factor=plugin.anneal_factor,
            patience=plugin.patience,
            initial_extra_patience=plugin.initial_extra_patience,
            restart_from_best=True,
        )
    return plugin


def attach_builtin_plugins(
    trainer: Any,
    fabric: Fabric,
    base_path: Path,
    *,
    create_file_logs: bool,
    create_loss_file: bool,
    write_weights: bool,
    reduce_transformer_vocab: bool,
    save_model_each_k_epochs: int,
    save_optimizer_state: bool,
    epoch: int,
    loss_rows_by_step: Callable[[], int] | None = None,
) -> None:
    """Attach the plugins flair's ``train_custom`` adds itself, in flair's order; writers only on global rank 0.
    ``loss_rows_by_step``: evaluations inside epochs, ``loss.tsv`` gets a row per evaluation with the step it gives."""
    if fabric.is_global_zero:
        if create_file_logs:
            LogFilePlugin(base_path=base_path).attach_to(trainer)
        if create_loss_file and loss_rows_by_step is not None:
            StepLossFilePlugin(base_path, epoch, loss_rows_by_step).attach_to(trainer)
        elif create_loss_file:
            LossFilePlugin(base_path=base_path, epoch=epoch).attach_to(trainer)
        if write_weights:
            WeightExtractorPlugin(base_path=base_path).attach_to(trainer)
    functional: list[TrainerPlugin] = []
    if reduce_transformer_vocab:
        functional.append(ReduceTransformerVocabPlugin(base_path=base_path, save_optimizer_state=save_optimizer_state))
    if save_model_each_k_epochs > 0:
        functional.append(CheckpointPlugin(save_model_each_k_epochs, save_optimizer_state, base_path))
    for plugin in for_world_size(functional, fabric.world_size):
        plugin.attach_to(trainer)


def release_unattached(plugins: Sequence[TrainerPlugin]) -> None:
    """Close what a logger plugin opened in its constructor on a rank where it is not attached (it never reaches
    its own closing hook there): the event file of flair's ``TensorboardLogger``."""
    for plugin in plugins:
        if plugin.pluggable is None and isinstance(plugin, TensorboardLogger) and hasattr(plugin, "writer"):
            plugin.writer.close()
