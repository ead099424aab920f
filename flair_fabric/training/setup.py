"""A run's set-up, in flair's order: plugins, the model card, the training data and the splits to evaluate, the
optimizer flair would build. Every rank does it alike; writers are made on global rank 0 only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import flair
import torch
from flair.data import Corpus, _len_dataset
from flair.samplers import FlairSampler
from flair.trainers.plugins import Pluggable, TrainerPlugin
from flair.training_utils import log_line
from lightning.fabric import Fabric
from torch.utils.data import Dataset, Subset

from flair_fabric.data.stored import builds_anew
from flair_fabric.launch.ray_train import ray_train_context
from flair_fabric.plugins.flair_fixes import attach_builtin_plugins, for_world_size, release_unattached
from flair_fabric.plugins.ray_report import RayReportPlugin
from flair_fabric.strategies import strategy_name
from flair_fabric.training.arguments import FlairArguments, TrainArguments
from flair_fabric.training.interface import FlairTrainer
from flair_fabric.training.optimizer_implementation import build_optimizer

log = logging.getLogger("flair")


@dataclass(frozen=True)
class TrainingData:
    """What a run trains on and evaluates, as flair's ``train_custom`` decides it."""

    train: Dataset
    sampler: FlairSampler | None
    shuffle: bool
    evaluation_splits: dict[str, Dataset]
    best_by_dev_score: bool
    """Whether the best epoch is chosen by the dev score (else by the train loss)."""
    save_best_model: bool

    @property
    def size(self) -> int:
        """Data points in the train split."""
        return _len_dataset(self.train)


def attach_plugins(
    trainer: FlairTrainer, fabric: Fabric, arguments: TrainArguments, step_of: Callable[[], int]
) -> list[TrainerPlugin]:
    """The user's plugins (flair's fixed for several processes where needed) and the ones flair adds itself, attached
    in flair's order; returns the user's plugins as attached. ``step_of``: the run's optimizer step now (for
    ``loss.tsv`` rows of evaluations inside epochs)."""
    flair_arguments = arguments.flair
    plugins = for_world_size(flair_arguments.plugins or [], fabric.world_size, arguments.global_batch_size_given)
    for plugin in plugins:
        plugin.attach_to(cast(Pluggable, trainer))  # flair's: global rank 0 only for attach_to_all_processes=False
    release_unattached(plugins)
    attach_builtin_plugins(
        trainer,
        fabric,
        flair_arguments.base_path,
        create_file_logs=flair_arguments.create_file_logs,
        create_loss_file=flair_arguments.create_loss_file,
        write_weights=flair_arguments.write_weights,
        reduce_transformer_vocab=flair_arguments.reduce_transformer_vocab,
        save_model_each_k_epochs=flair_arguments.save_model_each_k_epochs,
        save_optimizer_state=flair_arguments.save_optimizer_state,
        epoch=arguments.start_epoch,
        loss_rows_by_step=step_of if arguments.val_check_interval is not None else None,
    )
    if ray_train_context() is not None:  # every rank reports checkpoints and metrics to Ray Train
        RayReportPlugin().attach_to(cast(Pluggable, trainer))
    return plugins


def training_data(trainer: FlairTrainer, corpus: Corpus, arguments: FlairArguments) -> TrainingData:
    """flair's choice of training data, sampler and evaluation splits."""
    train = trainer._get_train_data(train_with_dev=arguments.train_with_dev, train_with_test=arguments.train_with_test)
    splits: dict[str, Dataset] = {}
    if not arguments.train_with_dev and corpus.dev:
        splits["dev"] = corpus.dev
    if corpus.test and arguments.monitor_test:
        splits["test"] = corpus.test
    if arguments.monitor_train_sample > 0.0:
        splits["train_sample"] = trainer._sample_train_split(arguments.monitor_train_sample)
    sampler, shuffle = arguments.sampler, arguments.shuffle
    if sampler is not None:
        if isinstance(sampler, type):
            sampler = sampler()
        sampler.set_dataset(train)
        shuffle = False
    return TrainingData(
        train=train,
        sampler=sampler,
        shuffle=shuffle,
        evaluation_splits=splits,
        best_by_dev_score=bool(not arguments.train_with_dev and corpus.dev),
        save_best_model=not arguments.train_with_dev and not arguments.use_final_model_for_eval,
    )


def sample_on_global_zero(fabric: Fabric, sample: Subset) -> Subset:
    """flair's random train sample as global rank 0 drew it, on every rank (sharded evaluation needs the same data on
    all ranks; their ``random`` states may differ)."""
    if fabric.world_size == 1:
        return sample
    return Subset(sample.dataset, fabric.broadcast(list(sample.indices), src=0))


def make_optimizer(model: flair.nn.Model, arguments: FlairArguments) -> torch.optim.Optimizer:
    """flair's optimizer for ``model``, with its separate decoder learning rate when one is given."""
    optimizer_arguments = arguments.optimizer_arguments
    if not arguments.decoder_learning_rate:
        return build_optimizer(arguments.optimizer, model.parameters(), optimizer_arguments)
    named = list(model.named_parameters())
    params = [
        {"params": [p for name, p in named if "embeddings" not in name], "lr": arguments.decoder_learning_rate},
        {"params": [p for name, p in named if "embeddings" in name], "lr": optimizer_arguments["lr"]},
    ]
    log.info(
        f"Modifying learning rate to {arguments.decoder_learning_rate} for the following "
        f"parameters: {[name for name, _ in named if 'embeddings' not in name]}"
    )
    return build_optimizer(arguments.optimizer, params, optimizer_arguments)


def log_setup(
    model: flair.nn.Model,
    corpus: Corpus,
    fabric: Fabric,
    arguments: TrainArguments,
    data: TrainingData,
    plugins: list[TrainerPlugin],
    dealt_by_length: bool,
) -> None:
    """flair's set-up log, with the processes, the strategy and how steps are dealt to the ranks added."""
    a = arguments.flair
    final_eval_info = (
        "model after last epoch (final-model.pt)"
        if a.use_final_model_for_eval
        else "model from best epoch (best-model.pt)"
    )
    log_line(log)
    log.info(f'Model: "{model}"')
    log_line(log)
    log.info(f"{corpus}")
    log_line(log)
    log.info(f"Train:  {data.size} sentences")
    log.info(f"        (train_with_dev={a.train_with_dev}, train_with_test={a.train_with_test})")
    log_line(log)
    log.info("Training Params:")
    log.info(
        f' - learning_rate: "{a.learning_rate}" '
        f"{'(decoder: ' + str(a.decoder_learning_rate) + ')' if a.decoder_learning_rate else ''}"
    )
    size, processes = arguments.global_batch_size, fabric.world_size
    shares = f"{size // processes} or {a.mini_batch_size}" if size % processes else f"{a.mini_batch_size}"
    log.info(f' - mini_batch_size: "{shares}" per device')
    log.info(f' - global batch size: "{size}" ({processes} process(es))')
    if fabric.world_size > 1:
        dealt = "each step's data points dealt by length" if dealt_by_length else "strided shards"
        log.info(f' - balance_batches: "{arguments.balance_batches}" ({dealt})')
    log.info(f' - max_epochs: "{a.max_epochs}"')
    log.info(f' - shuffle: "{data.shuffle}"')
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
    log.info(f" - strategy: {strategy_name(fabric.strategy)}, precision: {arguments.launch.precision}")
    log.info(f" - embedding storage: {a.embeddings_storage_mode}")
    log_line(log)
    log.info(f'Model training base path: "{a.base_path}"')
    log_line(log)


def clear_stored_embeddings(corpus: Corpus) -> None:
    """Drop the embeddings flair stored on the corpus' data points (``embeddings_storage_mode``).

    A run in another precision than ``32-true`` stores them in its own dtype, and a later run on the same corpus
    (another precision, another model) would read them back and fail (``mat1 and mat2 must have the same dtype``);
    stored float32 embeddings would fail a ``"-true"`` run the same way."""
    for split in (corpus.train, corpus.dev, corpus.test):  # by index: a DataLoader would draw a random seed
        if builds_anew(split):  # (a mapped split's data points are new at every read: nothing is stored on them)
            continue
        for index in range(_len_dataset(split) if split is not None else 0):
            split[index].clear_embeddings()  # type: ignore[index]


def base_path_ready(base_path: Path) -> Path:
    """The output folder, created if needed."""
    base_path.mkdir(exist_ok=True, parents=True)
    return base_path
