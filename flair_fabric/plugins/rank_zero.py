"""Rank-aware flair plugins: mark a hook, or a whole plugin, as "global rank 0 only".

flair plugins run on every process of a multi-process run (where flair's ``attach_to_all_processes`` allows it).
``rank_zero_only`` makes one hook method run on global rank 0 alone; ``GlobalZeroPlugin`` (or flair's own
``attach_to_all_processes = False``) keeps a whole plugin off the other processes. Inside a hook, ``self.trainer``
offers the run's topology and collectives (:class:`~flair_fabric.plugins.interface.DistributedTrainer`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from flair.distributed_utils import is_main_process
from flair.trainers.plugins import TrainerPlugin

from flair_fabric.plugins.interface import DistributedTrainer

Hook = TypeVar("Hook", bound=Callable[..., Any])


def is_global_zero(plugin: TrainerPlugin) -> bool:
    """Whether ``plugin`` runs in global rank 0 (also true in a single process and under flair's own trainer)."""
    trainer = plugin.trainer
    if isinstance(trainer, DistributedTrainer):
        return trainer.is_global_zero
    return is_main_process()


def rank_zero_only(hook: Hook) -> Hook:
    """Run this plugin hook on global rank 0 only; on every other rank it does nothing and returns ``None``.

    Use it with flair's hook decorator, in either order::

        @TrainerPlugin.hook
        @rank_zero_only
        def after_training_epoch(self, epoch, **kw): ...

    A rank-0-only hook must not enter a collective (``all_reduce``, ``barrier``, ...): the other ranks never reach
    it and the run would hang. Hooks that need a collective run on every rank.
    """

    @functools.wraps(hook)
    def run_on_global_zero(self: TrainerPlugin, *args: Any, **kwargs: Any) -> Any:
        if is_global_zero(self):
            return hook(self, *args, **kwargs)
        return None

    run_on_global_zero.rank_zero_only = True  # type: ignore[attr-defined]
    return run_on_global_zero  # type: ignore[return-value]


class GlobalZeroPlugin(TrainerPlugin):
    """Base class for a plugin that runs on global rank 0 only (a logger, a notifier, a file writer).

    It uses flair's ``attach_to_all_processes`` switch, so flair's own trainer honours it as well. Code in the
    constructor still runs on every process that builds the plugin: open files or connections in ``after_setup``.
    """

    @property
    def attach_to_all_processes(self) -> bool:
        return False
