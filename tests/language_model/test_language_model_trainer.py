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
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from flair_fabric import FabricLanguageModelTrainer
from flair_fabric.language_model import loop as loop_module
from flair_fabric.language_model import recurrent_kernels as recurrent_kernels_module
from flair_fabric.launch import runner as runner_module
from flair_fabric.state.training_state import complete_checkpoints

from ..support import FABRIC_PRECISIONS, run_script, small_wnut, state_dict_difference
from .lm_support import (
    LM_OPTIONS,
    accesses,
    assert_journals_agree,
    copy_model,
    digest,
    file_accesses,
    journal,
    journaled,
    journaled_dropout,
    no_process_may_start,
    seeded,
    summaries,
    tiny_corpus,
    tiny_language_model,
    to_four_decimals,
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
    """The reference for several processes: one process, 4 columns; what it did in ``journal/journal-0``."""
    model, out = tiny_language_model(corpus), tmp_path_factory.mktemp("one")
    seeded()
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, journaled_method in journaled(out / "journal"):
            patch.setattr(owner, name, journaled_method)
        trainer = FabricLanguageModelTrainer(model, corpus)
        trainer.train(out, mini_batch_size=4, devices=1, accelerator="cpu", **LM_OPTIONS)
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
    files = {run: torch.load(tmp_path / run / "best-lm.pt", weights_only=False) for run in ("ours", "flair")}
    assert isinstance(files["ours"], dict) and files["ours"].keys() == files["flair"].keys(), "flair's file layout"
    for key, value in files["flair"].items():
        if key == "state_dict":
            assert files["ours"][key].keys() == value.keys()
        elif key == "dictionary":
            assert files["ours"][key].item2idx == value.item2idx
        else:
            assert files["ours"][key] == value, key
    best_theirs = LanguageModel.load_language_model(tmp_path / "flair" / "best-lm.pt")
    best_ours = LanguageModel.load_language_model(tmp_path / "ours" / "best-lm.pt")
    assert _relative_difference(best_theirs, best_ours) <= 1e-6
    assert not ours.training, "flair leaves the model in eval mode"


def _optimizer_groups(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The hyper-parameters of an optimizer state, without its parameter ids and ``foreach`` (how the step runs)."""
    return [{k: v for k, v in group.items() if k not in ("params", "foreach")} for group in state["param_groups"]]


def _equal_states(a: Any, b: Any) -> bool:
    """Two optimizer states (nested dicts and lists of numbers and tensors) hold the same values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_states(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_flairs_arguments_keep_their_meaning_in_one_process(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optimizer keyword arguments, anneal_factor, patience, clip, grow_to_sequence_length and checkpoint=True mean
    what they mean in flair's LanguageModelTrainer over 3 epochs: the same weights, loss.txt (learning rates annealed
    alike), the same model files saved in the same order (best-lm.pt, epoch_1.pt and epoch_2.pt at the start of
    epochs 2 and 3, checkpoint.pt after every split) holding the same; the run's own checkpoint after every split;
    load_checkpoint reads flair's checkpoint.pt as flair's does and gives this trainer; the optimizer takes the
    grouped (foreach) step, which the caller did not choose."""
    model = tiny_language_model(corpus)
    theirs, ours = copy_model(model), copy_model(model)
    options: dict[str, Any] = {**LM_OPTIONS, "mini_batch_size": 4, "learning_rate": 20.0, "anneal_factor": 0.5}
    options.update(max_epochs=3, patience=0, clip=0.5, grow_to_sequence_length=24, checkpoint=True)
    options.update(momentum=0.5, weight_decay=1e-3)
    saves = tmp_path / "saves.txt"
    _record_model_saves(monkeypatch, saves)
    seeded()
    LanguageModelTrainer(theirs, corpus).train(tmp_path / "flair", **options)
    flairs_saves = saves.read_text().splitlines()
    saves.unlink()
    states_saved: list[int] = []
    save_training_state = loop_module.save_training_state

    def recorded_save_training_state(*args: Any, **kwargs: Any) -> None:
        states_saved.append(args[5].batch_count)  # the progress record: splits trained so far
        save_training_state(*args, **kwargs)

    monkeypatch.setattr(loop_module, "save_training_state", recorded_save_training_state)
    seeded()
    FabricLanguageModelTrainer(ours, corpus).train(tmp_path / "ours", devices=1, accelerator="cpu", **options)
    assert _relative_difference(theirs, ours) <= 1e-6
    assert summaries(tmp_path / "ours") == summaries(tmp_path / "flair")
    rates = {line.split("learning rate")[1] for line in summaries(tmp_path / "ours")[:-1]}
    assert len(rates) > 1, "the schedule annealed (the test exercises anneal_factor and patience)"
    assert saves.read_text().splitlines() == flairs_saves, "the model files flair saves, in flair's order"
    assert flairs_saves.count("-1 checkpoint.pt") == 9, "flair: checkpoint.pt after each of the 9 splits"
    assert states_saved == list(range(1, 10)), "the run's checkpoint after every split"
    epoch_files = sorted(path.name for path in (tmp_path / "flair").glob("epoch_*.pt"))
    assert epoch_files == ["epoch_1.pt", "epoch_2.pt"]
    assert sorted(path.name for path in (tmp_path / "ours").glob("epoch_*.pt")) == epoch_files
    for name in (*epoch_files, "checkpoint.pt"):
        flairs = LanguageModelTrainer.load_checkpoint(tmp_path / "flair" / name, corpus)
        loaded = LanguageModelTrainer.load_checkpoint(tmp_path / "ours" / name, corpus)
        assert (loaded.epoch, loaded.split, loaded.loss) == (flairs.epoch, flairs.split, flairs.loss), name
        assert _relative_difference(flairs.model, loaded.model) <= 1e-6, name
        assert _optimizer_groups(loaded.optimizer_state) == _optimizer_groups(flairs.optimizer_state), name
        ours_read = FabricLanguageModelTrainer.load_checkpoint(tmp_path / "flair" / name, corpus)  # flair's file
        assert type(ours_read) is FabricLanguageModelTrainer, name
        assert (ours_read.epoch, ours_read.split, ours_read.loss) == (flairs.epoch, flairs.split, flairs.loss), name
        assert _relative_difference(flairs.model, ours_read.model) == 0.0, name
        assert _equal_states(ours_read.optimizer_state, flairs.optimizer_state), f"{name}: the optimizer state"
    state = torch.load(complete_checkpoints(tmp_path / "ours")[-1] / "state.ckpt", weights_only=True)
    group = state["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 1e-3), "the optimizer keyword arguments"
    assert group["foreach"] is True, "the grouped step (flair's optimizer on a CPU: foreach=None, one by one)"


@pytest.mark.parametrize(
    ("optimizer", "choice", "foreach"),
    [
        (torch.optim.Adam, {}, True),
        (torch.optim.Adam, {"foreach": False}, False),
        (torch.optim.SGD, {"fused": True}, None),
    ],
    ids=["adam", "adam-foreach-false-chosen", "sgd-fused-chosen"],
)
def test_the_grouped_step_is_the_default_unless_the_caller_chose(
    corpus: TextCorpus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    optimizer: type[torch.optim.Optimizer],
    choice: dict[str, Any],
    foreach: bool | None,
) -> None:
    """docs/ddp-communication.md: FabricLanguageModelTrainer builds Adam (SGD: the test above) with foreach=True
    unless the caller chose; the caller's foreach=False or fused=True is kept. (AdamW: flair's LanguageModelTrainer
    anneals it with its ReduceLRWDOnPlateau, which fails under torch 2.13 in flair's own trainer as well.)"""
    built: list[torch.optim.Optimizer] = []
    build = loop_module.build_optimizer

    def recording(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(loop_module, "build_optimizer", recording)
    options: dict[str, Any] = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 4, "learning_rate": 1e-3, **choice}
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus, optimizer=optimizer)
    trainer.train(tmp_path, devices=1, accelerator="cpu", **options)
    assert built and {type(each) for each in built} == {optimizer}
    assert {group["foreach"] for each in built for group in each.param_groups} == {foreach}


def test_an_optimizer_class_given_to_the_trainer_gets_the_keyword_arguments_as_in_flair(
    corpus: TextCorpus, tmp_path: Path
) -> None:
    """RMSprop given to the trainer, with momentum and weight_decay given to train: the weights and loss.txt of
    flair's trainer with the same class and arguments (SGD, which takes them too, trains otherwise)."""
    model = tiny_language_model(corpus)
    theirs, ours, plain = copy_model(model), copy_model(model), copy_model(model)
    options: dict[str, Any] = {**LM_OPTIONS, "mini_batch_size": 4, "max_epochs": 1, "learning_rate": 0.01}
    options.update(momentum=0.5, weight_decay=1e-3)
    seeded()
    LanguageModelTrainer(theirs, corpus, optimizer=torch.optim.RMSprop).train(tmp_path / "flair", **options)
    seeded()
    trainer = FabricLanguageModelTrainer(ours, corpus, optimizer=torch.optim.RMSprop)
    trainer.train(tmp_path / "ours", devices=1, accelerator="cpu", **options)
    assert _relative_difference(theirs, ours) <= 1e-6
    assert summaries(tmp_path / "ours") == summaries(tmp_path / "flair")
    seeded()
    LanguageModelTrainer(plain, corpus).train(tmp_path / "sgd", **options)
    assert _relative_difference(theirs, plain) > 1e-3, "SGD would have trained otherwise: the class matters here"


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


def _journal_the_runs(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Every rank of the runs that follow (forked ranks inherit it) keeps a journal in ``folder`` (lm_support)."""
    for owner, name, method in journaled(folder):
        monkeypatch.setattr(owner, name, method)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_two_processes_with_2_columns_train_as_one_with_4(
    corpus: TextCorpus,
    one_process_4_columns: tuple[LanguageModel, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
) -> None:
    """2 ranks x 2 columns end with the weights, loss.txt and best-lm.pt of one process with 4. The forked ranks
    (which inherit the spies) show it split by split: each trained the text one process trained, from the same
    generators, and each got the one process's held-out loss (their journals); and global rank 0 alone wrote the
    files (every model save and file access recorded with its rank), though rank 1 is made its node's local rank 0
    here, as on a second machine."""
    reference, reference_run = one_process_4_columns
    model = tiny_language_model(corpus)
    writers, files, journals = tmp_path / "writers" / "saves.txt", tmp_path / "files.txt", tmp_path / "journals"
    forked = strategy == "ddp_fork"
    if forked:  # the forked ranks inherit the spies
        _record_model_saves(monkeypatch, writers)
        _journal_the_runs(monkeypatch, journals)
        monkeypatch.setattr(Fabric, "local_rank", property(lambda self: 0))  # each rank: the first of its machine
    seeded()
    try:
        with file_accesses(tmp_path / "run", files):
            FabricLanguageModelTrainer(model, corpus).train(
                tmp_path / "run",
                mini_batch_size=2,
                devices=2,
                strategy=strategy,
                accelerator="cpu",
                collective_timeout=30,
                **LM_OPTIONS,
            )
    finally:
        if forked:  # ranks that fell out of step: where they parted
            assert_journals_agree(journals, 2, reference_run / "journal")
    assert _relative_difference(reference, model) <= 1e-5, "the caller's model holds the trained weights"
    assert summaries(tmp_path / "run") == summaries(reference_run), "validation and test perplexity as in one process"
    log = (tmp_path / "run" / "training.log").read_text()
    assert log.count("| end of split   2 /  3 | epoch   1") == 1, "each split logged once"
    best = LanguageModel.load_language_model(tmp_path / "run" / "best-lm.pt")
    assert _relative_difference(reference, best) <= 1e-5, "the last split had the best validation loss"
    if forked:
        assert_journals_agree(journals, 2, reference_run / "journal", whole=True)
        assert len(journal(journals, 0)) == 6 * 4 + 2, "6 splits trained, validated and agreed on, the test scored"
        saves = writers.read_text().splitlines()
        assert sorted(set(saves)) == ["0 best-lm.pt", "0 epoch_1.pt"], "best-lm.pt and epoch_N.pt by rank 0 only"
        touched = accesses(files)
        assert {rank for rank, _, _ in touched} - {-1} == {0}, f"only global rank 0 touched the run's files: {touched}"
        appends = [rank for rank, access, path in touched if path == "loss.txt"]
        assert appends == [0] * 7, "loss.txt: a line for each of the 6 splits and the TEST line, by global rank 0"


@pytest.mark.multiprocess
def test_the_script_relaunch_ends_with_the_same_weights_on_every_rank(
    one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    """Each relaunched copy of the script makes its own corpus and, on rank 1, has other generators when it calls
    train: every rank starts from global rank 0's caller's generators and scores rank 0's held-out text, and the run
    ends as one process with the 4 columns and rank 0's generators; split by split, each rank trained one process's
    text from its generators and got its held-out losses (their journals)."""
    reference, reference_run = one_process_4_columns
    try:
        run_script("language_model_ddp_own_generators.py", str(tmp_path))
    finally:  # ranks that fell out of step: where they parted
        assert_journals_agree(tmp_path / "journals", 2, reference_run / "journal")
    assert_journals_agree(tmp_path / "journals", 2, reference_run / "journal", whole=True)
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


class _NoBetterAtValidations4And5(FabricLanguageModelTrainer):
    """Reports the 4th and 5th validations of a run (splits 1 and 2 of epoch 2) 1.0 worse, so that the split before
    the resume point and the first after it do not improve; dies (SIGKILL, every rank) during validation ``kill_at``,
    before that split's state is saved. Validations are counted in files under ``self.counts``, across the kill and
    the resume."""

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
        return loss + 1.0 if number in (4, 5) else loss


def _best_losses(run: Path) -> list[str]:
    """The best validation loss so far after every split, as training.log says it."""
    return re.findall(r"best loss so far (\S+)", (run / "training.log").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_killed_in_the_middle_of_an_epoch_resumes_to_the_uninterrupted_result(
    corpus: TextCorpus, tmp_path: Path, devices: int
) -> None:
    """Killed after split 1 of epoch 2 was saved, the run resumes to the weights, loss.txt, best-lm.pt and best-loss
    log of the uninterrupted run: the weights, optimizer (momentum), plateau schedule (patience 1: splits 1 and 2 of
    epoch 2 do not improve, so the learning rate anneals after split 2 only because split 1's bad count is carried
    over), grown sequence length, best validation loss (not replaced by the worse split) and generators (dropout)
    are restored. On 2 ranks every dropout draw of each rank comes from the same generators (their journals), and
    global rank 0 alone writes flair's files (best-lm.pt, epoch_N.pt, checkpoint.pt, loss.txt, training.log), though
    rank 1 is made its node's local rank 0 here."""
    options = {**LM_OPTIONS, "mini_batch_size": 4 // devices, "checkpoint": True, "accelerator": "cpu"}
    options.update(patience=1, grow_to_sequence_length=30, momentum=0.2)
    # one forked worker too (SIGKILL spares the test); ranks that fell out of step end the run soon
    options.update(devices=devices, strategy="ddp_fork", collective_timeout=30)
    model = tiny_language_model(corpus, dropout=0.2)  # dropout: the generators must be restored as well
    uninterrupted, killed = copy_model(model), copy_model(model)
    journals = tmp_path / "journals"
    journaled_dropout(uninterrupted, journals)
    seeded()
    with pytest.MonkeyPatch.context() as patch, file_accesses(tmp_path / "whole", tmp_path / "files.txt"):
        _journal_the_runs(patch, journals)
        patch.setattr(Fabric, "local_rank", property(lambda self: 0))  # each rank: the first of its machine
        whole = _NoBetterAtValidations4And5(uninterrupted, corpus, counts=tmp_path / "whole-counts")
        try:
            whole.train(tmp_path / "whole", **options)
        finally:  # ranks that drew from other generators: where they parted
            assert_journals_agree(journals, devices)
    flairs_files = [(rank, path) for rank, _, path in accesses(tmp_path / "files.txt") if "/" not in path]
    if devices == 2:
        assert {rank for rank, _ in flairs_files} - {-1} == {0}, f"flair's files by global rank 0 only: {flairs_files}"
    assert {path for _, path in flairs_files} >= {
        "best-lm.pt",
        "epoch_1.pt",
        "checkpoint.pt",
        "loss.txt",
        "training.log",
    }
    assert_journals_agree(journals, devices, whole=True)
    assert sum(entry.startswith("dropout") for entry in journal(journals, devices - 1)) > 100, "dropout was drawn"
    rates = [line.split("learning rate")[1] for line in summaries(tmp_path / "whole")[:-1]]
    assert rates[:5] == [rates[0]] * 5 and rates[5] != rates[4], "annealed after split 2 of epoch 2, not before"
    seeded()
    with pytest.raises(
        ProcessExitedException, match=r"SIGKILL|signal 9"
    ):  # split 2 of epoch 2; the last state: after split 1
        _NoBetterAtValidations4And5(killed, corpus, counts=tmp_path / "counts", kill_at=5).train(
            tmp_path / "killed", **options
        )
    assert len(summaries(tmp_path / "killed")) == 4
    flairs = FabricLanguageModelTrainer.load_checkpoint(tmp_path / "killed" / "checkpoint.pt", corpus)
    assert (type(flairs), flairs.epoch, flairs.split) == (FabricLanguageModelTrainer, 1, 1), "flair's checkpoint.pt"
    seeded(99)  # other generators in the caller: the checkpoint's are used
    resumed = _NoBetterAtValidations4And5(killed, corpus, counts=tmp_path / "counts")
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


@pytest.mark.multiprocess
def test_a_run_resumes_on_another_number_of_processes_with_the_same_columns(
    corpus: TextCorpus,
    one_process_4_columns: tuple[LanguageModel, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-process run of 4 columns that failed in epoch 2 continues on 2 processes with mini_batch_size=2 (the same
    4 columns; ddp_notebook, whose workers hand the weights back) to the uninterrupted one-process result; global
    rank 0 alone opens a file of the checkpoint (the other rank gets it by broadcast), though rank 1 is made its
    node's local rank 0 here, as on a second machine. Another number of columns is refused, on 1 process and on 2,
    naming the mini_batch_size to pass."""
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
    refusal = r"trained on 4 columns .* this run has 2: pass mini_batch_size=2 or resume"  # from the workers
    with pytest.raises(ProcessRaisedException, match=refusal):
        FabricLanguageModelTrainer(copy_model(model), corpus).train(
            mini_batch_size=1, devices=2, strategy="ddp_fork", resume_from="auto", **options
        )
    reads = tmp_path / "reads.txt"
    monkeypatch.setattr(Fabric, "local_rank", property(lambda self: 0))  # each rank: the first of its machine
    seeded(99)  # other generators in the caller: the checkpoint's are used
    try:
        with file_accesses(tmp_path / "run" / "checkpoints", reads):
            FabricLanguageModelTrainer(model, corpus).train(
                mini_batch_size=2, devices=2, strategy="ddp_notebook", resume_from="auto", **options
            )
    except ProcessRaisedException as error:
        if "columns (mini_batch_size x processes)" in str(error):
            pytest.fail(f"the resume with the same 4 columns on 2 processes was refused: {error}")
        raise
    read = {(rank, path.split("/")[-1]) for rank, access, path in accesses(reads) if access == "read" and rank >= 0}
    assert {rank for rank, _ in read} == {0}, f"of the ranks, global rank 0 alone read the checkpoint: {read}"
    assert {name for _, name in read if "." in name} == {"state.ckpt", "extras.pt", "progress.json"}, read  # files
    assert _relative_difference(reference, model) <= 1e-5, "the caller's model holds the trained weights"
    assert summaries(tmp_path / "run") == summaries(reference_run)


class _InterruptedOnOneRank(FabricLanguageModelTrainer):
    """``interruption`` (a signal) reaches global rank ``interrupted`` alone, while it scores the validation split
    after split 2."""

    interruption, interrupted = signal.SIGINT, 1

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        self.scores = getattr(self, "scores", 0) + 1
        if self.scores == 2 and torch.distributed.get_rank() == self.interrupted:
            os.kill(os.getpid(), self.interruption)
        return super().evaluate(data_source, eval_batch_size, sequence_length)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("interruption", "interrupted"), [(signal.SIGINT, 1), (signal.SIGTERM, 0)])
def test_ctrl_c_on_one_rank_stops_every_rank_then_the_test_split_is_scored(
    corpus: TextCorpus,
    one_process_4_columns: tuple[LanguageModel, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    interruption: signal.Signals,
    interrupted: int,
) -> None:
    """A Ctrl-C on rank 1 alone (or a SIGTERM on rank 0 alone), during split 2: both ranks stop at the end of split 2
    (train returns; each rank's journal: splits 1 and 2 as one process trained them, then the test split scored),
    and the test split is scored, as in flair, with the model they stopped with (flair's evaluate of the caller's
    model)."""
    _, reference_run = one_process_4_columns
    model = tiny_language_model(corpus)
    journals = tmp_path / "journals"
    _journal_the_runs(monkeypatch, journals)
    monkeypatch.setattr(_InterruptedOnOneRank, "interruption", interruption)
    monkeypatch.setattr(_InterruptedOnOneRank, "interrupted", interrupted)
    run = tmp_path / "run"
    seeded()
    try:
        _InterruptedOnOneRank(model, corpus).train(
            run,
            mini_batch_size=2,
            devices=2,
            strategy="ddp_fork",
            accelerator="cpu",
            collective_timeout=30,
            **LM_OPTIONS,
        )
    except KeyboardInterrupt:  # pytest would end the session on it
        pytest.fail("the Ctrl-C on rank 1 reached the caller instead of stopping the ranks together")
    except ProcessExitedException as error:
        if f"signal {interruption.name}" not in str(error):
            raise
        pytest.fail(f"the {interruption.name} ended rank {interrupted} instead of stopping the ranks together")
    finally:  # a rank that stopped alone: where the ranks parted
        assert_journals_agree(journals, 2)
    trained = [to_four_decimals(entry) for entry in journal(reference_run / "journal", 0)[:8]]  # splits 1 and 2
    for rank in (0, 1):
        entries = journal(journals, rank)
        assert [to_four_decimals(entry) for entry in entries[:8]] == trained, f"rank {rank}: splits 1 and 2"
        assert len(entries) == 10 and entries[8].startswith(f"score text {digest(corpus.test)} "), entries[8:]
    lines = summaries(run)
    assert lines[:2] == summaries(reference_run)[:2], "splits 1 and 2 trained as without the interruption"
    assert len(lines) == 3 and lines[2].startswith("TEST: "), "stopped after split 2, then the test split"
    assert (run / "training.log").read_text().count("Exiting from training early") == 1
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
    ({"devices": 0}, r"devices=0 is not valid: pass a positive number of devices"),  # FabricTrainer's launch checks
    ({"num_nodes": 0}, r"num_nodes=0 is not valid: pass the number of machines"),
    ({"accelerator": "tpu"}, r"accelerator='tpu' is not supported; choose one of auto, cpu, cuda"),
    ({"strategy": "deepspeed", "devices": 2}, r"strategy='deepspeed' needs the deepspeed package"),  # not installed
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


def test_a_base_path_url_is_refused_before_any_process_starts(
    corpus: TextCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL base_path (FabricTrainer's, docs/storage.md) is refused by name; it never becomes a local folder."""
    no_process_may_start(monkeypatch)
    with pytest.raises(ValueError, match=r"base_path='s3://bucket/lm': FabricLanguageModelTrainer writes to a local"):
        FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(
            "s3://bucket/lm", mini_batch_size=2, accelerator="cpu", devices=1, **LM_OPTIONS
        )
    assert not Path("s3:").exists()


def test_a_corpus_without_split_files_is_refused(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty train/ is refused before a Fabric is built or a process started, naming the folder."""
    no_process_may_start(monkeypatch)
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
    assert "bf16_error" not in result, "the bf16-mixed run stopped at oneDNN's bfloat16 LSTM, as flair's does"
    assert result["bf16_from_float32"] <= 0.1 * result["trained_by"]
    assert result["validation_perplexities"][-1] < result["validation_perplexities"][0]


class _FailsAtTheFirstValidation(FabricLanguageModelTrainer):
    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        raise RuntimeError("the run failed")


def test_onednn_is_off_for_a_run_that_needs_it_and_restored_afterwards(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where oneDNN has no bfloat16 LSTM (made so here, whatever this CPU has), a bf16-mixed run trains with
    torch.backends.mkldnn.enabled off, says so once in the log, and the setting is back to what it was when train
    returns (on) or fails (off before that run)."""
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
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # the caller had it off
        with pytest.raises(RuntimeError, match="the run failed"):
            _FailsAtTheFirstValidation(model, corpus).train(tmp_path / "failed", precision="bf16-mixed", **options)
        assert not torch.backends.mkldnn.enabled, "oneDNN back off, as before the run, when the run failed"
    finally:
        logging.getLogger("flair").removeHandler(handler)


def test_gradients_are_unscaled_before_clipping_under_16_mixed(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under 16-mixed Fabric's gradient scaler multiplies the loss (by 65536) before the backward pass; clipping to
    ``clip`` must see the unscaled gradients, so the run trains as 32-true does (clipping the scaled gradients would
    shrink every step 65536-fold). Fabric's 16-mixed plugin with its scaler, here on a CPU, with oneDNN off (it has
    no float16 LSTM on most CPUs): the LSTM stays in float32 and the result close to 32-true's. Training's forward
    pass runs under Fabric's autocast: the decoder computes in float16, the embedding lookup stays in float32."""
    model = tiny_language_model(corpus)
    reference, mixed = copy_model(model), copy_model(model)
    computed: dict[str, set[torch.dtype]] = {"decoder": set(), "encoder": set()}
    for name, dtypes in computed.items():
        getattr(mixed, name).register_forward_hook(
            lambda module, inputs, output, dtypes=dtypes: dtypes.add(output.dtype) if module.training else None
        )
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
    assert computed == {"decoder": {torch.float16}, "encoder": {torch.float32}}, computed
    validation = validation_perplexities(tmp_path / "16-mixed")
    assert validation[-1] < validation[0]


@pytest.mark.parametrize("precision", FABRIC_PRECISIONS)
def test_every_precision_name_trains_or_is_refused_before_anything_starts(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: Any
) -> None:
    """32-true and bf16-mixed (every spelling) train, the forward pass of training under Fabric's autocast (the
    decoder computes in bfloat16 under bf16-mixed, the embedding lookup stays in float32); precisions that convert
    the whole model, CUDA-only ones on a CPU and Transformer Engine's are refused before a Fabric is built or
    anything written, the precision named, with the fix."""
    model = tiny_language_model(corpus)
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    name = str(precision)
    if name in ("32", "32-true", "bf16", "bf16-mixed"):
        decoded: list[torch.dtype] = []
        looked_up: list[torch.dtype] = []
        model.decoder.register_forward_hook(
            lambda module, inputs, output: decoded.append(output.dtype) if module.training else None
        )
        model.encoder.register_forward_hook(
            lambda module, inputs, output: looked_up.append(output.dtype) if module.training else None
        )
        FabricLanguageModelTrainer(model, corpus).train(tmp_path / "run", precision=precision, **options)
        assert len(summaries(tmp_path / "run")) == 4, "3 splits and the test line"
        assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
        expected = torch.bfloat16 if name.startswith("bf16") else torch.float32
        assert decoded and set(decoded) == {expected}, f"training's forward pass under {precision!r}: {set(decoded)}"
        assert looked_up and set(looked_up) == {torch.float32}, f"the embedding lookup: {set(looked_up)}"
    else:
        if name in ("64", "64-true", "bf16-true"):  # the whole model cast: the language-model trainer's refusal
            fix = r" \(\S+\) casts the whole model, .* pass precision='32-true', 'bf16-mixed' or, on a GPU, '16-mixed'"
        elif name.startswith("transformer-engine"):
            fix = r" is not supported by flair-fabric: .*use precision='bf16-mixed'"
        else:  # 16-bit float needs CUDA: refused on a CPU first (tests/language_model/test_language_model_launch.py)
            fix = r" needs a CUDA GPU; on cpu use precision='bf16-mixed' instead"
        no_process_may_start(monkeypatch)
        with pytest.raises(ValueError, match=re.escape(f"precision={precision!r}") + fix):
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


class _FailingCheckpointSave(LanguageModel):
    """A language model whose ``fail_at``-th ``save_checkpoint`` (flair's checkpoint files) writes half a file and
    fails; the first one it completes is kept in ``first_write``."""

    fail_at, calls, first_write = 0, 0, b""

    def save_checkpoint(self, file: Any, *args: Any, **kwargs: Any) -> None:
        type(self).calls += 1
        if type(self).calls == type(self).fail_at:
            Path(file).write_bytes(b"half a checkpoint")
            raise OSError("No space left on device")
        super().save_checkpoint(file, *args, **kwargs)
        if type(self).calls == 1:
            type(self).first_write = Path(file).read_bytes()


@pytest.mark.parametrize(
    ("name", "fail_at", "run_options"),
    [("checkpoint.pt", 2, {"checkpoint": True, "max_epochs": 1}), ("epoch_1.pt", 1, {"max_epochs": 2})],
)
def test_checkpoint_files_are_replaced_only_by_complete_files(
    corpus: TextCorpus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    fail_at: int,
    run_options: dict[str, Any],
) -> None:
    """checkpoint.pt (after every split) and epoch_N.pt (at the start of an epoch) go through a temporary file and a
    rename as well: a write that fails half-way leaves the previous checkpoint.pt whole (and epoch_1.pt not there at
    all), and no temporary file behind."""
    model = tiny_language_model(corpus)
    model.__class__ = _FailingCheckpointSave
    for attribute, value in (("fail_at", fail_at), ("calls", 0), ("first_write", b"")):
        monkeypatch.setattr(_FailingCheckpointSave, attribute, value)
    run = tmp_path / "run"
    options = {**LM_OPTIONS, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1, **run_options}
    with pytest.raises(OSError, match="No space left"):
        FabricLanguageModelTrainer(model, corpus).train(run, **options)
    assert _FailingCheckpointSave.calls == fail_at, f"the failing write was {name}'s"
    if fail_at == 1:
        assert not (run / name).exists(), f"no half-written {name}"
    else:
        assert (run / name).read_bytes() == _FailingCheckpointSave.first_write, "the first split's, whole"
        assert LanguageModelTrainer.load_checkpoint(run / name, corpus).split == 1
    assert sorted(path.name for path in run.iterdir() if path.name.startswith(".")) == []
