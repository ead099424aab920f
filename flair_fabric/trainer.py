"""``FabricTrainer``: flair's ``ModelTrainer`` with its training loop run by Lightning Fabric.

``train``, ``fine_tune`` and ``train_custom`` take flair's arguments unchanged plus Lightning's and flair-fabric's
(:data:`~flair_fabric.training.arguments.ADDED_PARAMETERS`). ``train_custom`` binds them into one frozen record,
checks everything before any process starts, builds a Fabric and starts the processes through the one launch path
(:func:`~flair_fabric.launch.workers.run_on_every_rank`); on each rank a
:class:`~flair_fabric.training.run.TrainingRun` runs flair's loop. This class keeps flair's signatures, the rank
properties plugins read, and flair's override points.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import flair
from flair.data import Corpus, _len_dataset
from flair.trainers import ModelTrainer
from flair.trainers.plugins import ReduceTransformerVocabPlugin, TrainingInterrupt
from lightning.fabric import Fabric
from torch.multiprocessing import ProcessExitedException
from torch.utils.data import Subset

from flair_fabric.distributed.lockstep import DEFERRED_EVENTS
from flair_fabric.distributed.stalls import explain_timeouts
from flair_fabric.launch.config import build_fabric, make_launch_config
from flair_fabric.launch.environment import restarted_by_torchrun
from flair_fabric.launch.workers import run_on_every_rank, starts_workers
from flair_fabric.state.model_files import check_writable_folder, load_from_global_zero, save_on_global_zero
from flair_fabric.state.policy import REQUEUE_EXIT_CODE, CheckpointPolicy
from flair_fabric.state.training_state import checkpoint_to_resume
from flair_fabric.strategies import training_strategy
from flair_fabric.training.arguments import FlairArguments, TrainArguments, with_flair_signature
from flair_fabric.training.checkpointing import Preempted
from flair_fabric.training.in_workers import TrainedInWorker, WorkerJob, take_final_model_written_since, train_in_worker
from flair_fabric.training.progress_bar import show_progress_bar
from flair_fabric.training.run import TrainingRun
from flair_fabric.training.setup import sample_on_global_zero

log = logging.getLogger("flair")


class FabricTrainer(ModelTrainer):
    """flair's :class:`~flair.trainers.ModelTrainer`, trained through Lightning Fabric on one or many devices.

    Use it exactly like ``ModelTrainer``; ``train``, ``fine_tune`` and ``train_custom`` also take ``accelerator``,
    ``devices``, ``num_nodes``, ``strategy``, ``precision``, ``progress_bar``, ``checkpoint_every_n_epochs``,
    ``resume_from``, ``collective_timeout`` and ``balance_batches``. ``devices=2`` in an ordinary script is enough:
    the script is relaunched once per extra device by Fabric, or left alone when ``torchrun`` started it.
    """

    def __init__(self, model: flair.nn.Model, corpus: Corpus) -> None:
        super().__init__(model, corpus)
        self._run: TrainingRun | None = None
        self._fabric: Fabric | None = None  # the last run's: a relaunched script asks for its rank after training

    # --- the run's topology, for plugins (flair_fabric.plugins.interface.DistributedTrainer) --------------------

    @property
    def fabric(self) -> Fabric | None:
        """The run's Fabric (collectives for plugins); after a run, its last one; ``None`` before any run in this
        process (and in the caller of spawned or forked workers, which is no rank)."""
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

    def save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        """Write the model being trained once, from global rank 0 (a sharded model is consolidated first)."""
        assert self._run is not None, "save_model is for use during a run"
        self._run.position.at(f"saving {Path(model_file).name}")
        save_on_global_zero(self._run.fabric, self.model, model_file, checkpoint)

    def load_model(self, model_file: str | Path) -> bool:
        """Load ``model_file`` (read on global rank 0) into the model on every rank; whether the file existed."""
        assert self._run is not None, "load_model is for use during a run"
        return load_from_global_zero(self._run.fabric, self.model, model_file)

    # --- flair's public entry points ----------------------------------------------------------------------------

    @with_flair_signature(ModelTrainer.train)
    def train(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        return super().train(base_path, *args, **kwargs)

    @with_flair_signature(ModelTrainer.fine_tune)
    def fine_tune(self, base_path: Any, *args: Any, **kwargs: Any) -> dict:
        return super().fine_tune(base_path, *args, **kwargs)

    @with_flair_signature(ModelTrainer.train_custom)
    def train_custom(
        self,
        base_path: Any,
        *args: Any,
        accelerator: str = "auto",
        devices: Any = "auto",
        num_nodes: int = 1,
        strategy: Any = "auto",
        precision: str | int | None = None,
        progress_bar: bool | None = None,
        checkpoint_every_n_epochs: int = 0,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_every_n_minutes: float | None = None,
        keep_checkpoints: int = 1,
        requeue_signal: Any = signal.SIGUSR1,
        resume_from: str | Path | None = None,
        collective_timeout: Any = None,
        balance_batches: bool = True,
        **kwargs: Any,
    ) -> dict:
        flair_arguments = FlairArguments.bind(self, base_path, *args, **kwargs)
        if not isinstance(balance_batches, bool):
            raise ValueError(
                f"balance_batches={balance_batches!r} is not valid: pass True (each step dealt by length) or False"
                " (strided shards)."
            )
        if flair_arguments.multi_gpu:
            raise ValueError(
                "multi_gpu=True is flair's own multi-GPU mode; FabricTrainer starts the processes itself:"
                " pass devices=N (and strategy=...) instead of multi_gpu=True."
            )
        launch = make_launch_config(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
            use_amp=flair_arguments.use_amp,
            collective_timeout=collective_timeout,
        )
        checkpoints = CheckpointPolicy.checked(
            every_n_epochs=checkpoint_every_n_epochs,
            every_n_steps=checkpoint_every_n_steps,
            every_n_minutes=checkpoint_every_n_minutes,
            keep=keep_checkpoints,
            requeue_signal=requeue_signal,
        )
        if resume_from is None and restarted_by_torchrun():
            resume_from = "auto"  # an elastic restart continues from the last checkpoint
        resume_folder, start_epoch = checkpoint_to_resume(
            self.model, flair_arguments.base_path, flair_arguments.epoch, resume_from
        )
        arguments = TrainArguments(
            flair=flair_arguments,
            launch=launch,
            progress_bar=show_progress_bar(progress_bar, is_global_zero=True),
            checkpoints=checkpoints,
            resume_folder=resume_folder,
            start_epoch=start_epoch,
            balance_batches=balance_batches,
        )
        fabric = build_fabric(launch)
        self._check_run(arguments, fabric)
        preemption = checkpoints.requeue_signal
        if not starts_workers(fabric):
            return run_on_every_rank(fabric, self.train_on_rank, arguments, launch.collective_timeout, preemption)
        # spawned or forked workers train copies: the caller's model then becomes what rank 0's model is at the end
        job = WorkerJob(type(self), self.model, self.corpus, arguments)
        started = time.time()
        try:
            trained = run_on_every_rank(
                fabric, train_in_worker, job, launch.collective_timeout, preemption, result_types=[TrainedInWorker]
            )
        except KeyboardInterrupt:
            take_final_model_written_since(self.model, flair_arguments.base_path, started)
            raise
        except ProcessExitedException as exited:
            if exited.exit_code == REQUEUE_EXIT_CODE:  # the workers were preempted and wrote their checkpoint
                raise SystemExit(REQUEUE_EXIT_CODE) from None
            raise
        return trained.hand_to(self.model)

    def _check_run(self, arguments: TrainArguments, fabric: Fabric) -> None:
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
        training_strategy(fabric.strategy).check_run(
            reduces_vocabulary=reduces_vocabulary, mini_batch_chunk_size=a.mini_batch_chunk_size
        )
        if size < arguments.launch.world_size:
            raise ValueError(
                f"the train split has {size} data point(s) for {arguments.launch.world_size} processes: every process"
                " needs at least one; use fewer devices or more training data."
            )

    def train_on_rank(self, fabric: Fabric, arguments: TrainArguments) -> dict:
        """flair's ``train_custom`` on one rank (called by the launch path); every rank returns rank 0's values."""
        self._fabric = fabric
        self._run = run = TrainingRun(self, fabric, arguments)
        try:
            with explain_timeouts(fabric, run.position, arguments.collective_timeout):
                return run.run()
        except Preempted as preempted:
            raise SystemExit(run.checkpointing.requeue(str(preempted))) from None
        finally:
            self._run = None

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
