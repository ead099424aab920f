"""FabricLanguageModelTrainer against flair's LanguageModelTrainer: one process reproduces it, 2 ranks with b columns
train as one process with 2b, every launcher, Flair embeddings from the result, exact resume after SIGKILL, bad input.
A tiny character LSTM on a few kB of Persuasion: seconds per run."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.data import Sentence
from flair.embeddings import FlairEmbeddings
from flair.models import LanguageModel, SequenceTagger
from flair.trainers import ModelTrainer
from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch.multiprocessing.spawn import ProcessExitedException

from flair_fabric import FabricLanguageModelTrainer
from flair_fabric.language_model import recurrent_kernels as recurrent_kernels_module
from flair_fabric.launch import runner as runner_module
from flair_fabric.state.training_state import complete_checkpoints

from ..support import FABRIC_PRECISIONS, run_script, small_wnut, state_dict_difference
from .lm_support import (
    LM_OPTIONS,
    copy_model,
    no_process_may_start,
    seeded,
    summaries,
    tiny_corpus,
    tiny_language_model,
    validation_perplexities,
)


def _relative_difference(a: LanguageModel, b: LanguageModel) -> float:
    scale = max(float(tensor.abs().max()) for tensor in a.state_dict().values())
    return state_dict_difference(a.state_dict(), b.state_dict()) / scale


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TextCorpus:
    return tiny_corpus(tmp_path_factory.mktemp("lm-corpus"))


@pytest.fixture(scope="module")
def one_process_4_columns(corpus: TextCorpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[LanguageModel, Path]:
    """The reference for several processes: one process, 4 columns."""
    model, out = tiny_language_model(corpus), tmp_path_factory.mktemp("one")
    seeded()
    FabricLanguageModelTrainer(model, corpus).train(out, mini_batch_size=4, devices=1, accelerator="cpu", **LM_OPTIONS)
    return model, out


def test_one_process_reproduces_flairs_language_model_trainer(corpus: TextCorpus, tmp_path: Path) -> None:
    model = tiny_language_model(corpus, dropout=0.1)  # one process: dropout draws as in flair
    theirs, ours = copy_model(model), copy_model(model)
    options = {**LM_OPTIONS, "mini_batch_size": 4, "num_workers": 2}  # flair's loader workers read the splits
    seeded()
    LanguageModelTrainer(theirs, corpus).train(tmp_path / "flair", **options)
    seeded()
    FabricLanguageModelTrainer(ours, corpus).train(tmp_path / "ours", devices=1, accelerator="cpu", **options)
    assert _relative_difference(theirs, ours) <= 1e-6
    assert summaries(tmp_path / "ours") == summaries(tmp_path / "flair")
    assert len(summaries(tmp_path / "ours")) == 7, "3 splits x 2 epochs and the test line"
    best_theirs = LanguageModel.load_language_model(tmp_path / "flair" / "best-lm.pt")
    best_ours = LanguageModel.load_language_model(tmp_path / "ours" / "best-lm.pt")
    assert _relative_difference(best_theirs, best_ours) <= 1e-6
    assert not ours.training, "flair leaves the model in eval mode"


def _optimizer_groups(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The hyper-parameters of an optimizer state, without its parameter ids and ``foreach`` (how the step runs)."""
    return [{k: v for k, v in group.items() if k not in ("params", "foreach")} for group in state["param_groups"]]


def test_flairs_arguments_keep_their_meaning_in_one_process(corpus: TextCorpus, tmp_path: Path) -> None:
    """Optimizer keyword arguments, anneal_factor, patience, clip, grow_to_sequence_length and checkpoint=True mean
    what they mean in flair's LanguageModelTrainer: the same weights, loss.txt (learning rates annealed alike),
    epoch_N.pt and checkpoint.pt; the optimizer takes the grouped (foreach) step, which the caller did not choose."""
    model = tiny_language_model(corpus)
    theirs, ours = copy_model(model), copy_model(model)
    options: dict[str, Any] = {**LM_OPTIONS, "mini_batch_size": 4, "learning_rate": 20.0, "anneal_factor": 0.5}
    options.update(patience=0, clip=0.5, grow_to_sequence_length=24, checkpoint=True, momentum=0.5, weight_decay=1e-3)
    seeded()
    LanguageModelTrainer(theirs, corpus).train(tmp_path / "flair", **options)
    seeded()
    FabricLanguageModelTrainer(ours, corpus).train(tmp_path / "ours", devices=1, accelerator="cpu", **options)
    assert _relative_difference(theirs, ours) <= 1e-6
    assert summaries(tmp_path / "ours") == summaries(tmp_path / "flair")
    rates = {line.split("learning rate")[1] for line in summaries(tmp_path / "ours")[:-1]}
    assert len(rates) > 1, "the schedule annealed (the test exercises anneal_factor and patience)"
    epoch_files = sorted(path.name for path in (tmp_path / "flair").glob("epoch_*.pt"))
    assert epoch_files == ["epoch_1.pt"]
    assert sorted(path.name for path in (tmp_path / "ours").glob("epoch_*.pt")) == epoch_files
    for name in (*epoch_files, "checkpoint.pt"):
        flairs = LanguageModelTrainer.load_checkpoint(tmp_path / "flair" / name, corpus)
        loaded = LanguageModelTrainer.load_checkpoint(tmp_path / "ours" / name, corpus)
        assert (loaded.epoch, loaded.split, loaded.loss) == (flairs.epoch, flairs.split, flairs.loss), name
        assert _relative_difference(flairs.model, loaded.model) <= 1e-6, name
        assert _optimizer_groups(loaded.optimizer_state) == _optimizer_groups(flairs.optimizer_state), name
    state = torch.load(complete_checkpoints(tmp_path / "ours")[-1] / "state.ckpt", weights_only=True)
    group = state["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 1e-3), "the optimizer keyword arguments"
    assert group["foreach"] is True, "the grouped step (flair's optimizer on a CPU: foreach=None, one by one)"


class _WorseAfterTheFirstSplit:
    """A trainer mixin: the 2nd and 3rd scores (the validations of splits 2 and 3) are reported 1.0 higher, so the
    best model (best-lm.pt) is the first split's, not the last; the 4th (the test split) is the true score."""

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        self.scores = getattr(self, "scores", 0) + 1
        loss = super().evaluate(data_source, eval_batch_size, sequence_length)  # type: ignore[misc]
        return loss + 1.0 if self.scores in (2, 3) else loss


class _FlairWorseAfterTheFirstSplit(_WorseAfterTheFirstSplit, LanguageModelTrainer):
    pass


class _OursWorseAfterTheFirstSplit(_WorseAfterTheFirstSplit, FabricLanguageModelTrainer):
    pass


def test_the_test_split_is_scored_with_the_last_model_as_in_flair(corpus: TextCorpus, tmp_path: Path) -> None:
    """When the best split is not the last, the TEST line of loss.txt scores the last weights (as flair's does),
    and the caller's model holds them, not best-lm.pt's."""
    model = tiny_language_model(corpus)
    theirs, ours = copy_model(model), copy_model(model)
    options = {**LM_OPTIONS, "mini_batch_size": 4, "max_epochs": 1}
    seeded()
    _FlairWorseAfterTheFirstSplit(theirs, corpus).train(tmp_path / "flair", **options)
    seeded()
    _OursWorseAfterTheFirstSplit(ours, corpus).train(tmp_path / "ours", devices=1, accelerator="cpu", **options)
    best = LanguageModel.load_language_model(tmp_path / "ours" / "best-lm.pt")
    assert _relative_difference(best, theirs) > 1e-3, "best-lm.pt holds the first split's weights, not the last"
    assert summaries(tmp_path / "ours") == summaries(tmp_path / "flair"), "the TEST line as flair's"
    assert _relative_difference(theirs, ours) <= 1e-6


def _record_model_saves(monkeypatch: pytest.MonkeyPatch, record: Path) -> None:
    """Every ``LanguageModel.save`` and ``save_checkpoint`` (in this process and the ones it forks) appends
    "RANK FILE" to ``record``, FILE the name it ends as (without write_atomically's temporary prefix and suffix)."""
    record.parent.mkdir(parents=True, exist_ok=True)
    save, save_checkpoint = LanguageModel.save, LanguageModel.save_checkpoint

    def note(file: Any) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
        name = re.sub(r"^\.(.+)\.[^.]+\.tmp$", r"\1", Path(file).name)
        with open(record, "a") as stream:
            stream.write(f"{rank} {name}\n")

    def recorded_save(self: LanguageModel, file: Any, *args: Any, **kwargs: Any) -> None:
        note(file)
        save(self, file, *args, **kwargs)

    def recorded_save_checkpoint(self: LanguageModel, file: Any, *args: Any, **kwargs: Any) -> None:
        note(file)
        save_checkpoint(self, file, *args, **kwargs)

    monkeypatch.setattr(LanguageModel, "save", recorded_save)
    monkeypatch.setattr(LanguageModel, "save_checkpoint", recorded_save_checkpoint)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_two_processes_with_2_columns_train_as_one_with_4(
    corpus: TextCorpus,
    one_process_4_columns: tuple[LanguageModel, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
) -> None:
    """2 ranks x 2 columns end with the weights, loss.txt and best-lm.pt of one process with 4; global rank 0 alone
    writes the files (forked ranks: every model save is recorded with its rank)."""
    reference, reference_run = one_process_4_columns
    model = tiny_language_model(corpus)
    writers = tmp_path / "writers" / "saves.txt"
    if strategy == "ddp_fork":  # the forked ranks inherit the spies
        _record_model_saves(monkeypatch, writers)
    seeded()
    FabricLanguageModelTrainer(model, corpus).train(
        tmp_path / "run", mini_batch_size=2, devices=2, strategy=strategy, accelerator="cpu", **LM_OPTIONS
    )
    assert _relative_difference(reference, model) <= 1e-5, "the caller's model holds the trained weights"
    assert summaries(tmp_path / "run") == summaries(reference_run), "validation and test perplexity as in one process"
    log = (tmp_path / "run" / "training.log").read_text()
    assert log.count("| end of split   2 /  3 | epoch   1") == 1, "each split logged once"
    best = LanguageModel.load_language_model(tmp_path / "run" / "best-lm.pt")
    assert _relative_difference(reference, best) <= 1e-5, "the last split had the best validation loss"
    if strategy == "ddp_fork":
        saves = writers.read_text().splitlines()
        assert sorted(set(saves)) == ["0 best-lm.pt", "0 epoch_1.pt"], "best-lm.pt and epoch_N.pt by rank 0 only"


@pytest.mark.multiprocess
def test_the_script_relaunch_ends_with_the_same_weights_on_every_rank(
    one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    """Each relaunched copy of the script makes its own corpus and, on rank 1, has other generators when it calls
    train: every rank starts from global rank 0's caller's generators, and the run ends as one process with the
    4 columns and rank 0's generators."""
    reference, reference_run = one_process_4_columns
    run_script("language_model_ddp_own_generators.py", str(tmp_path))
    weights = [torch.load(tmp_path / f"weights-{rank}.pt") for rank in (0, 1)]
    assert state_dict_difference(weights[0], weights[1]) == 0.0
    assert state_dict_difference(weights[0], reference.state_dict()) <= 1e-5
    assert summaries(tmp_path / "run") == summaries(reference_run)


def test_the_trained_model_serves_as_flair_embeddings_for_a_tagger(
    one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    model, run = one_process_4_columns
    embeddings = FlairEmbeddings(str(run / "best-lm.pt"))
    ner = small_wnut(tmp_path / "wnut")
    tagger = SequenceTagger(
        hidden_size=16,
        embeddings=embeddings,
        tag_dictionary=ner.make_label_dictionary("ner", add_unk=False),
        tag_type="ner",
    )
    sentence = Sentence("Anne Elliot walked to Uppercross .")
    embeddings.embed(sentence)
    from_file = torch.stack([token.get_embedding() for token in sentence])
    trained = FlairEmbeddings(copy_model(model))  # the model object the run trained, not a file
    sentence.clear_embeddings()
    trained.embed(sentence)
    assert torch.equal(from_file, torch.stack([token.get_embedding() for token in sentence])), "best-lm.pt is it"
    assert embeddings.embedding_length == 24
    ModelTrainer(tagger, ner).train(tmp_path / "tagger", max_epochs=2, mini_batch_size=8, learning_rate=0.5)
    header, *rows = [line.split("\t") for line in (tmp_path / "tagger" / "loss.tsv").read_text().splitlines()]
    losses = [float(row[header.index("TRAIN_LOSS")]) for row in rows]
    assert len(losses) == 2 and losses[1] < losses[0], "the tagger learns on top of the trained embeddings"
    reloaded = SequenceTagger.load(tmp_path / "tagger" / "final-model.pt")
    assert isinstance(reloaded.embeddings, FlairEmbeddings)


class _NoBetterAtValidation5(FabricLanguageModelTrainer):
    """Reports the 5th validation of a run (split 2 of epoch 2) 1.0 worse, so that the first split after the resume
    point does not improve; dies (SIGKILL, every rank) during validation ``kill_at``, before that split's state is
    saved. Validations are counted in files under ``self.counts``, across the kill and the resume."""

    def __init__(self, *args: Any, counts: Path, kill_at: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts, self.kill_at = counts, kill_at
        counts.mkdir(parents=True, exist_ok=True)

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        counter = self.counts / f"rank-{torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}"
        number = len(counter.read_text()) + 1 if counter.exists() else 1
        if number == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().evaluate(data_source, eval_batch_size, sequence_length)
        with open(counter, "a") as stream:
            stream.write("|")
        return loss + 1.0 if number == 5 else loss


def _best_losses(run: Path) -> list[str]:
    """The best validation loss so far after every split, as training.log says it."""
    return re.findall(r"best loss so far (\S+)", (run / "training.log").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_killed_in_the_middle_of_an_epoch_resumes_to_the_uninterrupted_result(
    corpus: TextCorpus, tmp_path: Path, devices: int
) -> None:
    """Killed after split 1 of epoch 2 was saved, the run resumes to the weights, loss.txt, best-lm.pt and best-loss
    log of the uninterrupted run: the weights, optimizer (momentum), plateau schedule (patience 0: the next split
    does not improve, so the learning rate anneals after it), grown sequence length, best validation loss (not
    replaced by the worse split) and generators (dropout) are restored."""
    options = {**LM_OPTIONS, "mini_batch_size": 4 // devices, "checkpoint": True, "accelerator": "cpu"}
    options.update(patience=0, grow_to_sequence_length=30, momentum=0.2)
    options.update(devices=devices, strategy="ddp_fork")  # one forked worker too: SIGKILL spares the test
    model = tiny_language_model(corpus, dropout=0.2)  # dropout: the generators must be restored as well
    uninterrupted, killed = copy_model(model), copy_model(model)
    seeded()
    _NoBetterAtValidation5(uninterrupted, corpus, counts=tmp_path / "whole-counts").train(tmp_path / "whole", **options)
    rates = [line.split("learning rate")[1] for line in summaries(tmp_path / "whole")[:-1]]
    assert rates[5] != rates[4], "annealed after split 2 of epoch 2"
    seeded()
    with pytest.raises(
        ProcessExitedException, match=r"SIGKILL|signal 9"
    ):  # split 2 of epoch 2; the last state: after split 1
        _NoBetterAtValidation5(killed, corpus, counts=tmp_path / "counts", kill_at=5).train(
            tmp_path / "killed", **options
        )
    assert len(summaries(tmp_path / "killed")) == 4
    flairs = FabricLanguageModelTrainer.load_checkpoint(tmp_path / "killed" / "checkpoint.pt", corpus)
    assert (type(flairs), flairs.epoch, flairs.split) == (FabricLanguageModelTrainer, 1, 1), "flair's checkpoint.pt"
    seeded(99)  # other generators in the caller: the checkpoint's are used
    resumed = _NoBetterAtValidation5(killed, corpus, counts=tmp_path / "counts")
    resumed.train(tmp_path / "killed", resume_from="auto", **options)
    assert _relative_difference(uninterrupted, killed) <= 1e-6
    assert summaries(tmp_path / "killed") == summaries(tmp_path / "whole")
    after_resume = _best_losses(tmp_path / "killed")  # flair's training.log starts afresh with each train call
    assert after_resume == _best_losses(tmp_path / "whole")[-len(after_resume) :] and len(after_resume) == 2
    best = [LanguageModel.load_language_model(tmp_path / run / "best-lm.pt") for run in ("whole", "killed")]
    assert _relative_difference(best[0], best[1]) <= 1e-6


class _FailsAtValidation(FabricLanguageModelTrainer):
    """Fails (in the calling process: one device, no worker) during the n-th validation."""

    fail_at = 0

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        self.validations = getattr(self, "validations", 0) + 1
        if self.validations == self.fail_at:
            raise RuntimeError("the machine went down")
        return super().evaluate(data_source, eval_batch_size, sequence_length)


def _record_state_reads(monkeypatch: pytest.MonkeyPatch, record: Path) -> None:
    """Every ``torch.load`` of a checkpoint's file (in this process and the ones it forks) appends its rank."""
    load = torch.load

    def recorded_load(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, str | Path) and Path(file).parent.parent.name == "checkpoints":
            with open(record, "a") as stream:
                stream.write(f"{torch.distributed.get_rank() if torch.distributed.is_initialized() else -1}\n")
        return load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recorded_load)


@pytest.mark.multiprocess
def test_a_run_resumes_on_another_number_of_processes_with_the_same_columns(
    corpus: TextCorpus,
    one_process_4_columns: tuple[LanguageModel, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-process run of 4 columns that failed in epoch 2 continues on 2 processes with mini_batch_size=2 (the same
    4 columns) to the uninterrupted one-process result; global rank 0 alone reads the checkpoint (the other rank
    gets it by broadcast). Another number of columns is refused, naming the mini_batch_size to pass."""
    reference, reference_run = one_process_4_columns
    model = tiny_language_model(corpus)
    options = {**LM_OPTIONS, "checkpoint": True, "accelerator": "cpu", "base_path": tmp_path / "run"}
    _FailsAtValidation.fail_at = 5  # split 2 of epoch 2; the last state is after split 1
    seeded()
    with pytest.raises(RuntimeError, match="the machine went down"):
        _FailsAtValidation(model, corpus).train(mini_batch_size=4, devices=1, **options)
    assert len(summaries(tmp_path / "run")) == 4
    with pytest.raises(ValueError, match=r"trained on 4 columns .* this run has 2: pass mini_batch_size=4 or resume"):
        FabricLanguageModelTrainer(copy_model(model), corpus).train(
            mini_batch_size=2, devices=1, resume_from="auto", **options
        )
    reads = tmp_path / "reads.txt"
    _record_state_reads(monkeypatch, reads)
    seeded(99)  # other generators in the caller: the checkpoint's are used
    FabricLanguageModelTrainer(model, corpus).train(
        mini_batch_size=2, devices=2, strategy="ddp_fork", resume_from="auto", **options
    )
    ranks = set(reads.read_text().split()) - {"-1"}  # -1: the caller checks every file as data before the launch
    assert ranks == {"0"}, "of the ranks, global rank 0 alone read the checkpoint"
    assert _relative_difference(reference, model) <= 1e-5
    assert summaries(tmp_path / "run") == summaries(reference_run)


class _InterruptedOnRankOne(FabricLanguageModelTrainer):
    """Ctrl-C reaches global rank 1 alone, while it scores the validation split after split 2."""

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        self.scores = getattr(self, "scores", 0) + 1
        if self.scores == 2 and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return super().evaluate(data_source, eval_batch_size, sequence_length)


@pytest.mark.multiprocess
def test_ctrl_c_on_one_rank_stops_every_rank_then_the_test_split_is_scored(
    corpus: TextCorpus, one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    """A Ctrl-C on rank 1 alone, during split 2: both ranks stop at the end of split 2 (train returns), and the test
    split is scored, as in flair, with the model they stopped with (flair's evaluate of the caller's model)."""
    _, reference_run = one_process_4_columns
    model = tiny_language_model(corpus)
    seeded()
    try:
        _InterruptedOnRankOne(model, corpus).train(
            tmp_path,
            mini_batch_size=2,
            devices=2,
            strategy="ddp_fork",
            accelerator="cpu",
            collective_timeout=60,
            **LM_OPTIONS,
        )
    except KeyboardInterrupt:  # pytest would end the session on it
        pytest.fail("the Ctrl-C on rank 1 reached the caller instead of stopping the ranks together")
    lines = summaries(tmp_path)
    assert lines[:2] == summaries(reference_run)[:2], "splits 1 and 2 trained as without the Ctrl-C"
    assert len(lines) == 3 and lines[2].startswith("TEST: "), "stopped after split 2, then the test split"
    assert (tmp_path / "training.log").read_text().count("Exiting from training early") == 1
    flair = LanguageModelTrainer(model, corpus)
    test_loss = flair.evaluate(LanguageModelTrainer._batchify(corpus.test, 4), 4, LM_OPTIONS["sequence_length"])
    assert lines[2] == f"TEST: valid loss {test_loss:5.4f} | valid ppl {math.exp(test_loss):8.4f}"


BAD = [
    ({"mini_batch_size": 0}, r"mini_batch_size=0 is not valid"),
    ({"mini_batch_size": -1, "devices": 2}, r"mini_batch_size=-1 is not valid"),
    ({"sequence_length": 0}, r"sequence_length=0 is not valid"),
    ({"sequence_length": -5, "devices": 2}, r"sequence_length=-5 is not valid"),
    ({"mini_batch_size": 400, "devices": 2}, r"validation split \(valid.txt\) has \d+ characters: with"),
    ({"mini_batch_size": 700}, r"validation split \(valid.txt\) has \d+ characters: with mini_batch_size=700 on 1"),
    ({"strategy": "fsdp", "devices": 2}, r"strategy='fsdp': FabricLanguageModelTrainer trains with DDP"),
    ({"strategy": "fsdp"}, r"strategy='fsdp': FabricLanguageModelTrainer trains with DDP"),
    ({"resume_from": "/nonexistent/run"}, r"resume_from='/nonexistent/run' is not a flair-fabric checkpoint"),
    ({"precision": "bf16-true"}, r"precision='bf16-true' \(bf16-true\) casts the whole model, which flair's Lang"),
    ({"precision": 64}, r"precision=64 \(64-true\) casts the whole model.*pass precision='32-true', 'bf16-mixed'"),
    ({"precision": "64-true", "devices": 2}, r"precision='64-true' \(64-true\) casts the whole model"),
    ({"collective_timeout": 0}, r"collective_timeout=0 is not valid"),
    ({"collective_timeout": -1.5, "devices": 2}, r"collective_timeout=-1.5 is not valid"),
    ({"use_amp": True, "precision": "bf16-mixed"}, r"use_amp=True and precision='bf16-mixed' were both given"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD)
def test_bad_input_is_refused_before_any_process_starts(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict, message: str
) -> None:
    """Each bad argument is refused with an error naming it and the fix, before a Fabric is built or a process
    started (both fail the test)."""
    no_process_may_start(monkeypatch)
    options = {**LM_OPTIONS, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1, **arguments}
    with pytest.raises(ValueError) as refused:
        FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(tmp_path / "run", **options)
    assert re.search(message, str(refused.value)), str(refused.value)
    assert not (tmp_path / "run" / "loss.txt").exists()


def test_a_corpus_without_split_files_is_refused(corpus: TextCorpus, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    for name in ("valid.txt", "test.txt"):
        (empty / name).write_text("x" * 500 + "\n")
    hollow = TextCorpus(empty, corpus.dictionary)
    with pytest.raises(ValueError, match=r"no training text: put one or more split files into .*train"):
        FabricLanguageModelTrainer(tiny_language_model(corpus), hollow).train(
            tmp_path / "run", mini_batch_size=2, accelerator="cpu", devices=1, **LM_OPTIONS
        )


@pytest.mark.multiprocess
def test_bf16_mixed_trains_on_two_cpu_processes(
    corpus: TextCorpus, one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    """On a CPU without bfloat16 instructions oneDNN cannot build a bfloat16 LSTM; the run still trains, close to
    the float32 reference (bfloat16 keeps 8 bits of mantissa)."""
    reference, _ = one_process_4_columns
    model = tiny_language_model(corpus)
    untrained = copy_model(model)
    seeded()
    FabricLanguageModelTrainer(model, corpus).train(
        tmp_path,
        mini_batch_size=2,
        devices=2,
        strategy="ddp_fork",
        accelerator="cpu",
        precision="bf16-mixed",
        **LM_OPTIONS,
    )
    trained_by = _relative_difference(untrained, reference)
    assert _relative_difference(reference, model) <= 0.1 * trained_by
    validation = validation_perplexities(tmp_path)
    assert validation[-1] < validation[0]


@pytest.mark.multiprocess
def test_bf16_mixed_trains_on_two_processes_of_a_cpu_without_bfloat16_instructions(tmp_path: Path) -> None:
    """oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``) has no bfloat16 LSTM, as on CPUs without AVX512-BF16/AMX,
    whatever this CPU has: the LSTM must run without oneDNN, and training still ends close to float32."""
    run_script("language_model_bf16.py", str(tmp_path), extra_env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["onednn_bf16"] is False
    assert result["bf16_from_float32"] <= 0.1 * result["trained_by"]
    assert result["validation_perplexities"][-1] < result["validation_perplexities"][0]


class _FailsAtTheFirstValidation(FabricLanguageModelTrainer):
    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        raise RuntimeError("the run failed")


def test_onednn_is_off_for_a_run_that_needs_it_and_restored_afterwards(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where oneDNN has no bfloat16 LSTM (made so here, whatever this CPU has), a bf16-mixed run trains with
    torch.backends.mkldnn.enabled off, says so once in the log, and the setting is back on when train returns or
    fails."""
    monkeypatch.setattr(recurrent_kernels_module, "lstm_needs_no_onednn", lambda fabric: True)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)  # and back to what it was after the test
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    logging.getLogger("flair").addHandler(handler)
    model = tiny_language_model(corpus)
    in_training: list[bool] = []
    model.decoder.register_forward_hook(
        lambda module, inputs, output: (
            in_training.append(bool(torch.backends.mkldnn.enabled)) if module.training else None
        )
    )
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 4, "accelerator": "cpu", "devices": 1}
    try:
        FabricLanguageModelTrainer(model, corpus).train(tmp_path / "run", precision="bf16-mixed", **options)
        assert in_training and not any(in_training), "oneDNN off during the run"
        assert torch.backends.mkldnn.enabled, "oneDNN back on when the run ended"
        assert sum("no bfloat16 instructions for oneDNN" in message for message in warnings) == 1, warnings
        with pytest.raises(RuntimeError, match="the run failed"):
            _FailsAtTheFirstValidation(model, corpus).train(tmp_path / "failed", precision="bf16-mixed", **options)
        assert torch.backends.mkldnn.enabled, "oneDNN back on when the run failed"
    finally:
        logging.getLogger("flair").removeHandler(handler)


def test_gradients_are_unscaled_before_clipping_under_16_mixed(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under 16-mixed Fabric's gradient scaler multiplies the loss (by 65536) before the backward pass; clipping to
    ``clip`` must see the unscaled gradients, so the run trains as 32-true does (clipping the scaled gradients would
    shrink every step 65536-fold). Fabric's 16-mixed plugin with its scaler, here on a CPU, with oneDNN off (it has
    no float16 LSTM on most CPUs): the LSTM stays in float32 and the result close to 32-true's."""
    model = tiny_language_model(corpus)
    reference, mixed = copy_model(model), copy_model(model)
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 4, "accelerator": "cpu", "devices": 1}
    seeded()
    FabricLanguageModelTrainer(reference, corpus).train(tmp_path / "32-true", **options)
    built: list[Fabric] = []

    def sixteen_mixed(config: Any) -> Fabric:
        scaler = torch.amp.GradScaler("cpu")
        built.append(Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]))
        return built[-1]

    monkeypatch.setattr(runner_module, "build_fabric", sixteen_mixed)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    seeded()
    FabricLanguageModelTrainer(mixed, corpus).train(tmp_path / "16-mixed", **options)
    assert built[0].strategy.precision.scaler.get_scale() >= 2.0**10, "the gradients were scaled"  # type: ignore[attr-defined]
    trained_by = _relative_difference(reference, model)  # both relative to the trained weights
    difference = _relative_difference(reference, mixed)
    assert difference <= 0.1 * trained_by, f"{difference} from 32-true's weights; training moved them {trained_by}"
    validation = validation_perplexities(tmp_path / "16-mixed")
    assert validation[-1] < validation[0]


@pytest.mark.parametrize("precision", FABRIC_PRECISIONS)
def test_every_precision_name_trains_or_is_refused_before_anything_starts(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: Any
) -> None:
    """32-true and bf16-mixed (every spelling) train, the forward pass of training under Fabric's autocast (the
    decoder computes in bfloat16 under bf16-mixed); precisions that convert the whole model, CUDA-only ones on a CPU
    and Transformer Engine's are refused before a Fabric is built or anything written, the precision named."""
    model = tiny_language_model(corpus)
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    if str(precision) in ("32", "32-true", "bf16", "bf16-mixed"):
        decoded: list[torch.dtype] = []
        model.decoder.register_forward_hook(
            lambda module, inputs, output: decoded.append(output.dtype) if module.training else None
        )
        FabricLanguageModelTrainer(model, corpus).train(tmp_path / "run", precision=precision, **options)
        assert len(summaries(tmp_path / "run")) == 4, "3 splits and the test line"
        assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
        expected = torch.bfloat16 if str(precision).startswith("bf16") else torch.float32
        assert decoded and set(decoded) == {expected}, f"training's forward pass under {precision!r}: {set(decoded)}"
    else:
        no_process_may_start(monkeypatch)
        with pytest.raises(ValueError, match=re.escape(f"precision={precision!r}")):
            FabricLanguageModelTrainer(model, corpus).train(tmp_path / "run", precision=precision, **options)
        assert not (tmp_path / "run").exists()


class _FailingSecondSave(LanguageModel):
    """A language model whose second ``save`` writes half a file and fails (a full disk, a killed process)."""

    saves = 0
    first_save = b""

    def save(self, file: Any, **kwargs: Any) -> None:
        type(self).saves += 1
        if type(self).saves == 2:
            Path(file).write_bytes(b"half a model")
            raise OSError("No space left on device")
        super().save(file, **kwargs)
        type(self).first_save = Path(file).read_bytes()


def test_best_lm_pt_is_replaced_only_by_a_complete_file(corpus: TextCorpus, tmp_path: Path) -> None:
    """best-lm.pt (and the run's other files) are written through a temporary file and a rename: a save that fails
    half-way leaves the previous best-lm.pt loadable and no temporary file behind."""
    model = tiny_language_model(corpus)
    model.__class__ = _FailingSecondSave
    options = {**LM_OPTIONS, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1, "learning_rate": 20.0}
    seeded()
    with pytest.raises(OSError, match="No space left"):
        FabricLanguageModelTrainer(model, corpus).train(tmp_path, **options)
    assert _FailingSecondSave.saves == 2, "the second split was the best so far again"
    assert (tmp_path / "best-lm.pt").read_bytes() == _FailingSecondSave.first_save, "the first split's, whole"
    LanguageModel.load_language_model(tmp_path / "best-lm.pt")
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []
