"""``FabricTrainer``: flair's ``ModelTrainer`` with its training loop run by Lightning Fabric.

``train``, ``fine_tune`` and ``train_custom`` take flair's arguments unchanged plus Lightning's ``accelerator``,
``devices``, ``num_nodes``, ``strategy`` and ``precision``. ``train_custom`` checks everything, builds a Fabric, lets
Fabric start the processes and runs :meth:`FabricTrainer._train_on_rank` on each: flair's loop, event for event, with
device placement, DDP, mixed precision and collectives done by Fabric.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import flair
import torch
from flair.data import Corpus, _len_dataset
from flair.trainers import ModelTrainer
from flair.trainers.plugins import MetricRecord, ReduceTransformerVocabPlugin, TrainingInterrupt
from flair.training_utils import Result, identify_dynamic_embeddings, log_line, store_embeddings
from lightning.fabric import Fabric
from lightning.fabric.strategies import DeepSpeedStrategy
from lightning.fabric.wrappers import _FabricModule
from torch.utils.data import Dataset, Subset

from flair_fabric.checkpoint import check_writable_folder, load_from_global_zero, save_on_global_zero
from flair_fabric.environment import external_launch
from flair_fabric.evaluation import evaluate_across_ranks
from flair_fabric.failures import exit_with_parent, graceful_interrupts
from flair_fabric.fingerprints import check_ranks_agree, model_fingerprint
from flair_fabric.launch import DevicesArgument, LaunchConfig, StrategyArgument, build_fabric, make_launch_config
from flair_fabric.lockstep import DEFERRED_EVENTS, Lockstep
from flair_fabric.metrics import GlobalLoss, LossTracker
from flair_fabric.participation import Participation, chunks_for_every_rank, find_stand_in_batch
from flair_fabric.plugins import (
    EveryRankReduceTransformerVocabPlugin,
    attach_builtin_plugins,
    for_world_size,
    log_on_global_zero_only,
    release_unattached,
)
from flair_fabric.progress import EpochProgressBar, show_progress_bar
from flair_fabric.resume import (
    Progress,
    checkpoint_folder,
    checkpoint_to_resume,
    keep_loss_rows_up_to,
    load_training_state,
    save_training_state,
    set_rng_state,
)
from flair_fabric.safe_loading import as_plain_data
from flair_fabric.sampling import ShardedBatchSampler, shared_seed, steps_per_epoch, train_loader
from flair_fabric.sharding import FlairFSDPStrategy, ShardedCopy, held_bytes, whole_tensor
from flair_fabric.stalls import Position, explain_timeouts
from flair_fabric.strategies import resolve_unused_parameters
from flair_fabric.workers import run_on_every_rank, starts_workers

log = logging.getLogger("flair")

_FLAIR_TRAIN_CUSTOM = inspect.signature(ModelTrainer.train_custom)

_FABRIC_PARAMETERS = [
    inspect.Parameter("accelerator", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation="str"),
    inspect.Parameter("devices", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation="DevicesArgument"),
    inspect.Parameter("num_nodes", inspect.Parameter.KEYWORD_ONLY, default=1, annotation="int"),
    inspect.Parameter("strategy", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation="StrategyArgument"),
    inspect.Parameter("precision", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Optional[str]"),
    inspect.Parameter("progress_bar", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Optional[bool]"),
    inspect.Parameter("checkpoint_every_n_epochs", inspect.Parameter.KEYWORD_ONLY, default=0, annotation="int"),
    inspect.Parameter("resume_from", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Union[str, Path, None]"),
    inspect.Parameter(
        "collective_timeout", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Union[float, timedelta, None]"
    ),
]

_FABRIC_DOC = """
        Lightning arguments (keyword only), added by FabricTrainer:
            accelerator: "auto", "cpu", "cuda", "gpu" or "mps".
            devices: devices per node: an int, -1 for all, "auto", or a list of device indices.
            num_nodes: number of machines.
            strategy: "auto", "ddp" (script relaunch), "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp" (sharded
                parameters, gradients and optimizer state), "deepspeed" (ZeRO stage 2, CUDA only), or a
                FlairDDPStrategy(...), FlairFSDPStrategy(...) or DeepSpeedStrategy(...) object.
            precision: "32-true" (default), "bf16-mixed", "bf16-true", "16-mixed" (GPU), "16-true" (GPU), "64-true".
            progress_bar: a bar per epoch on global rank 0: True, False, or None (in a terminal or a notebook).
            checkpoint_every_n_epochs: save the complete training state to base_path/checkpoint every n epochs
                (0: never).
            resume_from: continue from a checkpoint: its folder, or "auto" for base_path/checkpoint if there is one.
            collective_timeout: how long a rank waits in a collective for the others before the job ends with an
                error that says where (seconds or a timedelta; default 10 minutes). Saves and other work of global
                rank 0 alone are not limited by it.
"""

Method = TypeVar("Method", bound=Callable[..., Any])


def _with_flair_signature(flair_method: Callable[..., Any]) -> Callable[[Method], Method]:
    """Show flair's parameters plus Lightning's in ``help()`` and IDEs for a method that forwards ``**kwargs``."""
    flair_signature = inspect.signature(flair_method)
    positional = [p for p in flair_signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    var_keyword = [p for p in flair_signature.parameters.values() if p.kind == p.VAR_KEYWORD]

    def decorate(method: Method) -> Method:
        method.__signature__ = flair_signature.replace(  # type: ignore[attr-defined]
            parameters=positional + _FABRIC_PARAMETERS + var_keyword
        )
        method.__doc__ = (flair_method.__doc__ or "") + _FABRIC_DOC
        return method

    return decorate


@dataclass
class _RunState:
    """What one rank's run keeps between its named steps."""

    fabric: Fabric
    args: SimpleNamespace
    base_path: Path
    module: _FabricModule
    train_data: Dataset
    sampler: Any
    shuffle: bool
    seed: int
    evaluation_splits: dict[str, Dataset]
    determine_best_epoch_using_dev_score: bool
    best_epoch_score: float
    save_best_model: bool
    precision: str
    show_progress_bar: bool
    participation: Participation | None = None
    checkpoint_every_n_epochs: int = 0
    resume_folder: Path | None = None
    batch_count: int = 0
    dynamic_embeddings: list[str] | None = None


class FabricTrainer(ModelTrainer):
    """flair's :class:`~flair.trainers.ModelTrainer`, trained through Lightning Fabric on one or many devices.

    Use it exactly like ``ModelTrainer``; ``train``, ``fine_tune`` and ``train_custom`` also take ``accelerator``,
    ``devices``, ``num_nodes``, ``strategy`` and ``precision``. ``devices=2`` in an ordinary script is enough: the
    script is relaunched once per extra device by Fabric, or left alone when ``torchrun`` started it.
    """

    def __init__(self, model: flair.nn.Model, corpus: Corpus) -> None:
        super().__init__(model, corpus)
        self.fabric: Fabric | None = None
        self.steps_per_epoch: int = 0
        self._lockstep: Lockstep | None = None
        self._position = Position()  # where this rank is, for the error a stalled collective raises
        self._sharded_copy: ShardedCopy[flair.nn.Model] | None = None

    # --- the run's topology, for plugins ------------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        """Rank of this process among all processes of the run (0 outside a run)."""
        return self.fabric.global_rank if self.fabric is not None else 0

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine (0 outside a run)."""
        return self.fabric.local_rank if self.fabric is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes of the run (1 outside a run)."""
        return self.fabric.world_size if self.fabric is not None else 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0, the process that writes logs and model files."""
        return self.global_rank == 0

    # --- flair's public entry points ----------------------------------------------------------------------------

    @_with_flair_signature(ModelTrainer.train)
    def train(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        return super().train(base_path, *args, **kwargs)

    @_with_flair_signature(ModelTrainer.fine_tune)
    def fine_tune(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        return super().fine_tune(base_path, *args, **kwargs)

    @_with_flair_signature(ModelTrainer.train_custom)
    def train_custom(
        self,
        base_path: Any,
        *args: Any,
        accelerator: str = "auto",
        devices: DevicesArgument = "auto",
        num_nodes: int = 1,
        strategy: StrategyArgument = "auto",
        precision: str | None = None,
        progress_bar: bool | None = None,
        checkpoint_every_n_epochs: int = 0,
        resume_from: str | Path | None = None,
        collective_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> dict:
        bound = _FLAIR_TRAIN_CUSTOM.bind(self, base_path, *args, **kwargs)
        bound.apply_defaults()
        flair_args = SimpleNamespace(**{k: v for k, v in bound.arguments.items() if k != "self"})
        if flair_args.multi_gpu:
            raise ValueError(
                "multi_gpu=True is flair's own multi-GPU mode; FabricTrainer starts the processes itself:"
                " pass devices=N (and strategy=...) instead of multi_gpu=True."
            )
        config = make_launch_config(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
            use_amp=flair_args.use_amp,
            collective_timeout=collective_timeout,
        )
        resume_folder = checkpoint_to_resume(self.model, flair_args, checkpoint_every_n_epochs, resume_from)
        self._check_run(flair_args, config)
        fabric = build_fabric(config)
        self.fabric = fabric
        fabric_args = {
            "accelerator": config.accelerator,
            "devices": config.devices,
            "num_nodes": config.num_nodes,
            "strategy": config.strategy if isinstance(config.strategy, str) else type(config.strategy).__name__,
            "precision": config.precision,
            "progress_bar": show_progress_bar(progress_bar, is_global_zero=True),  # checked before any process starts
            "checkpoint_every_n_epochs": checkpoint_every_n_epochs,
            "resume_from": str(resume_folder) if resume_folder is not None else None,
            "collective_timeout": config.collective_timeout,
        }
        if not starts_workers(fabric):
            run = functools.partial(self._train_on_rank, args=flair_args, fabric_args=fabric_args)
            return run_on_every_rank(fabric, lambda rank_fabric, _: run(rank_fabric), None, config.collective_timeout)
        # spawned or forked workers train copies: the caller's model then becomes what rank 0's model is at the end
        job = _WorkerJob(type(self), self.model, self.corpus, flair_args, fabric_args)
        started = time.time()
        try:
            trained = run_on_every_rank(
                fabric, _train_in_worker, job, config.collective_timeout, result_types=[_TrainedInWorker]
            )
        except KeyboardInterrupt:
            self._take_final_model_written_since(Path(flair_args.base_path), started)
            raise
        self.model.load_state_dict(trained.weights)
        self.model.model_card = trained.model_card
        self.model.train(trained.training)  # flair's trainer leaves it in eval mode
        return trained.result

    def _take_final_model_written_since(self, base_path: Path, started: float) -> None:
        """After the workers were stopped at once: give the caller's model the weights of the final-model.pt they
        saved, if they got that far, and say which state the model is in."""
        final_model = base_path / "final-model.pt"
        if final_model.is_file() and final_model.stat().st_mtime >= started:
            self.model.load_state_dict(self.model.load(final_model).state_dict())
            self.model.eval()
            log.warning(f"the workers were stopped; the model holds the weights they saved in {final_model}")
        else:
            log.warning("the workers were stopped before they saved a model: the model was not updated")

    def _check_run(self, args: SimpleNamespace, config: LaunchConfig) -> None:
        """Refuse, before any process starts, what cannot train."""
        if self.corpus.train is None:
            raise ValueError("the corpus has no train split: FabricTrainer needs training data (corpus.train).")
        check_writable_folder(args.base_path)
        size = _len_dataset(self._get_train_data(args.train_with_dev, args.train_with_test))
        if size == 0:
            raise ValueError("the train split is empty: FabricTrainer needs at least one training data point.")
        sharded = isinstance(config.strategy, FlairFSDPStrategy | DeepSpeedStrategy)
        reduces_vocabulary = args.reduce_transformer_vocab or any(
            isinstance(plugin, ReduceTransformerVocabPlugin) for plugin in args.plugins or []
        )
        if sharded and reduces_vocabulary:
            raise ValueError(
                "reduce_transformer_vocab=True (or a ReduceTransformerVocabPlugin) cannot be combined with a sharded"
                " strategy ('fsdp', 'deepspeed'): it replaces the embedding under the optimizer. Use strategy='ddp' or"
                " leave the vocabulary as it is."
            )
        if isinstance(config.strategy, DeepSpeedStrategy) and args.mini_batch_chunk_size is not None:
            raise ValueError(
                "mini_batch_chunk_size cannot be used with strategy='deepspeed' (its engine steps on every backward):"
                " set DeepSpeed's gradient accumulation instead, or use strategy='fsdp'."
            )
        if size < config.world_size:
            raise ValueError(
                f"the train split has {size} data point(s) for {config.world_size} processes: every process needs"
                " at least one; use fewer devices or more training data."
            )

    # --- one rank's run -----------------------------------------------------------------------------------------

    def _train_on_rank(self, fabric: Fabric, args: SimpleNamespace, fabric_args: dict) -> dict:
        """flair's ``train_custom`` on one rank; every rank returns global rank 0's return values."""
        flair.device = fabric.device
        if fabric.local_rank > 0 and not starts_workers(fabric) and external_launch() is None:
            exit_with_parent()  # started by the script relaunch from rank 0: do not outlive it
        self._position = Position()
        with (
            log_on_global_zero_only(fabric),
            explain_timeouts(fabric, self._position, fabric_args["collective_timeout"]),
        ):
            return self._run(fabric, args, fabric_args)

    def _sample_train_split(self, monitor_train_sample: float | int) -> Subset:
        """flair's random train sample for ``monitor_train_sample``, drawn on global rank 0 and the same on every rank
        (sharded evaluation needs the same data on all ranks; their ``random`` states may differ)."""
        sample = super()._sample_train_split(monitor_train_sample)
        if self.fabric is not None and self.fabric.world_size > 1:
            sample = Subset(sample.dataset, self.fabric.broadcast(list(sample.indices), src=0))
        return sample

    def dispatch(self, event: str, *args: Any, **kwargs: Any) -> None:
        """flair's event dispatch; with several processes a plugin's ``TrainingInterrupt`` inside the epoch loop waits
        for the next point where all ranks agree to stop (see :mod:`flair_fabric.lockstep`)."""
        if self._lockstep is None or event not in DEFERRED_EVENTS:
            return super().dispatch(event, *args, **kwargs)
        try:
            super().dispatch(event, *args, **kwargs)
        except TrainingInterrupt as stop:
            self._lockstep.hold(stop)

    def _on_signal(self, name: str) -> None:
        """Ctrl-C or SIGTERM during training: with several processes every rank stops at the next agreement point;
        in one process at once. Either way flair's interrupt handling saves the final model."""
        if self._lockstep is None:
            raise KeyboardInterrupt(f"{name} received")
        log.warning(f"{name} received: every process stops at the next agreement point (send it again to stop now)")
        self._lockstep.interrupt(name)

    def _agree_on_stopping(self) -> None:
        """Every rank raises ``TrainingInterrupt`` here if a plugin on any rank stopped since the last agreement."""
        if self._lockstep is not None:
            self._lockstep.agree()

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward through Fabric (precision, gradient scaler, strategy); plugins may still override it."""
        assert self.fabric is not None
        self.fabric.backward(loss)

    def _save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        assert self.fabric is not None
        self._position.at(f"saving {Path(model_file).name}")
        save_on_global_zero(self.fabric, self.model, model_file, checkpoint)

    def _load_model(self, model_file: str | Path) -> None:
        assert self.fabric is not None
        load_from_global_zero(self.fabric, self.model, model_file)

    def _run(self, fabric: Fabric, a: SimpleNamespace, fabric_args: dict) -> dict:
        with contextlib.ExitStack() as context_stack:
            self.context_stack = context_stack
            run, plugins, parameters = self._set_up_run(fabric, a, fabric_args)
            self.dispatch("after_setup", **parameters)
            self._log_setup(run, plugins)
            rng = self._resume(run) if run.resume_folder is not None else None
            self._lockstep = Lockstep(fabric) if fabric.world_size > 1 else None
            try:
                if rng is not None:
                    set_rng_state(rng)  # last, so the first resumed epoch draws what the interrupted run drew
                with graceful_interrupts(self._on_signal):
                    self._train_epochs(run)
            finally:
                self._lockstep = None
            self._test_final_model(run)
            if self._sharded_copy is not None:
                self.model = self._sharded_copy.hand_back()
                self._sharded_copy = None

        self.dispatch("after_training")
        return_values = fabric.broadcast(self.return_values, src=0)
        self.reset_training_attributes()
        return return_values

    def _set_up_run(self, fabric: Fabric, a: SimpleNamespace, fabric_args: dict) -> tuple[_RunState, list, dict]:
        """flair's set-up, in flair's order: plugins, model card, data, evaluation splits, model and optimizer."""
        check_ranks_agree(fabric, self.corpus, self.model)
        a.exclude_labels = a.exclude_labels if a.exclude_labels is not None else []
        base_path = Path(a.base_path)
        base_path.mkdir(exist_ok=True, parents=True)

        plugins = for_world_size(a.plugins if a.plugins is not None else [], fabric.world_size)
        for plugin in plugins:
            plugin.attach_to(self)  # flair's attach: global rank 0 only for attach_to_all_processes=False
        release_unattached(plugins)
        attach_builtin_plugins(
            self,
            fabric,
            base_path,
            create_file_logs=a.create_file_logs,
            create_loss_file=a.create_loss_file,
            write_weights=a.write_weights,
            reduce_transformer_vocab=a.reduce_transformer_vocab,
            save_model_each_k_epochs=a.save_model_each_k_epochs,
            save_optimizer_state=a.save_optimizer_state,
            epoch=a.epoch,
        )

        training_parameters = {**vars(a), "base_path": base_path, "plugins": plugins, **fabric_args}
        training_parameters.update(a.kwargs)
        self.model.model_card = self._initialize_model_card(**training_parameters)

        train_data = self._get_train_data(train_with_dev=a.train_with_dev, train_with_test=a.train_with_test)
        dataset_size = _len_dataset(train_data)
        parameters = {"dataset_size": dataset_size, **training_parameters}

        evaluation_splits: dict[str, Dataset] = {}
        if not a.train_with_dev and self.corpus.dev:
            evaluation_splits["dev"] = self.corpus.dev
        if self.corpus.test and a.monitor_test:
            evaluation_splits["test"] = self.corpus.test
        if a.monitor_train_sample > 0.0:
            evaluation_splits["train_sample"] = self._sample_train_split(a.monitor_train_sample)
        determine_best_epoch_using_dev_score = bool(not a.train_with_dev and self.corpus.dev)

        # a step that learns nothing on one rank must still take part in the others' collectives
        stand_in = find_stand_in_batch(self.model, train_data, a.mini_batch_size) if fabric.world_size > 1 else None
        module = self._set_up_model_and_optimizer(fabric, a, train_data, stand_in)

        sampler, shuffle = a.sampler, a.shuffle
        if sampler is not None:
            if isinstance(sampler, type):
                sampler = sampler()
            sampler.set_dataset(train_data)
            shuffle = False
        self.steps_per_epoch = steps_per_epoch(dataset_size, a.mini_batch_size, fabric.world_size)

        if a.epoch >= a.max_epochs:
            log.warning(f"Starting at epoch {a.epoch + 1}/{a.max_epochs}. No training will be done.")
        if a.epoch == 0 and fabric.is_global_zero:
            self.check_for_and_delete_previous_best_models(base_path)

        run = _RunState(
            fabric=fabric,
            args=a,
            base_path=base_path,
            module=module,
            train_data=train_data,
            sampler=sampler,
            shuffle=shuffle,
            seed=shared_seed(fabric) if fabric.world_size > 1 else 0,
            evaluation_splits=evaluation_splits,
            determine_best_epoch_using_dev_score=determine_best_epoch_using_dev_score,
            best_epoch_score=0 if determine_best_epoch_using_dev_score else float("inf"),
            save_best_model=not a.train_with_dev and not a.use_final_model_for_eval,
            precision=fabric_args["precision"],
            show_progress_bar=fabric_args["progress_bar"] and fabric.is_global_zero,
            checkpoint_every_n_epochs=fabric_args["checkpoint_every_n_epochs"],
            resume_folder=Path(fabric_args["resume_from"]) if fabric_args["resume_from"] else None,
            participation=Participation(self.model, stand_in) if fabric.world_size > 1 else None,
        )
        return run, plugins, parameters

    def _set_up_model_and_optimizer(
        self, fabric: Fabric, a: SimpleNamespace, train_data: Dataset, stand_in: list | None
    ) -> _FabricModule:
        """Place and wrap the model (DDP decides about unused parameters first), then build the optimizer."""
        if isinstance(fabric.strategy, FlairFSDPStrategy):
            return self._set_up_sharded_model_and_optimizer(fabric, a)
        if isinstance(fabric.strategy, DeepSpeedStrategy):
            return self._set_up_deepspeed_model_and_optimizer(fabric, a)
        fabric.to_device(self.model)
        a.kwargs["lr"] = a.learning_rate
        optimizer = self._make_optimizer(a.optimizer, a.decoder_learning_rate, a.kwargs)
        for plugin in self.plugins:
            if isinstance(plugin, EveryRankReduceTransformerVocabPlugin):
                plugin.reduce_before_wrapping(optimizer)  # on every rank, before DDP sees the parameters
        probe = stand_in or [train_data[i] for i in range(min(a.mini_batch_size, _len_dataset(train_data)))]
        resolve_unused_parameters(fabric, self.model, probe)
        module = fabric.setup_module(self.model)
        module.mark_forward_method("forward_loss")
        self.optimizer = fabric.setup_optimizers(optimizer)
        return module

    def _save_training_state(self, run: _RunState, epoch: int) -> None:
        """Everything a resumed run needs to continue exactly after ``epoch``, in base_path/checkpoint."""
        self._position.at("saving the training state", epoch, 0)
        progress = Progress(
            epoch=epoch,
            batch_count=run.batch_count,
            best_epoch_score=run.best_epoch_score,
            seed=run.seed,
            world_size=run.fabric.world_size,
            model_fingerprint=model_fingerprint(self._caller_model()),
        )
        folder = checkpoint_folder(run.base_path)
        save_training_state(run.fabric, folder, run.module, self.optimizer, self.plugins, progress)
        log.info(f"saved the training state after epoch {epoch} to {folder}")

    def _resume(self, run: _RunState) -> dict[str, Any] | None:
        """Load the checkpoint the run continues from; return this rank's random number generator state."""
        assert run.resume_folder is not None
        progress, rng = load_training_state(run.fabric, run.resume_folder, run.module, self.optimizer, self.plugins)
        run.batch_count, run.best_epoch_score, run.seed = progress.batch_count, progress.best_epoch_score, progress.seed
        if run.fabric.is_global_zero:
            keep_loss_rows_up_to(run.base_path / "loss.tsv", progress.epoch)
        log.info(f"resumed from {run.resume_folder} after epoch {progress.epoch} ({progress.batch_count} steps)")
        return rng

    def _caller_model(self) -> flair.nn.Model:
        """The model as the caller built it (under FSDP the trained copy is sharded and renamed)."""
        return self._sharded_copy.caller_model if self._sharded_copy is not None else self.model

    def _set_up_sharded_model_and_optimizer(self, fabric: Fabric, a: SimpleNamespace) -> _FabricModule:
        """Shard a copy of the model (the caller's model gets the weights back at the end), then build the optimizer
        over the shards."""
        self._sharded_copy = ShardedCopy(self.model)
        self.model = self._sharded_copy.working_model
        module = fabric.setup_module(self.model)
        module.mark_forward_method("forward_loss")
        a.kwargs["lr"] = a.learning_rate
        self.optimizer = fabric.setup_optimizers(self._make_optimizer(a.optimizer, a.decoder_learning_rate, a.kwargs))
        log.info(f"FSDP: this rank holds {held_bytes(self.model) / 2**20:.2f} MiB of parameters")
        return module

    def _set_up_deepspeed_model_and_optimizer(self, fabric: Fabric, a: SimpleNamespace) -> _FabricModule:
        """DeepSpeed wraps model and optimizer together and clips gradients inside its engine (ZeRO stage 1/2: the
        parameters stay whole, so flair saves and predicts with them as usual)."""
        assert isinstance(fabric.strategy, DeepSpeedStrategy) and fabric.strategy.config is not None
        fabric.strategy.config["gradient_clipping"] = a.max_grad_norm or 0.0
        a.kwargs["lr"] = a.learning_rate
        optimizer = self._make_optimizer(a.optimizer, a.decoder_learning_rate, a.kwargs)
        module, self.optimizer = fabric.setup(self.model, optimizer)
        module.mark_forward_method("forward_loss")
        return module

    def _train_epochs(self, run: _RunState) -> None:
        """flair's epoch loop with its interrupt handling; final-model.pt is written once."""
        a = run.args
        final_model = run.base_path / "final-model.pt"
        try:
            for epoch in range(a.epoch + 1, a.max_epochs + 1):
                train_loss, lr_info = self._train_epoch(run, epoch)
                log_line(log)
                log.info(f"EPOCH {epoch} done: loss {train_loss:.4f}{lr_info}")
                self.dispatch("after_training_epoch", epoch=epoch)
                self._agree_on_stopping()
                self._evaluate_epoch(run, epoch, train_loss)
                if run.checkpoint_every_n_epochs and epoch % run.checkpoint_every_n_epochs == 0:
                    self._save_training_state(run, epoch)

            self.dispatch("after_training_loop")
            if a.save_final_model:
                self._save_model(final_model, checkpoint=a.save_optimizer_state)

        except (KeyboardInterrupt, TrainingInterrupt) as stop:
            log_line(log)
            if isinstance(stop, TrainingInterrupt):
                log.info(str(stop))
                log_line(log)
            else:
                if str(stop):  # a signal agreed by the ranks (a plain Ctrl-C in one process has no message)
                    log.info(str(stop))
                log.info("Exiting from training early.")
            self.dispatch("training_interrupt")
            if a.save_final_model:
                log.info("Saving model ...")
                self._save_model(final_model, checkpoint=a.save_optimizer_state)
            log.info("Done.")

        except Exception:
            self.dispatch("_training_exception")
            raise
        finally:
            self.dispatch("_training_finally")

    def _make_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], decoder_learning_rate: float | None, kwargs: dict
    ) -> torch.optim.Optimizer:
        """flair's optimizer, with its separate decoder learning rate when one is given."""
        if not decoder_learning_rate:
            return optimizer_class(params=self.model.parameters(), **kwargs)
        named = list(self.model.named_parameters())
        params = [
            {"params": [p for name, p in named if "embeddings" not in name], "lr": decoder_learning_rate},
            {"params": [p for name, p in named if "embeddings" in name], "lr": kwargs["lr"]},
        ]
        log.info(
            f"Modifying learning rate to {decoder_learning_rate} for the following "
            f"parameters: {[name for name, _ in named if 'embeddings' not in name]}"
        )
        return optimizer_class(params=params, **kwargs)

    def _log_setup(self, run: _RunState, plugins: list) -> None:
        a, fabric = run.args, run.fabric
        final_eval_info = (
            "model after last epoch (final-model.pt)"
            if a.use_final_model_for_eval
            else "model from best epoch (best-model.pt)"
        )
        log_line(log)
        log.info(f'Model: "{self.model}"')
        log_line(log)
        log.info(f"{self.corpus}")
        log_line(log)
        log.info(f"Train:  {_len_dataset(run.train_data)} sentences")
        log.info(f"        (train_with_dev={a.train_with_dev}, train_with_test={a.train_with_test})")
        log_line(log)
        log.info("Training Params:")
        log.info(
            f' - learning_rate: "{a.learning_rate}" '
            f"{'(decoder: ' + str(a.decoder_learning_rate) + ')' if a.decoder_learning_rate else ''}"
        )
        log.info(f' - mini_batch_size: "{a.mini_batch_size}" per device')
        log.info(f' - global batch size: "{a.mini_batch_size * fabric.world_size}" ({fabric.world_size} process(es))')
        log.info(f' - max_epochs: "{a.max_epochs}"')
        log.info(f' - shuffle: "{run.shuffle}"')
        log_line(log)
        log.info("Plugins:")
        for plugin in plugins:
            log.info(" - " + str(plugin))
        log_line(log)
        log.info(f"Final evaluation on {final_eval_info}")
        log.info(f' - metric: "{a.main_evaluation_metric}"')
        log_line(log)
        log.info("Computation:")
        log.info(f" - compute on device: {fabric.device} (global rank 0 of {fabric.world_size})")
        log.info(f" - strategy: {type(fabric.strategy).__name__}, precision: {run.precision}")
        log.info(f" - embedding storage: {a.embeddings_storage_mode}")
        log_line(log)
        log.info(f'Model training base path: "{run.base_path}"')
        log_line(log)

    # --- one epoch ------------------------------------------------------------------------------------------------

    def _train_epoch(self, run: _RunState, epoch: int) -> tuple[float, str]:
        """Train one epoch; returns the global train loss and the last learning-rate log text."""
        fabric, a = run.fabric, run.args
        log_line(log)
        self._position.at("the agreement on stops at the start of the epoch", epoch, 0)
        self.dispatch("before_training_epoch", epoch=epoch)
        self._agree_on_stopping()
        self.model.model_card["training_parameters"]["epoch"] = epoch  # type: ignore[index]
        lr_info, _ = self._get_current_lr_and_momentum(run.batch_count)

        shuffle_this_epoch = run.shuffle and not (not a.shuffle_first_epoch and epoch == 1)
        batch_loader = train_loader(
            run.train_data,
            mini_batch_size=a.mini_batch_size,
            shuffle=shuffle_this_epoch,
            sampler=run.sampler,
            epoch=epoch,
            seed=run.seed,
            rank=fabric.global_rank,
            world_size=fabric.world_size,
        )
        self.model.train()
        epoch_loss = LossTracker(fabric.device)
        epoch_start_time = time.time()
        log_modulo = max(1, int(len(batch_loader) / 10))

        sampler = batch_loader.batch_sampler
        largest_batches = sampler.largest_batches if isinstance(sampler, ShardedBatchSampler) else None
        bar = EpochProgressBar(run.show_progress_bar, epoch, len(batch_loader))
        try:
            for batch_no, batch in enumerate(batch_loader):
                run.batch_count += 1
                self._position.at("forward and backward (the gradient collectives)", epoch, batch_no + 1)
                batch_kw = {
                    "batch_no": batch_no,
                    "batch": batch,
                    "total_number_of_batches": len(batch_loader),
                    "epoch": epoch,
                    "batch_count": run.batch_count,
                }
                largest_batch = largest_batches[batch_no] if largest_batches is not None else len(batch)
                batch_loss, gradient_norm = self._train_batch(run, batch, batch_kw, largest_batch)
                if batch_loss.data_points > 0:
                    self._record(MetricRecord.scalar(("train", "batch_loss"), batch_loss.mean(), run.batch_count))
                    if gradient_norm is not None:
                        self._record(MetricRecord.scalar(("train", "gradient_norm"), gradient_norm, run.batch_count))
                    epoch_loss.add(batch_loss.loss_sum, batch_loss.data_points)

                if (batch_no + 1) % log_modulo == 0:
                    self._position.at("the train loss all-reduce at a log point")
                    progress = self._global_loss(fabric, epoch_loss)
                    elapsed = time.time() - epoch_start_time
                    lr_info, momentum_info = self._get_current_lr_and_momentum(run.batch_count)
                    log.info(
                        f"epoch {epoch}"
                        f" - iter {batch_no + 1}/{len(batch_loader)}"
                        f" - loss {progress.mean:.8f}"
                        f" - time (sec): {elapsed:.2f}"
                        f" - samples/sec: {progress.data_points / elapsed:.2f}"
                        f"{lr_info}{momentum_info}"
                    )
                    bar.report(progress.mean, progress.data_points / elapsed)
                self.dispatch("after_training_batch", **batch_kw)
                bar.step()
        finally:
            bar.close()

        self._position.at("the train loss all-reduce at the end of the epoch")
        train_loss = self._global_loss(fabric, epoch_loss).mean
        self._record(MetricRecord.scalar(("train", "loss"), train_loss, epoch))
        return train_loss, lr_info

    def _global_loss(self, fabric: Fabric, loss: LossTracker) -> GlobalLoss:
        """The loss all-reduced over the ranks; with several processes the same collective is where the ranks
        agree on stops raised by plugins during the steps since the last one (no extra collective per step)."""
        if self._lockstep is None:
            return loss.global_loss(fabric)
        count = torch.tensor(loss.data_points, device=fabric.device)
        loss_sum, data_points = self._lockstep.agree(loss.loss_sum, count)
        return GlobalLoss.of(loss_sum, data_points)

    def _train_batch(
        self, run: _RunState, batch: list, batch_kw: dict, largest_batch: int
    ) -> tuple[LossTracker, torch.Tensor | None]:
        """Forward, backward (chunked, gradient sync on the last chunk only), clip and step for one mini-batch.

        Every rank runs as many chunks as the largest batch of this step has on any rank, and a chunk that learns
        nothing still takes part in the collectives (:mod:`flair_fabric.participation`)."""
        fabric, a, module = run.fabric, run.args, run.module
        assert self.optimizer is not None
        self.model.zero_grad()
        self.optimizer.zero_grad()
        self.dispatch("before_training_batch", **batch_kw)

        batch_loss = LossTracker(fabric.device)
        batch_steps = chunks_for_every_rank(batch, a.mini_batch_chunk_size, largest_batch)
        for batch_step_no, batch_step in enumerate(batch_steps):
            is_last_chunk = batch_step_no == len(batch_steps) - 1
            with fabric.no_backward_sync(module, enabled=not is_last_chunk):
                with fabric.autocast():
                    if run.participation is None:
                        loss, datapoint_count = module.forward_loss(batch_step)
                    else:
                        loss, datapoint_count = run.participation.loss(module.forward_loss, batch_step)
                batch_loss.add(loss, datapoint_count)
                # flair's losses are sums over data points; DDP averages gradients over ranks, so scaling by the
                # world size gives the gradient of the sum over all ranks' batches.
                self._backward(loss * fabric.world_size if fabric.world_size > 1 else loss)
            if run.dynamic_embeddings is None and batch_step:
                run.dynamic_embeddings = identify_dynamic_embeddings(batch)
            store_embeddings(batch_step, a.embeddings_storage_mode, run.dynamic_embeddings)

        self.dispatch("before_training_optimizer_step", **batch_kw)
        gradient_norm = None
        if a.max_grad_norm is not None and not isinstance(fabric.strategy, DeepSpeedStrategy):
            norm = fabric.clip_gradients(module, self.optimizer, max_norm=a.max_grad_norm, error_if_nonfinite=False)
            gradient_norm = whole_tensor(norm) if norm is not None else None
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        scale_before = scaler.get_scale() if scaler is not None else 1.0
        self.optimizer.step()
        scale_after = scaler.get_scale() if scaler is not None else 1.0
        batch_kw["optimizer_was_run"] = scale_before <= scale_after
        return batch_loss, gradient_norm

    def _evaluate_epoch(self, run: _RunState, epoch: int, train_loss: float) -> None:
        """Score the evaluation splits, choose the best model (identically on every rank) and save it once."""
        a = run.args
        self.model.eval()
        current_epoch_has_best_model_so_far = False
        validation_scores: tuple = ()

        for split, split_data in run.evaluation_splits.items():
            self._position.at(f"the evaluation of the {split} split", epoch, 0)
            with self._model_for_inference() as model:
                eval_result = self._evaluate_split(run, model, split, split_data)
            log.info(
                f"{split.upper()} : loss {eval_result.loss}"
                f" - {a.main_evaluation_metric[1]}"
                f" ({a.main_evaluation_metric[0]})"
                f"  {round(eval_result.main_score, 4)}"
            )
            self._publish_eval_result(eval_result, split, global_step=epoch)

            if run.determine_best_epoch_using_dev_score and split == "dev":
                validation_scores = eval_result.main_score, eval_result.loss
                if eval_result.main_score > run.best_epoch_score:
                    current_epoch_has_best_model_so_far = True
                    run.best_epoch_score = eval_result.main_score

        if not run.determine_best_epoch_using_dev_score:
            validation_scores = (train_loss,)
            if train_loss < run.best_epoch_score:
                current_epoch_has_best_model_so_far = True
                run.best_epoch_score = train_loss

        self.dispatch(
            "after_evaluation",
            epoch=epoch,
            current_model_is_best=current_epoch_has_best_model_so_far,
            validation_scores=validation_scores,
        )
        self._agree_on_stopping()
        if run.save_best_model and current_epoch_has_best_model_so_far:
            log.info("saving best model")
            self._save_model(run.base_path / "best-model.pt", checkpoint=a.save_optimizer_state)

    def _model_for_inference(self) -> contextlib.AbstractContextManager[flair.nn.Model]:
        """The model to evaluate: the trained model itself, or under FSDP the caller's model with the whole current
        weights on every rank (a collective)."""
        if self._sharded_copy is not None:
            return self._sharded_copy.gathered()
        return contextlib.nullcontext(self.model)

    def _evaluate_split(self, run: _RunState, model: flair.nn.Model, split: str, data: Dataset) -> Result:
        """flair's evaluation of one monitored split during training, split across the ranks."""
        a = run.args
        return evaluate_across_ranks(
            run.fabric,
            model,
            data,
            out_path=run.base_path / f"{split}.tsv",
            embeddings_storage_mode=a.embeddings_storage_mode,
            mini_batch_size=a.eval_batch_size,
            exclude_labels=a.exclude_labels,
            main_evaluation_metric=a.main_evaluation_metric,
            gold_label_dictionary=a.gold_label_dictionary_for_eval,
            embedding_storage_mode=a.embeddings_storage_mode,
            gold_label_type=self.model.label_type,
            gold_label_dictionary_for_eval=a.gold_label_dictionary_for_eval,
        )

    def _test_final_model(self, run: _RunState) -> None:
        """Load the best model on every rank (if there is one) and score the test split, as flair does."""
        a = run.args
        best_model = run.base_path / "best-model.pt"
        if self.corpus.test and not a.train_with_test:
            log_line(log)
            self.model.eval()
            if load_from_global_zero(run.fabric, self.model, best_model):
                log.info("Loading model from best epoch ...")
            else:
                log.info("Testing using last state of model ...")
            self._position.at("the final evaluation of the test split", 0, 0)
            with self._model_for_inference() as model:
                test_results = evaluate_across_ranks(
                    run.fabric,
                    model,
                    self.corpus.test,
                    out_path=run.base_path / "test.tsv",
                    gold_label_type=self.model.label_type,
                    mini_batch_size=a.eval_batch_size,
                    embedding_storage_mode="none",
                    main_evaluation_metric=a.main_evaluation_metric,
                    gold_label_dictionary=a.gold_label_dictionary_for_eval,
                    exclude_labels=a.exclude_labels,
                    return_loss=False,
                )
            log.info(test_results.detailed_results)
            log_line(log)
            self.return_values["test_score"] = test_results.main_score
        else:
            if load_from_global_zero(run.fabric, self.model, best_model):
                log.info("Loading model from best epoch ...")
            self.return_values["test_score"] = 0
            log.info("Test data not provided setting final score to 0")


@dataclass
class _WorkerJob:
    """What a spawned or forked rank needs to run the training."""

    trainer_class: type[FabricTrainer]
    model: flair.nn.Model
    corpus: Corpus
    args: SimpleNamespace
    fabric_args: dict


@dataclass
class _TrainedInWorker:
    """What the caller's model takes over from global rank 0's model after training in workers."""

    result: dict
    weights: dict[str, torch.Tensor]
    training: bool
    model_card: dict | None


def _train_in_worker(fabric: Fabric, job: _WorkerJob) -> _TrainedInWorker:
    """One spawned or forked rank: rebuild the trainer, train; return the results and the trained model's state."""
    trainer = job.trainer_class(job.model, job.corpus)
    trainer.fabric = fabric
    result = trainer._train_on_rank(fabric, job.args, job.fabric_args)
    model = trainer.model
    weights = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return _TrainedInWorker(as_plain_data(result), weights, model.training, as_plain_data(model.model_card))
