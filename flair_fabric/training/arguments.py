"""A training run's arguments, bound once into frozen, typed records: flair's and flair-fabric's.

:class:`FlairArguments` holds flair's ``train_custom`` arguments with flair's names, defaults (taken from flair's own
signature when binding) and meaning; :class:`TrainArguments` adds the resolved launch configuration and
flair-fabric's run options. Nothing here is changed after binding: derived values (the optimizer's keyword
arguments, the epoch a resumed run starts after) are computed, never written back into what the user passed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from flair.data import Dictionary
from flair.samplers import FlairSampler
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin
from flair.training_utils import EmbeddingStorageMode

from flair_fabric.launch.arguments import LightningArguments
from flair_fabric.launch.config import LaunchConfig
from flair_fabric.state.policy import CheckpointPolicy
from flair_fabric.state.run_store import RunStore
from flair_fabric.strategies import strategy_name
from flair_fabric.training.options import ANNOTATIONS, DEFAULT_WINDOW, TrainingOptions

_FLAIR_TRAIN_CUSTOM = inspect.signature(ModelTrainer.train_custom)


ADDED_PARAMETERS = [
    inspect.Parameter(
        each.name, inspect.Parameter.KEYWORD_ONLY, default=each.default, annotation=ANNOTATIONS.get(each.name, "Any")
    )
    for record in (LightningArguments, TrainingOptions)
    for each in fields(record)
]
"""The keyword-only parameters FabricTrainer adds to flair's: Lightning's, then flair-fabric's."""

ADDED_DOC = (
    "\n        Lightning arguments (keyword only), added by FabricTrainer:\n"
    + "".join(f"            {each.name}: {each.metadata['cli']}.\n" for each in fields(LightningArguments))
    + "        flair-fabric's training arguments (keyword only):\n"
    + "".join(f"            {each.name}: {each.metadata['doc']}\n" for each in fields(TrainingOptions))
)

Method = TypeVar("Method", bound=Callable[..., Any])


def with_flair_signature(flair_method: Callable[..., Any]) -> Callable[[Method], Method]:
    """Show flair's parameters plus the added ones in ``help()`` and IDEs for a method that forwards ``**kwargs``."""
    flair_signature = inspect.signature(flair_method)
    positional = [p for p in flair_signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    var_keyword = [p for p in flair_signature.parameters.values() if p.kind == p.VAR_KEYWORD]

    def decorate(method: Method) -> Method:
        method.__signature__ = flair_signature.replace(  # type: ignore[attr-defined]
            parameters=positional + ADDED_PARAMETERS + var_keyword
        )
        method.__doc__ = (flair_method.__doc__ or "") + ADDED_DOC
        return method

    return decorate


def split_added_arguments(kwargs: dict[str, Any]) -> tuple[LightningArguments, TrainingOptions, dict[str, Any]]:
    """Lightning's and flair-fabric's arguments out of ``train_custom``'s keyword arguments; the rest is flair's."""
    lightning = {name: kwargs.pop(name) for name in LightningArguments.names() if name in kwargs}
    options = {name: kwargs.pop(name) for name in TrainingOptions.names() if name in kwargs}
    return LightningArguments(**lightning), TrainingOptions(**options), kwargs


@dataclass(frozen=True)
class FlairArguments:
    """flair's ``ModelTrainer.train_custom`` arguments (see flair's documentation for each)."""

    base_path: Path
    learning_rate: float
    decoder_learning_rate: float | None
    mini_batch_size: int
    eval_batch_size: int
    mini_batch_chunk_size: int | None
    max_epochs: int
    optimizer: type[torch.optim.Optimizer]
    train_with_dev: bool
    train_with_test: bool
    max_grad_norm: float | None
    reduce_transformer_vocab: bool
    main_evaluation_metric: tuple[str, str]
    monitor_test: bool
    monitor_train_sample: float
    use_final_model_for_eval: bool
    gold_label_dictionary_for_eval: Dictionary | None
    exclude_labels: list[str] | None
    sampler: FlairSampler | type[FlairSampler] | None
    shuffle: bool
    shuffle_first_epoch: bool
    embeddings_storage_mode: EmbeddingStorageMode
    epoch: int
    save_final_model: bool
    save_optimizer_state: bool
    save_model_each_k_epochs: int
    create_file_logs: bool
    create_loss_file: bool
    write_weights: bool
    use_amp: bool
    multi_gpu: bool
    plugins: list[TrainerPlugin] | None
    kwargs: dict[str, Any]
    """The optimizer's other keyword arguments (flair's ``**kwargs``)."""

    @classmethod
    def bind(cls, trainer: ModelTrainer, base_path: Any, *args: Any, **kwargs: Any) -> FlairArguments:
        """flair's arguments as ``train_custom`` receives them, with flair's defaults for the ones not given."""
        bound = _FLAIR_TRAIN_CUSTOM.bind(trainer, base_path, *args, **kwargs)
        bound.apply_defaults()
        values = {name: value for name, value in bound.arguments.items() if name != "self"}
        values["base_path"] = Path(values["base_path"])
        values["kwargs"] = dict(values["kwargs"])
        return cls(**values)

    @property
    def optimizer_arguments(self) -> dict[str, Any]:
        """What flair gives the optimizer: its other keyword arguments and the learning rate."""
        return {**self.kwargs, "lr": self.learning_rate}

    @property
    def labels_excluded(self) -> list[str]:
        """``exclude_labels`` as flair uses it (``None``: none)."""
        return self.exclude_labels if self.exclude_labels is not None else []

    def as_dict(self) -> dict[str, Any]:
        """The arguments by name, as the values given (not copies), ``kwargs`` as one entry."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def without_automatic_chunks(self) -> tuple[FlairArguments, bool]:
        """These arguments with ``mini_batch_chunk_size="auto"`` taken out (whole mini-batches until a step runs out
        of memory), and whether it was given. Any other value but a positive int or ``None`` is refused."""
        chunk_size: Any = self.mini_batch_chunk_size
        if chunk_size == "auto":
            return replace(self, mini_batch_chunk_size=None), True
        positive = isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1
        if chunk_size is not None and not positive:
            raise ValueError(
                f"mini_batch_chunk_size={chunk_size!r} is not valid: pass a positive number of data points per"
                " forward pass, None (whole mini-batches) or 'auto' (whole mini-batches, redone in smaller chunks"
                " when a step runs out of memory)."
            )
        return self, False


@dataclass(frozen=True)
class TrainArguments:
    """Everything one training run is given: flair's arguments, the launch configuration, flair-fabric's options."""

    flair: FlairArguments
    launch: LaunchConfig
    progress_bar: bool
    checkpoints: CheckpointPolicy
    resume_folder: Path | None
    start_epoch: int
    """The completed epochs the run starts after: flair's ``epoch``, or the resumed checkpoint's."""
    global_batch_size: int = 1
    """The data points of one optimizer step over all ranks (``flair.mini_batch_size`` is the largest share)."""
    global_batch_size_given: bool = False
    """Whether the caller named ``global_batch_size`` (else it is ``mini_batch_size`` times the processes)."""
    group_by_length: bool = False
    """Each epoch's batches grouped by length, in windows of ``group_by_length_window`` global batches."""
    group_by_length_window: int = DEFAULT_WINDOW
    balance_batches: bool = True
    """Several processes: deal each step's data points to the ranks by length."""
    val_check_interval: int | float | None = None
    """Evaluate inside epochs too: every n optimizer steps (int) or every fraction of an epoch (float)."""
    chunks_on_out_of_memory: bool = False
    """``mini_batch_chunk_size="auto"``: a step that runs out of memory is redone in smaller chunks (flair's
    ``mini_batch_chunk_size`` is then ``None``: whole mini-batches until a step needs less)."""
    store: RunStore | None = None
    """``base_path`` was a URL: the run's store (``flair.base_path`` is this machine's staging folder of it)."""
    save_adapters: bool = False
    """Beside each model file global rank 0 writes, also its unmerged adapters in peft's own folder."""

    @property
    def collective_timeout(self) -> timedelta:
        """How long a collective waits for the other ranks."""
        return self.launch.collective_timeout

    def training_parameters(self, plugins: list[TrainerPlugin]) -> dict[str, Any]:
        """What flair hands the ``after_setup`` hooks and writes into the model card: flair's arguments (the
        optimizer's keyword arguments among them, the plugins in use) and flair-fabric's."""
        launch = self.launch
        strategy = strategy_name(launch.strategy)
        parameters = {
            **self.flair.as_dict(),
            "exclude_labels": self.flair.labels_excluded,
            "plugins": plugins,
            "epoch": self.start_epoch,
            "accelerator": launch.accelerator,
            "devices": launch.devices,
            "num_nodes": launch.num_nodes,
            "strategy": strategy,
            "precision": launch.precision,
            "progress_bar": self.progress_bar,
            "checkpoint_every_n_epochs": self.checkpoints.every_n_epochs,
            "checkpoint_every_n_steps": self.checkpoints.every_n_steps or None,
            "checkpoint_every_n_minutes": self.checkpoints.every_n_minutes or None,
            "keep_checkpoints": self.checkpoints.keep,
            "requeue_signal": self.checkpoints.requeue_signal.name if self.checkpoints.requeue_signal else None,
            "resume_from": str(self.resume_folder) if self.resume_folder is not None else None,
            "collective_timeout": launch.collective_timeout,
            "global_batch_size": self.global_batch_size,
            "group_by_length": self.group_by_length,
            "group_by_length_window": self.group_by_length_window,
            "balance_batches": self.balance_batches,
            "val_check_interval": self.val_check_interval,
            "save_adapters": self.save_adapters,
        }
        if self.chunks_on_out_of_memory:
            parameters["mini_batch_chunk_size"] = "auto"
        parameters.update(self.flair.kwargs)
        return parameters
