"""Strategies: everything that knows a strategy's type, in one package (Lightning's registry pattern).

flair-fabric's Fabric strategies (:class:`FlairDDPStrategy`, :class:`FlairFSDPStrategy`,
:class:`FlairDeepSpeedStrategy`) each declare the ``strategy=`` names they serve (``NAMES``) and how they start their
processes; each has its part in flair's training loop (:func:`training_strategy`). The rest of the package asks the
functions below, never the strategy's class.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.strategies import DeepSpeedStrategy, Strategy

from flair_fabric.strategies.base import StartMethod, TrainingStrategy
from flair_fabric.strategies.ddp import DataParallel, FindUnused, FlairDDPStrategy
from flair_fabric.strategies.deepspeed import DeepSpeed, FlairDeepSpeedStrategy, check_deepspeed
from flair_fabric.strategies.fsdp import FlairFSDPStrategy, Sharded, check_fsdp_launch

_NAMED: tuple[Any, ...] = (FlairDDPStrategy, FlairFSDPStrategy, FlairDeepSpeedStrategy)
_STARTS_PROCESSES = (FlairDDPStrategy, FlairFSDPStrategy)

STRATEGY_NAMES: tuple[str, ...] = ("auto", *(name for cls in _NAMED for name in cls.NAMES))
"""Every ``strategy=`` name (the ``ddp*`` ones also with Lightning's ``_find_unused_parameters_true``/``_false``)."""


def _split_find_unused(strategy: str) -> tuple[str, FindUnused]:
    """Lightning's ``"ddp_find_unused_parameters_true"`` spellings: the strategy name and the forced setting."""
    for suffix, value in (("_find_unused_parameters_true", True), ("_find_unused_parameters_false", False)):
        if strategy.endswith(suffix) and strategy.startswith("ddp"):
            return strategy.removesuffix(suffix), value
    return strategy, "auto"


def is_strategy_object(strategy: Any) -> bool:
    """Whether ``strategy`` is a strategy object (rather than a name)."""
    return isinstance(strategy, Strategy)


def strategy_name(strategy: str | Strategy) -> str:
    """How logs, errors and the model card name a strategy: its name, or its object's class name."""
    return strategy if isinstance(strategy, str) else type(strategy).__name__


def resolve_strategy(
    strategy: str | Strategy,
    *,
    world_size: int,
    accelerator: str,
    launched: bool,
    interactive: bool,
    timeout: timedelta,
) -> str | Strategy:
    """Turn the ``strategy`` argument into what Fabric is given: a strategy object or ``"auto"``.

    ``"auto"`` picks what Lightning picks: no wrapper for one process, otherwise DDP, with forked workers in a
    notebook or REPL (``interactive``: it cannot be relaunched) and the script relaunch elsewhere. ``launched``: an
    outside launcher (torchrun, SLURM) started the processes."""
    if isinstance(strategy, Strategy):
        if not isinstance(strategy, (*_NAMED, DeepSpeedStrategy)):
            raise ValueError(
                f"strategy={type(strategy).__name__}(...) is not supported; pass one of {', '.join(STRATEGY_NAMES)}"
                " or a FlairDDPStrategy(...), FlairFSDPStrategy(...) or DeepSpeedStrategy(...) object."
            )
        return strategy
    name, find_unused = _split_find_unused(strategy) if isinstance(strategy, str) else (strategy, "auto")
    if name not in STRATEGY_NAMES:
        raise ValueError(f"strategy={strategy!r} is not supported; choose one of {', '.join(STRATEGY_NAMES)}.")
    if name == "auto":
        if world_size == 1 and not launched:
            return "auto"
        name = "ddp_notebook" if interactive else "ddp"
    owner = next(cls for cls in _NAMED if name in cls.NAMES)
    return owner.from_name(
        name, interactive=interactive, timeout=timeout, accelerator=accelerator, find_unused=find_unused
    )


def timeout_of(strategy: str | Strategy) -> timedelta | None:
    """The collective timeout a strategy object was given (``None``: a name, or none given)."""
    return getattr(strategy, "_timeout", None) if isinstance(strategy, Strategy) else None


def brings_cluster_environment(strategy: str | Strategy) -> bool:
    """Whether a strategy object comes with its own cluster environment (Fabric should not choose one)."""
    return isinstance(strategy, Strategy) and getattr(strategy, "cluster_environment", None) is not None


def start_method(strategy: str | Strategy) -> StartMethod | None:
    """How flair-fabric's own strategies start their processes (``None``: another strategy, or one process)."""
    return strategy.start_method if isinstance(strategy, _STARTS_PROCESSES) else None


def starts_workers(strategy: str | Strategy) -> bool:
    """Whether ``train`` itself starts spawned or forked worker processes (instead of running in the caller)."""
    return isinstance(strategy, _STARTS_PROCESSES) and strategy.starts_workers_in_train


def starts_processes_itself(strategy: str | Strategy) -> bool:
    """Whether one of flair-fabric's own strategies starts the processes (script relaunch, spawn, fork)."""
    return isinstance(strategy, _STARTS_PROCESSES)


def is_interactive_compatible(strategy: str | Strategy) -> bool:
    """Whether a notebook or REPL can start the strategy's processes (only forked workers can)."""
    return not isinstance(strategy, _STARTS_PROCESSES) or strategy.is_interactive_compatible


def keeps_whole_model(strategy: str | Strategy) -> bool:
    """Whether every rank holds the whole model and optimizer (DDP, one device), as opposed to shards of them."""
    return not isinstance(strategy, (FlairFSDPStrategy, DeepSpeedStrategy))


def every_parameter_learns(strategy: str | Strategy) -> None:
    """Tell DDP that every parameter gets a gradient (no probe, no search for unused parameters), unless the caller
    forced a setting: for models whose every parameter learns in every step (a character language model)."""
    if isinstance(strategy, FlairDDPStrategy) and strategy.find_unused_parameters == "auto":
        strategy.find_unused_parameters = False


def no_pass_synchronises(strategy: str | Strategy) -> None:
    """Tell DDP that no forward or backward pass synchronises (``mini_batch_chunk_size="auto"``: the gradients are
    summed by flair-fabric): no search for unused parameters, no buffer broadcast in a forward pass."""
    if isinstance(strategy, FlairDDPStrategy):
        every_parameter_learns(strategy)
        strategy.passes_synchronise = False


def check_strategy(strategy: str | Strategy, accelerator: str, precision: str) -> None:
    """The checks each strategy makes of the launch arguments it is given (before any process starts)."""
    if isinstance(strategy, FlairFSDPStrategy):
        check_fsdp_launch(strategy, accelerator, precision)
    if isinstance(strategy, DeepSpeedStrategy):
        check_deepspeed(strategy, accelerator)


def training_strategy(strategy: str | Strategy) -> TrainingStrategy:
    """The loop's view of the strategy (a name means one process: no wrapper)."""
    if isinstance(strategy, FlairFSDPStrategy):
        return Sharded()
    if isinstance(strategy, DeepSpeedStrategy):
        return DeepSpeed(strategy)
    return DataParallel(
        compresses_gradients=isinstance(strategy, FlairDDPStrategy) and strategy.gradient_compression is not None,
    )


__all__ = [
    "STRATEGY_NAMES",
    "FlairDDPStrategy",
    "FlairDeepSpeedStrategy",
    "FlairFSDPStrategy",
    "TrainingStrategy",
    "brings_cluster_environment",
    "check_strategy",
    "every_parameter_learns",
    "is_interactive_compatible",
    "is_strategy_object",
    "keeps_whole_model",
    "resolve_strategy",
    "start_method",
    "starts_processes_itself",
    "starts_workers",
    "timeout_of",
    "training_strategy",
]
