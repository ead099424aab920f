"""flair's ``LanguageModelTrainer.train`` loop on one rank, through Fabric, on the shared safety nets of the training
run.

What changes against flair's loop, and why:

- Every split is batchified into ``N·b`` columns and the rank trains its ``b`` (:mod:`.columns`); the model is
  wrapped by Fabric (DDP averages the gradients), the forward pass runs under Fabric's precision, gradients are
  clipped by Fabric (unscaled first under ``16-mixed``).
- The ranks start from the generators of the caller's ``train`` call and consume them alike (the same split files in
  the same order, the same line shuffles and case flips, the same generated sample text): they read the same data.
  Before training the ranks compare fingerprints of their corpus and model (a difference is refused on every rank).
- Validation and test perplexity: each rank scores its columns, one all-reduce gives flair's single-process value.
  The learning rate schedule, ``best-lm.pt`` and stopping are thus decided identically on every rank; files and the
  log are written by global rank 0 only, and the other ranks wait for its writes on the patient group.
- ``checkpoint=True`` keeps flair's ``checkpoint.pt`` and also writes the run's state after every split in the
  checkpoint format of ``FabricTrainer`` (``base_path/checkpoints/step-<splits>/``), from which ``resume_from``
  continues exactly: the split files already trained in the epoch are skipped, the generators, optimizer, scheduler
  and grown sequence length restored.
- Ctrl-C (or SIGTERM) on any rank is held and agreed at the next log point or split end (the lockstep agreement of
  the training run); every rank stops there and, as in flair, the test split is scored. A collective that times out
  names the rank, the split and the step.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from flair.models import LanguageModel
from flair.optim import SGDW, ReduceLRWDOnPlateau
from flair.trainers.language_model_trainer import TextCorpus
from flair.training_utils import add_file_handler
from lightning.fabric import Fabric
from torch.optim import AdamW
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from flair_fabric.distributed.fingerprints import check_ranks_agree, model_fingerprint, text_corpus_fingerprint
from flair_fabric.distributed.lockstep import AgreedInterrupt, Lockstep
from flair_fabric.distributed.stalls import Position, wait_for_global_zero
from flair_fabric.language_model.arguments import LanguageModelArguments
from flair_fabric.language_model.columns import rank_columns
from flair_fabric.launch.failures import graceful_interrupts
from flair_fabric.state.model_files import write_atomically
from flair_fabric.state.run_state import RunState
from flair_fabric.state.training_state import (
    load_training_state,
    resume_folder_of_global_zero,
    rng_state,
    save_training_state,
    set_rng_state,
)
from flair_fabric.strategies import training_strategy
from flair_fabric.training.optimizer_implementation import build_optimizer

log = logging.getLogger("flair")

SCHEDULER = "ReduceLROnPlateau#0"
"""The key of the plateau schedule in a checkpoint (the training run keys schedulers by flair's plugin class)."""


class LanguageModelTrainerSide(Protocol):
    """What the loop uses of flair's ``LanguageModelTrainer`` (and of flair's resume state it was built with)."""

    model: LanguageModel
    corpus: TextCorpus
    optimizer: type[torch.optim.Optimizer]
    optimizer_state: dict | None
    scaler_state: dict | None
    loss: float
    epoch: int
    split: int
    log_interval: int
    loss_function: Any

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float: ...

    def _get_batch(self, source: torch.Tensor, i: int, sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _repackage_hidden(self, h: Any) -> Any: ...


@dataclass
class LanguageModelState:
    """What a language-model checkpoint holds besides the model, optimizer, schedule and the run-state record."""

    sequence_length: int
    """The grown sequence length (``grow_to_sequence_length``)."""
    global_batch: int
    """Columns of the run that wrote it (``mini_batch_size`` x processes): a resume must have as many."""
    epoch_generators: dict[str, Any] = field(default_factory=dict)
    """The generators the epoch's reading started from (its file order and line shuffles)."""


class LanguageModelRun:
    """One rank's language-model training; ``run()`` trains, then scores the test split."""

    def __init__(
        self,
        trainer: LanguageModelTrainerSide,
        fabric: Fabric,
        arguments: LanguageModelArguments,
        position: Position | None = None,
    ) -> None:
        self.trainer, self.fabric, self.arguments = trainer, fabric, arguments
        self.model: LanguageModel = trainer.model
        self.position = position or Position()
        self.progress = RunState(trainer.epoch, 0, trainer.loss, fabric.world_size)
        self.lockstep = Lockstep(fabric, self.progress.flags)
        self.sequence_length = arguments.sequence_length
        self.split_started = time.time()

    # --- data ---------------------------------------------------------------------------------------------------

    def columns(self, text: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``text``."""
        a, fabric = self.arguments, self.fabric
        return rank_columns(text, a.mini_batch_size, fabric.global_rank, fabric.world_size)

    def score(self, text: torch.Tensor) -> float:
        """flair's loss per character of ``text`` batchified over all columns, computed across the ranks."""
        columns = self.columns(text)
        rank_loss = self.trainer.evaluate(columns, self.arguments.mini_batch_size, self.sequence_length)
        total = torch.tensor(rank_loss, dtype=torch.float64, device=self.fabric.device)
        return float(cast(torch.Tensor, self.fabric.all_reduce(total, reduce_op="mean")).item())

    def held_out_text_of_global_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The validation and test text as global rank 0 read them. flair flips the case of some lines when a
        ``TextCorpus`` is made, so ranks that made their own corpus (the script relaunch) may hold other text."""
        held_out = (self.trainer.corpus.valid, self.trainer.corpus.test)
        return cast(tuple[torch.Tensor, torch.Tensor], self.fabric.broadcast(held_out, src=0))

    # --- the run ------------------------------------------------------------------------------------------------

    def run(self) -> None:
        a, fabric, trainer = self.arguments, self.fabric, self.trainer
        fingerprints = {"corpus": text_corpus_fingerprint(trainer.corpus), "model": model_fingerprint(self.model)}
        check_ranks_agree(fabric, fingerprints)
        start_from_the_callers_generators(fabric, a.generators)
        val_data, self.test_data = self.held_out_text_of_global_zero()
        options = {"lr": a.learning_rate, **a.optimizer_options}  # flair's optimizer class; every one of them takes lr
        optimizer = build_optimizer(trainer.optimizer, self.model.parameters(), options)
        if trainer.optimizer_state is not None:
            optimizer.load_state_dict(trainer.optimizer_state)
        scheduler_class = ReduceLRWDOnPlateau if isinstance(optimizer, AdamW | SGDW) else ReduceLROnPlateau
        scheduler = scheduler_class(optimizer, factor=a.anneal_factor, patience=a.patience)
        module, optimizer = fabric.setup(self.model, optimizer)
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        if trainer.scaler_state and scaler is not None:  # flair's checkpoint of a use_amp run
            scaler.load_state_dict(trainer.scaler_state)
        resume_folder = resume_folder_of_global_zero(fabric, a.resume_folder)
        resumed = self.restore(resume_folder, module, optimizer, scheduler) if resume_folder is not None else None
        log_handler = add_file_handler(log, a.base_path / "training.log") if fabric.is_global_zero else None
        try:
            with graceful_interrupts(self.lockstep.interrupt):
                self.train_epochs(module, optimizer, scheduler, val_data, resumed)
        except AgreedInterrupt as stop:  # agreed by every rank (in one process: this one's, held until here)
            log.info("-" * 89)
            if str(stop):
                log.info(str(stop))
            log.info("Exiting from training early")
        finally:
            if log_handler is not None:
                log_handler.close()
                log.removeHandler(log_handler)
        self.position.at("the test perplexity all-reduce")
        test_loss = self.score(self.test_data)  # with the last model, as flair does
        self.write_summary(f"TEST: valid loss {test_loss:5.4f} | valid ppl {math.exp(test_loss):8.4f}")
        log.info("-" * 89)

    def restore(
        self, folder: Path, module: Any, optimizer: Any, scheduler: ReduceLROnPlateau
    ) -> tuple[RunState, dict[str, Any]]:
        """Continue from the checkpoint in ``folder``: model, optimizer, schedule, scaler, sequence length, best
        validation loss; returns the saved record and every rank's generators."""
        self.position.at("reading the checkpoint")
        training_strategy(self.fabric.strategy).load_checkpoint(self.fabric, folder / "state.ckpt", module, optimizer)
        saved, every_rank, extras = load_training_state(self.fabric, folder, {SCHEDULER: scheduler})
        state = LanguageModelState(**extras)
        if state.global_batch != self.arguments.global_batch:
            fits = state.global_batch // self.fabric.world_size
            raise ValueError(
                f"the checkpoint was trained on {state.global_batch} columns (mini_batch_size x processes), this run"
                f" has {self.arguments.global_batch}: pass mini_batch_size={fits} or resume on the number of processes"
                " it had."
            )
        self.sequence_length, self.progress.best_epoch_score = state.sequence_length, saved.best_epoch_score
        self.progress.batch_count = saved.batch_count
        log.info(f"resuming after split {saved.step_in_epoch} of epoch {saved.epoch + 1}")
        return saved, {"epoch_generators": state.epoch_generators, "generators": every_rank[0]["rng"]}

    def train_epochs(
        self,
        module: Any,
        optimizer: Any,
        scheduler: ReduceLROnPlateau,
        val_data: torch.Tensor,
        resumed: tuple[RunState, dict[str, Any]] | None,
    ) -> None:
        a, trainer = self.arguments, self.trainer
        first_epoch = resumed[0].epoch if resumed is not None else trainer.epoch
        number_of_splits = len(trainer.corpus.train)
        for epoch in range(first_epoch, a.max_epochs):
            epoch_start_time = time.time()
            loader = DataLoader(trainer.corpus.train, shuffle=epoch > 0, num_workers=a.num_workers)
            if epoch > 0 and resumed is None:
                self.position.at(f"saving epoch_{epoch}.pt", epoch + 1, 0)
                if self.fabric.is_global_zero:
                    self.save_flair_checkpoint(a.base_path / f"epoch_{epoch}.pt", optimizer, epoch, 0)
                wait_for_global_zero(self.fabric)
            splits = self.splits_of_epoch(loader, epoch, resumed)
            resumed = None
            for split_number, epoch_generators, train_slice in splits:
                self.train_split(module, optimizer, train_slice.flatten(), epoch, split_number, number_of_splits)
                self.end_split(
                    module, optimizer, scheduler, val_data, epoch, split_number, number_of_splits, epoch_generators
                )
            log.info("Epoch time: %.2f" % (time.time() - epoch_start_time))

    def splits_of_epoch(
        self, loader: DataLoader, epoch: int, resumed: tuple[RunState, dict[str, Any]] | None
    ) -> Iterator[tuple[int, dict[str, Any], torch.Tensor]]:
        """(split number, the generators the epoch's reading started from, the split's character ids); a resumed
        epoch reads from the generators it started with, skips the splits already trained, then continues with the
        generators of the moment its state was saved."""
        skip = 0
        if resumed is not None and resumed[0].epoch == epoch:
            set_rng_state(resumed[1]["epoch_generators"])
            skip = resumed[0].step_in_epoch
        epoch_generators = rng_state()  # the file order and the line shuffles of the epoch are drawn from these
        for index, train_slice in enumerate(loader):
            if index < skip:
                if index == skip - 1:  # read like the interrupted run; now its generators after that split
                    set_rng_state(cast(tuple, resumed)[1]["generators"])
                continue
            yield self.trainer.split + index + 1, epoch_generators, train_slice

    def train_split(
        self,
        module: Any,
        optimizer: Any,
        train_slice: torch.Tensor,
        epoch: int,
        split_number: int,
        number_of_splits: int,
    ) -> None:
        a, fabric, trainer = self.arguments, self.fabric, self.trainer
        if self.sequence_length < a.grow_to_sequence_length:
            self.sequence_length += 1
        log.info(f"Sequence length is {self.sequence_length}")
        self.split_started = time.time()
        train_data = self.columns(train_slice)
        log.info(f"Split {split_number}\t - ({datetime.datetime.now():%H:%M:%S})")
        self.model.train()
        hidden = self.model.init_hidden(a.mini_batch_size)
        ntokens = len(trainer.corpus.dictionary)
        total_loss = torch.zeros(1, device=fabric.device)
        start_time = time.time()
        interval = trainer.log_interval
        for batch, i in enumerate(range(0, train_data.size(0) - 1, self.sequence_length)):
            self.position.at(f"split {split_number}: forward and backward (the gradient all-reduce)", epoch + 1, batch)
            data, targets = trainer._get_batch(train_data, i, self.sequence_length)
            self.model.zero_grad()
            optimizer.zero_grad()
            with fabric.autocast():
                output, rnn_output, hidden = module(data, hidden)
                loss = trainer.loss_function(output.view(-1, ntokens), targets)
            fabric.backward(loss)
            fabric.clip_gradients(module, optimizer, max_norm=a.clip, error_if_nonfinite=False)
            optimizer.step()
            total_loss += loss.detach()
            hidden = trainer._repackage_hidden(hidden)
            del loss, output, rnn_output
            if batch % interval == 0 and batch > 0:
                self.position.at(f"split {split_number}: the loss agreement at a log point")
                cur_loss = self.lockstep.agree(total_loss).values[0] / fabric.world_size / interval
                elapsed = time.time() - start_time
                log.info(
                    f"| split {split_number:3d}/{number_of_splits:3d} | {batch:5d}/"
                    f"{len(train_data) // self.sequence_length:5d} batches | ms/batch {elapsed * 1000 / interval:5.2f}"
                    f" | loss {cur_loss:5.4f} | ppl {math.exp(cur_loss):5.4f}"
                )
                total_loss = torch.zeros(1, device=fabric.device)
                start_time = time.time()

    def end_split(
        self,
        module: Any,
        optimizer: Any,
        scheduler: ReduceLROnPlateau,
        val_data: torch.Tensor,
        epoch: int,
        split_number: int,
        number_of_splits: int,
        epoch_generators: dict[str, Any],
    ) -> None:
        """Validation, best model, schedule, checkpoints and the split's summary line, as flair does after a split;
        then the ranks agree on stopping."""
        a, fabric, progress = self.arguments, self.fabric, self.progress
        learning_rate = optimizer.param_groups[-1]["lr"]
        self.model.eval()
        self.position.at(f"split {split_number}: the validation perplexity all-reduce")  # after the split's last step
        val_loss = self.score(val_data)
        if val_loss < progress.best_epoch_score:
            self.position.at(f"split {split_number}: saving best-lm.pt")
            if fabric.is_global_zero:
                write_atomically(a.base_path / "best-lm.pt", self.model.save)
            wait_for_global_zero(fabric)
            progress.best_epoch_score = val_loss
            log.info("best split so far")
        scheduler.step(val_loss)
        log.info(f"best loss so far {progress.best_epoch_score:5.8f}")
        log.info(self.model.generate_text())  # on every rank: it draws from the generators the ranks share
        progress.batch_count += 1
        if a.checkpoint:
            self.position.at(f"split {split_number}: saving the checkpoints")
            if fabric.is_global_zero:
                self.save_flair_checkpoint(a.base_path / "checkpoint.pt", optimizer, epoch, split_number)
            progress.epoch, progress.step_in_epoch = epoch, split_number - self.trainer.split
            progress.model_fingerprint = model_fingerprint(self.model)
            state = LanguageModelState(self.sequence_length, a.global_batch, epoch_generators)
            save_training_state(
                fabric, a.base_path, module, optimizer, {SCHEDULER: scheduler}, progress, {}, 1, asdict(state)
            )
        log.info("-" * 89)
        summary = (
            f"| end of split {split_number:3d} /{number_of_splits:3d} | epoch {epoch + 1:3d} | time: "
            f"{(time.time() - self.split_started):5.2f}s | valid loss {val_loss:5.4f} | valid ppl "
            f"{math.exp(val_loss):5.4f} | learning rate {learning_rate:3.4f}"
        )
        self.write_summary(summary)
        log.info("-" * 89)
        self.position.at(f"split {split_number}: the agreement on stops at the end of the split")
        self.lockstep.agree()

    def save_flair_checkpoint(self, path: Path, optimizer: Any, epoch: int, split: int) -> None:
        """flair's ``LanguageModel.save_checkpoint`` (what ``LanguageModelTrainer.load_checkpoint`` reads)."""
        best = self.progress.best_epoch_score
        write_atomically(path, lambda f: self.model.save_checkpoint(f, optimizer, epoch, split, best))

    def write_summary(self, summary: str) -> None:
        """A line of ``loss.txt`` (global rank 0) and of the log."""
        if self.fabric.is_global_zero:
            with open(self.arguments.base_path / "loss.txt", "a") as loss_file:
                loss_file.write(f"{summary}\n")
        log.info(summary)


def start_from_the_callers_generators(fabric: Fabric, generators: dict[str, Any]) -> None:
    """Every rank continues from the generators global rank 0's caller had when it called ``train``, so that ``N``
    processes read the text exactly as one process does."""
    set_rng_state(fabric.broadcast(generators, src=0) if fabric.world_size > 1 else generators)
