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
    CheckpointPlugin,
    LinearSchedulerPlugin,
    LogFilePlugin,
    LossFilePlugin,
    ReduceTransformerVocabPlugin,
    TrainerPlugin,
    WeightExtractorPlugin,
)
from lightning.fabric import Fabric

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


def for_world_size(plugins: Sequence[TrainerPlugin], world_size: int) -> list[TrainerPlugin]:
    """The user's plugins, with flair's ``LinearSchedulerPlugin`` swapped for the sharded one when distributed."""
    if world_size == 1:
        return list(plugins)
    return [
        ShardedLinearSchedulerPlugin(warmup_fraction=plugin.warmup_fraction)
        if type(plugin) is LinearSchedulerPlugin
        else plugin
        for plugin in plugins
    ]


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
