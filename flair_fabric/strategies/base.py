"""What differs between strategies, behind one small interface, so that the training loop never asks which it has.

A :class:`TrainingStrategy` places and wraps the model and builds the optimizer (:meth:`~TrainingStrategy.set_up`),
gives the model to evaluate with (:meth:`~TrainingStrategy.model_for_inference`), says whether its engine clips
gradients itself, refuses the run arguments it cannot train with (:meth:`~TrainingStrategy.check_run`) and hands the
caller's model the trained weights at the end (:meth:`~TrainingStrategy.hand_back`); it gathers and scatters whole
weights for model files and loads checkpoints.

:class:`StartsProcesses` is what flair-fabric's own Fabric strategies share: their names, how they start their
processes, whether a notebook can start them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import flair
import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule, _unwrap_objects
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from flair_fabric.state.adapters import load_model_state, trainable_keys
from flair_fabric.state.safe_loading import load_data
from flair_fabric.strategies.sharded_state import read_distributed_checkpoint_whole

StartMethod = Literal["popen", "spawn", "fork"]
START_METHODS: tuple[StartMethod, ...] = ("popen", "spawn", "fork")


class StartsProcesses:
    """What flair-fabric's own Fabric strategies share: the names they are chosen by, and how they start their
    processes. ``"popen"`` relaunches the script once per extra device; ``"spawn"`` and ``"fork"`` start workers from
    inside ``train`` (the caller's model then receives the trained weights).

    ``NAMES`` maps each ``strategy=`` name the class serves to the constructor options it means (Lightning's
    registry pattern): a new strategy is one class with its names, in its own module."""

    NAMES: ClassVar[dict[str, dict[str, Any]]] = {}
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

    @property
    def is_interactive_compatible(self) -> bool:
        """Whether the processes can be started from a notebook or REPL (only forked workers can)."""
        return self.start_method == "fork"

    def training_part(self) -> TrainingStrategy:
        """The strategy's part in flair's training loop."""
        raise NotImplementedError


@dataclass
class Prepared:
    """A model and its optimizer, ready to train: the wrapped module to call, and the flair model inside it."""

    module: _FabricModule
    optimizer: torch.optim.Optimizer
    model: flair.nn.Model


MakeOptimizer = Callable[[flair.nn.Model], torch.optim.Optimizer]
BeforeWrapping = Callable[[torch.optim.Optimizer], None]


@dataclass(frozen=True)
class SetUp:
    """What a strategy is given to set a run up (on every rank)."""

    fabric: Fabric
    model: flair.nn.Model
    make_optimizer: MakeOptimizer
    """flair's optimizer for a model (built over the parameters the strategy trains: shards under FSDP)."""
    probe_batch: list
    """A train mini-batch (at most one chunk of it) for decisions taken before wrapping."""
    before_wrapping: BeforeWrapping
    """Called with the optimizer before the model is wrapped (flair's vocabulary reduction)."""
    max_grad_norm: float | None


class TrainingStrategy(ABC):
    """One strategy's part in flair's training loop."""

    clips_gradients_in_engine = False
    """Whether the engine clips gradients itself (DeepSpeed, from its config); the loop then does not."""
    shards_training_state = False
    """Whether parameters or optimizer state are split across the ranks (FSDP, DeepSpeed)."""
    gathers_in_forward = False
    """Whether forward passes run collectives (FSDP's and DeepSpeed's parameter all-gathers)."""
    reads_checkpoints_on_every_rank = False
    """Whether every rank reads the checkpoint a run resumes from (FSDP, DeepSpeed: ``fabric.load``); else global
    rank 0 reads it and sends it to the others."""

    def check_run(self, *, reduces_vocabulary: bool, mini_batch_chunk_size: int | str | None) -> None:
        """Refuse, before any process starts, run arguments this strategy cannot train with."""
        if reduces_vocabulary and self.shards_training_state:
            raise ValueError(
                "reduce_transformer_vocab=True (or a ReduceTransformerVocabPlugin) cannot be combined with a sharded"
                " strategy ('fsdp', 'deepspeed'): it replaces the embedding under the optimizer. Use strategy='ddp' or"
                " leave the vocabulary as it is."
            )
        if mini_batch_chunk_size == "auto" and self.gathers_in_forward:
            raise ValueError(
                "mini_batch_chunk_size='auto' cannot be combined with strategy='fsdp': its forward passes gather"
                " parameters with collectives, which a rank that runs out of memory half-way"
                " leaves the others waiting in. Use strategy='ddp' (or one device) with 'auto', or a fixed"
                " mini_batch_chunk_size."
            )

    @abstractmethod
    def set_up(self, run: SetUp) -> Prepared:
        """Place and wrap the model and build its optimizer (on every rank)."""

    def clip_gradients(
        self, fabric: Fabric, module: _FabricModule, optimizer: Any, max_norm: float
    ) -> torch.Tensor | None:
        """Clip the gradients' norm to ``max_norm`` as flair's trainer does, ``clip_grad_norm_(model.parameters())``:
        over the model's parameters in the model's order, once the precision plugin unscaled them. (Fabric's
        ``clip_gradients`` takes the optimizer's order, which flair's ``decoder_learning_rate`` changes, the decoder's
        group first: the norm's last bits, and so the weights, would differ from flair's.)"""
        fabric.strategy.precision.unscale_gradients(_unwrap_objects(optimizer))
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=max_norm, error_if_nonfinite=False)

    def model_for_inference(self, model: flair.nn.Model) -> contextlib.AbstractContextManager[flair.nn.Model]:
        """The model to evaluate with while ``model`` trains (a collective for a sharded model)."""
        return contextlib.nullcontext(model)

    def caller_model(self, model: flair.nn.Model) -> flair.nn.Model:
        """The model as the caller built it (a sharded strategy trains a copy)."""
        return model

    def hand_back(self, model: flair.nn.Model) -> flair.nn.Model:
        """At the end: the caller's model, holding the trained weights (a collective for a sharded model)."""
        return model

    def whole_weights(self, model: flair.nn.Model) -> dict[str, torch.Tensor] | None:
        """The whole weights of the model being trained, for global rank 0 to write into a flair model file;
        ``None``: the model holds them itself. A collective for a sharded model (every rank calls it)."""
        return None

    def load_whole_weights(self, fabric: Fabric, model: flair.nn.Model, state: dict[str, torch.Tensor] | None) -> None:
        """Load global rank 0's whole weights ``state`` (``None`` on the other ranks) into ``model`` on every rank. A
        collective."""
        state = fabric.broadcast(state, src=0)
        assert state is not None
        model.load_state_dict(state)

    def checkpoint_keys(self, model: flair.nn.Model) -> set[str] | None:
        """The model's state keys a checkpoint keeps: ``None`` (all), or for a model with peft adapters its trainable
        parameters and buffers (the frozen base comes from the model's own source on resume, docs/peft.md)."""
        return trainable_keys(model)

    def load_checkpoint(self, fabric: Fabric, path: Path, module: _FabricModule, optimizer: Any) -> None:
        """Load a checkpoint's model and optimizer (``fabric.save``'s ``state.ckpt``), also one a sharded run wrote
        (a PyTorch distributed checkpoint folder: read whole). Global rank 0 reads it (as data only) and every rank
        gets it over the process group, so the other machines need no copy of the file. A collective."""
        sharded = path.is_dir()  # its optimizer state is keyed by parameter names, not by positions
        state = None
        if fabric.is_global_zero:
            state = read_distributed_checkpoint_whole(path) if sharded else load_data(path)
        if fabric.world_size > 1:
            state = fabric.broadcast(state, src=0)
        assert state is not None
        load_model_state(module.module, state["model"])  # an adapter-sized checkpoint: the trainable part
        if sharded:
            set_optimizer_state_dict(module.module, optimizer.optimizer, optim_state_dict=state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
