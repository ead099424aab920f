"""What differs between strategies, behind one small interface, so that the training loop never asks which it has.

A :class:`TrainingStrategy` places and wraps the model and builds the optimizer (:meth:`~TrainingStrategy.set_up`),
gives the model to evaluate with (:meth:`~TrainingStrategy.model_for_inference`), says whether its engine clips
gradients itself, refuses the run arguments it cannot train with (:meth:`~TrainingStrategy.check_run`) and hands the
caller's model the trained weights at the end (:meth:`~TrainingStrategy.hand_back`).

:class:`StartsProcesses` is what flair-fabric's own Fabric strategies share: how they start their processes.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import flair
import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule

StartMethod = Literal["popen", "spawn", "fork"]
START_METHODS: tuple[StartMethod, ...] = ("popen", "spawn", "fork")


class StartsProcesses:
    """How one of flair-fabric's strategies starts its processes: ``"popen"`` relaunches the script once per extra
    device; ``"spawn"`` and ``"fork"`` start workers from inside ``train`` (the caller's model then receives the
    trained weights)."""

    start_method: StartMethod

    @staticmethod
    def checked_start_method(owner: str, start_method: StartMethod) -> StartMethod:
        """``start_method``, or a clear error naming ``owner``."""
        if start_method not in START_METHODS:
            raise ValueError(
                f"{owner}(start_method={start_method!r}) is not valid: choose one of {', '.join(START_METHODS)}."
            )
        return start_method

    @property
    def starts_workers_in_train(self) -> bool:
        """Whether ``train`` itself starts the worker processes (spawn, fork) rather than relaunching the script."""
        return self.start_method != "popen"


@dataclass
class Prepared:
    """A model and its optimizer, ready to train: the wrapped module to call, and the flair model inside it."""

    module: _FabricModule
    optimizer: torch.optim.Optimizer
    model: flair.nn.Model


MakeOptimizer = Callable[[flair.nn.Model], torch.optim.Optimizer]
BeforeWrapping = Callable[[torch.optim.Optimizer], None]


class TrainingStrategy(ABC):
    """One strategy's part in flair's training loop."""

    clips_gradients_in_engine = False
    """Whether the engine clips gradients itself (DeepSpeed, from its config); the loop then does not."""

    def check_run(self, *, reduces_vocabulary: bool, mini_batch_chunk_size: int | None) -> None:
        """Refuse, before any process starts, run arguments this strategy cannot train with (none by default)."""
        return None

    @abstractmethod
    def set_up(
        self,
        fabric: Fabric,
        model: flair.nn.Model,
        make_optimizer: MakeOptimizer,
        *,
        probe_batch: list,
        before_wrapping: BeforeWrapping,
        max_grad_norm: float | None,
    ) -> Prepared:
        """Place and wrap ``model`` and build its optimizer (on every rank)."""

    def model_for_inference(self, model: flair.nn.Model) -> contextlib.AbstractContextManager[flair.nn.Model]:
        """The model to evaluate with while ``model`` trains (a collective for a sharded model)."""
        return contextlib.nullcontext(model)

    def caller_model(self, model: flair.nn.Model) -> flair.nn.Model:
        """The model as the caller built it (a sharded strategy trains a copy)."""
        return model

    def hand_back(self, model: flair.nn.Model) -> flair.nn.Model:
        """At the end: the caller's model, holding the trained weights (a collective for a sharded model)."""
        return model
