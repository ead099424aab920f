"""flair's ``LanguageModelTrainer.train`` loop on one rank, through Fabric.

What changes against flair's loop, and why:

- Every split is batchified into ``N·b`` columns and the rank trains its ``b`` (:mod:`.columns`); the model is
  wrapped by Fabric (DDP averages the gradients), the forward pass runs under Fabric's precision, gradients are
  clipped by Fabric (unscaled first under ``16-mixed``).
- The ranks start from the generators of the caller's ``train`` call and consume them alike (the same split files in
  the same order, the same line shuffles and case flips, the same generated sample text): they read the same data.
- Validation and test perplexity: each rank scores its columns, one all-reduce gives flair's single-process value.
  The learning rate schedule, ``best-lm.pt`` and stopping are thus decided identically on every rank; files and the
  log are written by global rank 0 only.
- ``checkpoint=True`` keeps flair's ``checkpoint.pt`` and also writes :data:`.resume.STATE_FILE`, from which
  ``resume_from`` continues exactly: the split files already trained in the epoch are skipped, the generators,
  optimizer, scheduler and grown sequence length restored.
- Ctrl-C (or SIGTERM) on any rank stops every rank at the next log point; then, as in flair, the test split is scored.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from flair.models import LanguageModel
from flair.optim import SGDW, ReduceLRWDOnPlateau
from flair.training_utils import add_file_handler
from lightning.fabric import Fabric
from torch.optim import AdamW
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from flair_fabric.language_model.arguments import LanguageModelArguments
from flair_fabric.language_model.columns import rank_columns
from flair_fabric.language_model.resume import load_state_on_every_rank, save_state, state_file
from flair_fabric.launch.failures import graceful_interrupts
from flair_fabric.state.model_files import write_atomically
from flair_fabric.state.training_state import rng_state, set_rng_state
from flair_fabric.training.optimizer_implementation import build_optimizer

if TYPE_CHECKING:
    from flair_fabric.language_model.trainer import FabricLanguageModelTrainer

log = logging.getLogger("flair")


class StopRequested(Exception):
    """Some rank received Ctrl-C or SIGTERM: every rank leaves the training loop at the same point."""


class LanguageModelRun:
    """One rank's language-model training; ``run()`` trains, then scores the test split."""

    def __init__(self, trainer: FabricLanguageModelTrainer, fabric: Fabric, arguments: LanguageModelArguments) -> None:
        self.trainer, self.fabric, self.arguments = trainer, fabric, arguments
        self.model: LanguageModel = trainer.model
        self.interrupted: list[str] = []
        self.sequence_length = arguments.sequence_length
        self.best_val_loss = trainer.loss
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
        resumed = load_state_on_every_rank(fabric, a.resume_file) if a.resume_file is not None else None
        if resumed is not None:
            self.restore(resumed, optimizer, scheduler)
        log_handler = add_file_handler(log, a.base_path / "training.log") if fabric.is_global_zero else None
        try:
            with graceful_interrupts(self.interrupted.append):
                self.train_epochs(module, optimizer, scheduler, val_data, resumed)
        except StopRequested:
            log.info("-" * 89)
            log.info("Exiting from training early")
        finally:
            if log_handler is not None:
                log_handler.close()
                log.removeHandler(log_handler)
        test_loss = self.score(self.test_data)  # with the last model, as flair does
        self.write_summary(f"TEST: valid loss {test_loss:5.4f} | valid ppl {math.exp(test_loss):8.4f}")
        log.info("-" * 89)

    def restore(self, state: dict[str, Any], optimizer: Any, scheduler: ReduceLROnPlateau) -> None:
        global_batch = state["global_batch"]
        if global_batch != self.arguments.global_batch:
            raise ValueError(
                f"the checkpoint was trained on {global_batch} columns (mini_batch_size x processes), this run has"
                f" {self.arguments.global_batch}: pass mini_batch_size={global_batch // self.fabric.world_size}"
                " or resume on the number of processes it had."
            )
        self.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        self.fabric.strategy.precision.load_state_dict(state["precision"])
        self.sequence_length, self.best_val_loss = state["sequence_length"], state["best_val_loss"]
        log.info(f"resuming after split {state['split']} of epoch {state['epoch'] + 1}")

    def train_epochs(
        self,
        module: Any,
        optimizer: Any,
        scheduler: ReduceLROnPlateau,
        val_data: torch.Tensor,
        resumed: dict[str, Any] | None,
    ) -> None:
        a, trainer = self.arguments, self.trainer
        first_epoch = resumed["epoch"] if resumed is not None else trainer.epoch
        number_of_splits = len(trainer.corpus.train)
        for epoch in range(first_epoch, a.max_epochs):
            epoch_start_time = time.time()
            loader = DataLoader(trainer.corpus.train, shuffle=epoch > 0, num_workers=a.num_workers)
            if epoch > 0 and self.fabric.is_global_zero and resumed is None:
                self.save_flair_checkpoint(a.base_path / f"epoch_{epoch}.pt", optimizer, epoch, 0)
            splits = self.splits_of_epoch(loader, epoch, resumed)
            resumed = None
            for split_number, epoch_generators, train_slice in splits:
                self.train_split(module, optimizer, train_slice.flatten(), split_number, number_of_splits)
                self.end_split(optimizer, scheduler, val_data, epoch, split_number, number_of_splits, epoch_generators)
            log.info("Epoch time: %.2f" % (time.time() - epoch_start_time))

    def splits_of_epoch(
        self, loader: DataLoader, epoch: int, resumed: dict[str, Any] | None
    ) -> Iterator[tuple[int, dict[str, Any], torch.Tensor]]:
        """(split number, the generators the epoch's reading started from, the split's character ids); a resumed
        epoch reads from the generators it started with, skips the splits already trained, then continues with the
        generators of the moment its state was saved."""
        skip = 0
        if resumed is not None and resumed["epoch"] == epoch:
            set_rng_state(resumed["epoch_generators"])
            skip = resumed["split"]
        epoch_generators = rng_state()  # the file order and the line shuffles of the epoch are drawn from these
        for index, train_slice in enumerate(loader):
            if index < skip:
                if index == skip - 1:  # read like the interrupted run; now its generators after that split
                    set_rng_state(cast(dict[str, Any], resumed)["generators"])
                continue
            yield self.trainer.split + index + 1, epoch_generators, train_slice

    def train_split(
        self, module: Any, optimizer: Any, train_slice: torch.Tensor, split_number: int, number_of_splits: int
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
                cur_loss = self.agreed_mean_loss(total_loss) / interval
                elapsed = time.time() - start_time
                log.info(
                    f"| split {split_number:3d}/{number_of_splits:3d} | {batch:5d}/"
                    f"{len(train_data) // self.sequence_length:5d} batches | ms/batch {elapsed * 1000 / interval:5.2f}"
                    f" | loss {cur_loss:5.4f} | ppl {math.exp(cur_loss):5.4f}"
                )
                total_loss = torch.zeros(1, device=fabric.device)
                start_time = time.time()

    def agreed_mean_loss(self, total_loss: torch.Tensor) -> float:
        """The ranks' mean of ``total_loss``, and whether any rank was interrupted (then every rank stops)."""
        stop = torch.tensor([float(bool(self.interrupted))], device=total_loss.device)
        packed = torch.cat([total_loss.float(), stop])
        agreed = cast(torch.Tensor, self.fabric.all_reduce(packed, reduce_op="sum"))
        if agreed[1].item() > 0:
            raise StopRequested
        return float(agreed[0].item()) / self.fabric.world_size

    def end_split(
        self,
        optimizer: Any,
        scheduler: ReduceLROnPlateau,
        val_data: torch.Tensor,
        epoch: int,
        split_number: int,
        number_of_splits: int,
        epoch_generators: dict[str, Any],
    ) -> None:
        """Validation, best model, schedule, checkpoints and the split's summary line, as flair does after a split."""
        a, fabric = self.arguments, self.fabric
        learning_rate = optimizer.param_groups[-1]["lr"]
        self.model.eval()
        val_loss = self.score(val_data)
        if val_loss < self.best_val_loss:
            if fabric.is_global_zero:
                write_atomically(a.base_path / "best-lm.pt", self.model.save)
            self.best_val_loss = val_loss
            log.info("best split so far")
        scheduler.step(val_loss)
        log.info(f"best loss so far {self.best_val_loss:5.8f}")
        log.info(self.model.generate_text())  # on every rank: it draws from the generators the ranks share
        if a.checkpoint and fabric.is_global_zero:
            within_epoch = split_number - self.trainer.split
            self.save_flair_checkpoint(a.base_path / "checkpoint.pt", optimizer, epoch, split_number)
            state = {
                "model": self.model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "precision": fabric.strategy.precision.state_dict(),
                "epoch": epoch,
                "split": within_epoch,
                "best_val_loss": self.best_val_loss,
                "sequence_length": self.sequence_length,
                "global_batch": a.global_batch,
                "epoch_generators": epoch_generators,
                "generators": rng_state(),
            }
            save_state(state_file(a.base_path), state)
        log.info("-" * 89)
        summary = (
            f"| end of split {split_number:3d} /{number_of_splits:3d} | epoch {epoch + 1:3d} | time: "
            f"{(time.time() - self.split_started):5.2f}s | valid loss {val_loss:5.4f} | valid ppl "
            f"{math.exp(val_loss):5.4f} | learning rate {learning_rate:3.4f}"
        )
        self.write_summary(summary)
        log.info("-" * 89)
        if self.interrupted_anywhere():
            raise StopRequested

    def save_flair_checkpoint(self, path: Path, optimizer: Any, epoch: int, split: int) -> None:
        """flair's ``LanguageModel.save_checkpoint`` (what ``LanguageModelTrainer.load_checkpoint`` reads)."""
        write_atomically(path, lambda f: self.model.save_checkpoint(f, optimizer, epoch, split, self.best_val_loss))

    def interrupted_anywhere(self) -> bool:
        flag = torch.tensor(float(bool(self.interrupted)), device=self.fabric.device)
        return bool(cast(torch.Tensor, self.fabric.all_reduce(flag, reduce_op="sum")).item() > 0)

    def write_summary(self, summary: str) -> None:
        """A line of ``loss.txt`` (global rank 0) and of the log."""
        if self.fabric.is_global_zero:
            with open(self.arguments.base_path / "loss.txt", "a") as loss_file:
                loss_file.write(f"{summary}\n")
        log.info(summary)


def start_from_the_callers_generators(fabric: Fabric, generators: dict[str, Any]) -> None:
    """Every rank continues from the generators global rank 0's caller had when it called ``train`` (whatever the
    launch drew since), so that ``N`` processes read the text exactly as one process does."""
    set_rng_state(fabric.broadcast(generators, src=0) if fabric.world_size > 1 else generators)
