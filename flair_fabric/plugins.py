"""flair plugins under several processes: loggers on global rank 0 only, functional plugins on every rank.

flair's built-in logger plugins do their writing in the constructor too (``LogFilePlugin`` adds a file handler to
the ``flair`` logger, ``LossFilePlugin`` creates ``loss.tsv``), so refusing to *attach* them on other ranks, which
is all flair's ``attach_to_all_processes`` does, is not enough: here they are only *made* on global rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flair.optim import LinearSchedulerWithWarmup
from flair.trainers.plugins import (
    AnnealingPlugin,
    CheckpointPlugin,
    LinearSchedulerPlugin,
    LogFilePlugin,
    LossFilePlugin,
    ReduceTransformerVocabPlugin,
    TrainerPlugin,
    WeightExtractorPlugin,
)
from lightning.fabric import Fabric

from flair_fabric.checkpoint import load_from_global_zero

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
        if load_from_global_zero(self.trainer.fabric, self.model, Path(self.base_path) / "best-model.pt"):
            log.info("resetting to best model")

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "anneal_with_restarts": self.restart_from_best}


def for_world_size(plugins: Sequence[TrainerPlugin], world_size: int) -> list[TrainerPlugin]:
    """The user's plugins, with flair's plugins that break under distribution swapped for fixed ones."""
    if world_size == 1:
        return list(plugins)
    return [_distributed_version(plugin) for plugin in plugins]


def _distributed_version(plugin: TrainerPlugin) -> TrainerPlugin:
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
) -> None:
    """Attach the plugins flair's ``train_custom`` adds itself, in flair's order; writers only on global rank 0."""
    if fabric.is_global_zero:
        if create_file_logs:
            LogFilePlugin(base_path=base_path).attach_to(trainer)
        if create_loss_file:
            LossFilePlugin(base_path=base_path, epoch=epoch).attach_to(trainer)
        if write_weights:
            WeightExtractorPlugin(base_path=base_path).attach_to(trainer)
    if reduce_transformer_vocab:
        ReduceTransformerVocabPlugin(base_path=base_path, save_optimizer_state=save_optimizer_state).attach_to(trainer)
    if save_model_each_k_epochs > 0:
        CheckpointPlugin(
            save_model_each_k_epochs=save_model_each_k_epochs,
            save_optimizer_state=save_optimizer_state,
            base_path=base_path,
        ).attach_to(trainer)


@contextmanager
def log_on_global_zero_only(fabric: Fabric) -> Iterator[None]:
    """Silence the ``flair`` logger on every rank but global rank 0 for the duration of a run."""
    was_disabled = log.disabled
    log.disabled = was_disabled or not fabric.is_global_zero
    try:
        yield
    finally:
        log.disabled = was_disabled
