"""Strategies: flair-fabric's Fabric strategies (:class:`FlairDDPStrategy`, :class:`FlairFSDPStrategy`, Lightning's
``DeepSpeedStrategy``) and each one's part in flair's training loop (:func:`training_strategy`)."""

from __future__ import annotations

from lightning.fabric.strategies import DeepSpeedStrategy, Strategy

from flair_fabric.strategies.base import TrainingStrategy
from flair_fabric.strategies.ddp import DataParallel, FlairDDPStrategy
from flair_fabric.strategies.deepspeed import DeepSpeed, check_deepspeed
from flair_fabric.strategies.fsdp import FlairFSDPStrategy, Sharded, check_fsdp_launch

LAUNCHING_STRATEGIES = (FlairDDPStrategy, FlairFSDPStrategy)


def training_strategy(strategy: Strategy) -> TrainingStrategy:
    """The loop's view of the Fabric strategy ``strategy``."""
    if isinstance(strategy, FlairFSDPStrategy):
        return Sharded()
    if isinstance(strategy, DeepSpeedStrategy):
        return DeepSpeed(strategy)
    return DataParallel()


def is_supported(strategy: Strategy) -> bool:
    """Whether flair-fabric trains with this strategy object."""
    return isinstance(strategy, (*LAUNCHING_STRATEGIES, DeepSpeedStrategy))


def keeps_whole_model(strategy: Strategy | str) -> bool:
    """Whether every rank holds the whole model and optimizer (DDP, one device), as opposed to shards of them."""
    return not isinstance(strategy, (FlairFSDPStrategy, DeepSpeedStrategy))


def check_strategy(strategy: Strategy | str, accelerator: str, precision: str) -> None:
    """The checks each strategy makes of the launch arguments it is given (before any process starts)."""
    if isinstance(strategy, FlairFSDPStrategy):
        check_fsdp_launch(strategy, accelerator, precision)
    if isinstance(strategy, DeepSpeedStrategy):
        check_deepspeed(strategy, accelerator)


__all__ = [
    "LAUNCHING_STRATEGIES",
    "FlairDDPStrategy",
    "FlairFSDPStrategy",
    "TrainingStrategy",
    "check_strategy",
    "is_supported",
    "keeps_whole_model",
    "training_strategy",
]
