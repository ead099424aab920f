"""Lightning's arguments, declared once: every entry point (``FabricTrainer``, ``FabricLanguageModelTrainer``,
``predict``, ``evaluate``, the command line) takes these, with these defaults and meanings.

Plain Python only (no torch, flair or Lightning), so that the command line can build its options and answer
``--help`` without importing them. The values are checked and resolved by :func:`~flair_fabric.launch.config.
make_launch_config`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, TypeVar


def _about(meaning: str, accepted: str, cli: str) -> dict[str, str]:
    """An argument's description: its meaning and accepted values (the README's table), its command-line help."""
    return {"meaning": meaning, "accepted": accepted, "cli": cli}


@dataclass(frozen=True)
class LightningArguments:
    """Lightning's arguments as the caller gave them (checked later, before any process starts)."""

    accelerator: str = field(
        default="auto",
        metadata=_about(
            'the kind of device; `"auto"` picks CUDA, then MPS, then CPU',
            '`"auto"`, `"cpu"`, `"cuda"`, `"gpu"`, `"mps"`',
            cli="auto, cpu, cuda, gpu or mps",
        ),
    )
    devices: Any = field(
        default="auto",
        metadata=_about(
            'devices (processes) per machine; `"auto"`: all GPUs, one CPU process, or what torchrun/SLURM started',
            'int >= 1, `"auto"`; on GPUs also `-1` and a list of indices',
            cli="devices (processes) per machine: a number, -1 (all GPUs) or auto",
        ),
    )
    num_nodes: int | str = field(
        default="auto",
        metadata=_about(
            'number of machines; `"auto"`: what torchrun/SLURM started (it may change between an elastic agent\'s'
            " restarts), else 1",
            'int >= 1, `"auto"`',
            cli="number of machines, or auto (what torchrun/SLURM started, else 1)",
        ),
    )
    strategy: Any = field(
        default="auto",
        metadata=_about(
            'how processes start and how the model is wrapped; `"auto"`: no wrapper on one device, else DDP with the'
            " script relaunch (forked workers in a notebook)",
            '`"auto"`, `"ddp"`, `"ddp_spawn"`, `"ddp_fork"`, `"ddp_notebook"` (each also with Lightning\'s'
            ' `_find_unused_parameters_true`/`_false`), `"fsdp"`, `"deepspeed"`, `"deepspeed_stage_1"`,'
            ' `"deepspeed_stage_2"`, or a `FlairDDPStrategy`, `FlairFSDPStrategy` or `DeepSpeedStrategy` object',
            cli="auto, ddp, ddp_spawn, ddp_fork or ddp_notebook",
        ),
    )
    precision: Any = field(
        default=None,
        metadata=_about(
            "Fabric's precision plugins, resolved by Fabric; flair's `use_amp=True` means `\"16-mixed\"` on CUDA,"
            ' `"bf16-mixed"` elsewhere',
            'what Fabric accepts but Transformer Engine\'s: `"32-true"`, `"bf16-mixed"`, `"bf16-true"`,'
            ' `"16-mixed"`/`"16-true"` (CUDA), `"64-true"`, and its aliases (`"bf16"`, `"16"`, `32`, ...)',
            cli="a Fabric precision such as bf16-mixed (default: 32-true)",
        ),
    )
    collective_timeout: float | timedelta | None = field(
        default=None,
        metadata=_about(
            "how long a rank waits in a collective before the job ends with an error naming the rank, epoch, step and"
            " phase; work of rank 0 alone (saving, rank-0-only evaluation) is not limited by it",
            "seconds, a `timedelta`",
            cli="seconds a process waits for the others in a collective (default: 600)",
        ),
    )

    @classmethod
    def names(cls) -> list[str]:
        """The argument names, in order."""
        return [each.name for each in fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        """The arguments by name."""
        return {name: getattr(self, name) for name in self.names()}


LIGHTNING_PARAMETERS = [
    inspect.Parameter(each.name, inspect.Parameter.KEYWORD_ONLY, default=each.default)
    for each in fields(LightningArguments)
]
"""Lightning's arguments as keyword-only parameters (for the signatures of the entry points)."""

Function = TypeVar("Function", bound=Callable[..., Any])


def takes_lightning_arguments(function: Function) -> Function:
    """Show Lightning's arguments in the signature of an entry point that takes them in ``**kwargs`` (``help()``,
    IDEs, ``inspect.signature``): before its other ``**kwargs``, or in place of ``**lightning``."""
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    rest = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD and p.name != "lightning"]
    function.__signature__ = signature.replace(parameters=own + LIGHTNING_PARAMETERS + rest)  # type: ignore[attr-defined]
    return function


def take_lightning_arguments(kwargs: dict[str, Any]) -> LightningArguments:
    """Lightning's arguments out of an entry point's ``**kwargs`` (removed from it), the rest left in it."""
    return LightningArguments(**{name: kwargs.pop(name) for name in LightningArguments.names() if name in kwargs})
