"""``FabricTrainer``: flair's ``ModelTrainer`` with its training loop run by Lightning Fabric.

``train``, ``fine_tune`` and ``train_custom`` take flair's arguments plus Lightning's and flair-fabric's (declared
once in :class:`~flair_fabric.launch.arguments.LightningArguments` and :class:`~flair_fabric.training.options.
TrainingOptions`). ``train_custom`` binds them into frozen records, checks everything before any process starts and
hands one :class:`~flair_fabric.training.job.TrainingJob` to the job runner (:func:`~flair_fabric.launch.runner.
run_job`); on each rank a :class:`~flair_fabric.training.run.TrainingRun` runs flair's loop. This class keeps
flair's signatures, the rank properties plugins read, and flair's override points."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flair
from flair.data import Corpus, _len_dataset
from flair.trainers import ModelTrainer
from flair.trainers.plugins import ReduceTransformerVocabPlugin, TrainingInterrupt
from lightning.fabric import Fabric
from torch.utils.data import Subset

from flair_fabric.distributed.lockstep import DEFERRED_EVENTS
from flair_fabric.launch.config import make_launch_config
from flair_fabric.launch.runner import run_job
from flair_fabric.plugins.ray_report import CHECKPOINT_SAVED
from flair_fabric.state.model_files import check_writable_folder
from flair_fabric.state.policy import CheckpointPolicy
from flair_fabric.strategies import training_strategy
from flair_fabric.training.arguments import FlairArguments, TrainArguments, split_added_arguments, with_flair_signature
from flair_fabric.training.batch_sizes import check_batch_options, mini_batch_size_left_to_global, resolve_batch_sizes
from flair_fabric.training.continuing import checkpoint_to_continue, run_store
from flair_fabric.training.evaluating import steps_between_evaluations
from flair_fabric.training.job import TrainingJob
from flair_fabric.training.progress_bar import show_progress_bar
from flair_fabric.training.run import TrainingRun
from flair_fabric.training.sampling import steps_per_epoch
from flair_fabric.training.setup import sample_on_global_zero


class FabricTrainer(ModelTrainer):
    """flair's :class:`~flair.trainers.ModelTrainer`, trained through Lightning Fabric on one or many devices.

    Use it exactly like ``ModelTrainer``; ``train``, ``fine_tune`` and ``train_custom`` also take Lightning's
    arguments (``accelerator``, ``devices``, ``num_nodes``, ``strategy``, ``precision``, ``collective_timeout``) and
    flair-fabric's (checkpoints and resume, ``balance_batches``, ``val_check_interval``, ...; the README's table lists
    them all). ``devices=2`` in a script is enough: Fabric relaunches it per extra device (not under ``torchrun``).
    """

    valid_events = ModelTrainer.valid_events | {CHECKPOINT_SAVED}  # a checkpoint is complete (the Ray report's)

    def __init__(self, model: flair.nn.Model, corpus: Corpus) -> None:
        super().__init__(model, corpus)
        self._run: TrainingRun | None = None
        self._fabric: Fabric | None = None  # the last run's: a relaunched script asks for its rank after training

    # --- the run's topology, for plugins (flair_fabric.plugins.interface.DistributedTrainer) --------------------

    @property
    def fabric(self) -> Fabric | None:
        """The run's Fabric (collectives for plugins), the last run's after it; ``None`` before a run, in a caller."""
        return self._fabric

    @property
    def global_rank(self) -> int:
        """Rank of this process among all processes of the run (0 where there is none)."""
        return self._fabric.global_rank if self._fabric is not None else 0

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine (0 where there is none)."""
        return self._fabric.local_rank if self._fabric is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes of the run (1 where there is none)."""
        return self._fabric.world_size if self._fabric is not None else 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0, the process that writes logs and model files."""
        return self.global_rank == 0

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps each rank runs per epoch (0 outside a run)."""
        return self._run.steps_per_epoch if self._run is not None else 0

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the run so far, a resumed run's earlier ones included (0 outside a run)."""
        return self._run.progress.batch_count if self._run is not None else 0

    def save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        """Write the model being trained once, from global rank 0 (a sharded model is consolidated first)."""
        assert self._run is not None, "save_model is for use during a run"
        self._run.save_model(model_file, checkpoint)

    def load_model(self, model_file: str | Path) -> bool:
        """Load ``model_file`` (read on global rank 0) into the model on every rank; whether the file existed."""
        assert self._run is not None, "load_model is for use during a run"
        return self._run.load_model(model_file)

    # --- flair's public entry points ----------------------------------------------------------------------------

    @with_flair_signature(ModelTrainer.train)
    def train(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        return super().train(base_path, *args, **mini_batch_size_left_to_global(ModelTrainer.train, args, kwargs))

    @with_flair_signature(ModelTrainer.fine_tune)
    def fine_tune(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        kwargs = mini_batch_size_left_to_global(ModelTrainer.fine_tune, args, kwargs)
        return super().fine_tune(base_path, *args, **kwargs)

    @with_flair_signature(ModelTrainer.train_custom)
    def train_custom(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        kwargs = mini_batch_size_left_to_global(ModelTrainer.train_custom, args, kwargs)
        lightning, options, flair_kwargs = split_added_arguments(dict(kwargs))
        options.check()
        store = run_store(base_path, options.storage_options)
        bound = FlairArguments.bind(self, store.local if store else base_path, *args, **flair_kwargs)
        flair_arguments, auto_chunks = bound.without_automatic_chunks()
        if flair_arguments.multi_gpu:
            raise ValueError(
                "multi_gpu=True is flair's own multi-GPU mode; FabricTrainer starts the processes itself:"
                " pass devices=N (and strategy=...) instead of multi_gpu=True."
            )
        launch = make_launch_config(**lightning.as_dict(), use_amp=flair_arguments.use_amp)
        flair_arguments, global_batch_size = resolve_batch_sizes(
            flair_arguments, options.global_batch_size, launch.world_size
        )
        checkpoints = CheckpointPolicy.checked(
            every_n_epochs=options.checkpoint_every_n_epochs,
            every_n_steps=options.checkpoint_every_n_steps,
            every_n_minutes=options.checkpoint_every_n_minutes,
            keep=options.keep_checkpoints,
            requeue_signal=options.requeue_signal,
        )
        resume_folder, start_epoch = checkpoint_to_continue(
            self.model, store, flair_arguments.base_path, flair_arguments.epoch, options.resume_from
        )
        arguments = TrainArguments(
            flair=flair_arguments,
            launch=launch,
            progress_bar=show_progress_bar(options.progress_bar, is_global_zero=True),
            checkpoints=checkpoints,
            resume_folder=resume_folder,
            start_epoch=start_epoch,
            global_batch_size=global_batch_size,
            global_batch_size_given=options.global_batch_size is not None,
            group_by_length=options.group_by_length,
            group_by_length_window=options.group_by_length_window,
            balance_batches=options.balance_batches,
            val_check_interval=options.val_check_interval,
            chunks_on_out_of_memory=auto_chunks,
            store=store,
            save_adapters=options.save_adapters,
        )
        self._check_run(arguments)
        return run_job(TrainingJob(self, arguments), launch)

    def _check_run(self, arguments: TrainArguments) -> None:
        """Refuse, before any process starts, what cannot train."""
        a = arguments.flair
        if self.corpus.train is None:
            raise ValueError("the corpus has no train split: FabricTrainer needs training data (corpus.train).")
        check_writable_folder(a.base_path)
        size = _len_dataset(self._get_train_data(a.train_with_dev, a.train_with_test))
        if size == 0:
            raise ValueError("the train split is empty: FabricTrainer needs at least one training data point.")
        reduces_vocabulary = a.reduce_transformer_vocab or any(
            isinstance(plugin, ReduceTransformerVocabPlugin) for plugin in a.plugins or []
        )
        chunk_size = "auto" if arguments.chunks_on_out_of_memory else a.mini_batch_chunk_size
        training_strategy(arguments.launch.strategy).check_run(
            reduces_vocabulary=reduces_vocabulary, mini_batch_chunk_size=chunk_size
        )
        if size < arguments.launch.world_size:
            raise ValueError(
                f"the train split has {size} data point(s) for {arguments.launch.world_size} processes: every process"
                " needs at least one; use fewer devices or more training data."
            )
        check_batch_options(arguments)
        steps = steps_per_epoch(size, arguments.global_batch_size)
        steps_between_evaluations(arguments.val_check_interval, steps)  # refused here if it does not fit an epoch

    def attach_run(self, fabric: Fabric, run: TrainingRun | None) -> None:
        """The run this trainer is in on this rank (``None`` after it); its Fabric stays for the rank properties."""
        self._fabric, self._run = fabric, run

    # --- flair's override points --------------------------------------------------------------------------------

    def _sample_train_split(self, monitor_train_sample: float | int) -> Subset:
        """flair's random train sample for ``monitor_train_sample``, drawn on global rank 0 and the same on every rank
        (sharded evaluation needs the same data on all ranks; their ``random`` states may differ)."""
        sample = super()._sample_train_split(monitor_train_sample)
        return sample_on_global_zero(self._run.fabric, sample) if self._run is not None else sample

    def dispatch(self, event: str, *args: Any, **kwargs: Any) -> None:
        """flair's event dispatch; with several processes a plugin's ``TrainingInterrupt`` inside the epoch loop waits
        for the next point where all ranks agree to stop (see :mod:`flair_fabric.distributed.lockstep`)."""
        lockstep = self._run.lockstep if self._run is not None and self.world_size > 1 else None
        if lockstep is None or event not in DEFERRED_EVENTS:
            return super().dispatch(event, *args, **kwargs)
        try:
            super().dispatch(event, *args, **kwargs)
        except TrainingInterrupt as stop:
            lockstep.hold(stop)

    def _backward(self, loss: Any) -> None:
        """Backward through Fabric (precision, gradient scaler, strategy); plugins may still override it."""
        assert self._run is not None
        self._run.fabric.backward(loss)

    def _save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        self.save_model(model_file, checkpoint)

    def _load_model(self, model_file: str | Path) -> None:
        self.load_model(model_file)
