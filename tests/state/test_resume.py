"""Checkpoints that survive a crash during a save; resume on one device and on another world size; bad input."""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.data import Dictionary
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricTrainer, FlairDDPStrategy, FlairFSDPStrategy
from flair_fabric.datasets import TREC_LABEL_TYPE
from flair_fabric.state.training_state import (
    checkpoint_to_resume,
    newest_checkpoint,
    read_progress,
)

from ..support import no_training_may_start, small_trec, state_dict_difference, tiny_text_classifier

# SGD with annealing, shuffled batches and dropout on one device
ONE_DEVICE = {
    "mini_batch_size": 8,
    "learning_rate": 0.5,
    "accelerator": "cpu",
    "devices": 1,
    "embeddings_storage_mode": "none",
    "checkpoint_every_n_epochs": 1,
    "use_final_model_for_eval": True,  # compare the trained weights, not the best epoch's
}


def _classifier(**options: Any) -> tuple[TextClassifier, Any]:
    corpus = small_trec()
    return tiny_text_classifier(corpus, dropout=0.3, **options), corpus


def _loss_rows(folder: Path) -> list[list[str]]:
    """loss.tsv's rows without the TIMESTAMP column."""
    rows = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    timestamp = rows[0].index("TIMESTAMP")
    return [row[:timestamp] + row[timestamp + 1 :] for row in rows]


class _SchedulersAtEpochStart(TrainerPlugin):
    """At the start of every epoch (after the previous epoch's evaluation and the annealing step it made): the state
    of every plugin's learning-rate scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, list[dict[str, Any]]] = {}

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        schedulers = [plugin.scheduler for plugin in self.trainer.plugins if getattr(plugin, "scheduler", None)]
        self.seen[epoch] = [copy.deepcopy(scheduler.state_dict()) for scheduler in schedulers]


def test_resuming_on_one_device_gives_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """SGD annealed on plateau after every epoch that is not better (patience 0; epoch 2 is the best, epoch 3 worse,
    so the annealing after epoch 3 needs the state restored from epoch 2's checkpoint): a run of 2 epochs resumed to 4
    (resume_from="auto"), and the uninterrupted run's epoch-2 checkpoint folder resumed in a copy of its folder
    (the checkpoints after it removed first; with them it is refused) and into another folder, end with the
    uninterrupted weights and loss.tsv."""
    annealed = {**ONE_DEVICE, "learning_rate": 1.0, "patience": 0, "anneal_factor": 0.5}
    model, corpus = _classifier()
    schedulers = _SchedulersAtEpochStart()
    FabricTrainer(model, corpus).train(
        tmp_path / "once", max_epochs=4, keep_checkpoints=4, plugins=[schedulers], **annealed
    )
    rows = _loss_rows(tmp_path / "once")
    learning_rates = [float(row[rows[0].index("LEARNING_RATE")]) for row in rows[1:]]
    assert learning_rates == [1.0, 1.0, 1.0, 0.5], "epoch 3 is worse than epoch 2 (the best): annealed after it"
    first, corpus = _classifier()
    FabricTrainer(first, corpus).train(tmp_path / "twice", max_epochs=2, **annealed)
    saved = torch.load(newest_checkpoint(tmp_path / "twice") / "extras.pt")["schedulers"]
    assert len(schedulers.seen[3]) == 1, "AnnealOnPlateau"
    assert list(saved.values()) == schedulers.seen[3], "the checkpoint holds the annealing after epoch 2's evaluation"
    second, corpus = _classifier()
    FabricTrainer(second, corpus).train(tmp_path / "twice", max_epochs=4, resume_from="auto", **annealed)
    assert state_dict_difference(model.state_dict(), second.state_dict()) <= 1e-7
    assert state_dict_difference(first.state_dict(), second.state_dict()) > 1e-3
    assert _loss_rows(tmp_path / "twice") == _loss_rows(tmp_path / "once"), "the same losses and learning rates"

    # an explicit, older checkpoint folder: refused where newer checkpoints of the run would outlive the resumed run's
    after_two = tmp_path / "once" / "checkpoints" / f"step-{2 * 6:09d}"  # 6 steps per epoch
    assert read_progress(after_two).epoch == 2
    with pytest.raises(ValueError, match=r"is older than the newest checkpoint .*step-000000024"):
        FabricTrainer(_classifier()[0], corpus).train(
            tmp_path / "once", max_epochs=4, resume_from=after_two, **annealed
        )
    shutil.copytree(tmp_path / "once", tmp_path / "branch")
    for newer in ("step-000000018", "step-000000024"):
        shutil.rmtree(tmp_path / "branch" / "checkpoints" / newer)
    third, corpus = _classifier()
    FabricTrainer(third, corpus).train(
        tmp_path / "branch",
        max_epochs=4,
        resume_from=tmp_path / "branch" / after_two.relative_to(tmp_path / "once"),
        **annealed,
    )
    assert state_dict_difference(model.state_dict(), third.state_dict()) <= 1e-7
    assert _loss_rows(tmp_path / "branch") == _loss_rows(tmp_path / "once"), "rows 3 and 4 dropped and written again"
    # the same older folder resumed into another base_path, for one more epoch: the weights after epoch 3
    elsewhere, corpus = _classifier()
    FabricTrainer(elsewhere, corpus).train(tmp_path / "elsewhere", max_epochs=3, resume_from=after_two, **annealed)
    after_three = torch.load(tmp_path / "once" / "checkpoints" / f"step-{3 * 6:09d}" / "state.ckpt")["model"]
    assert state_dict_difference(after_three, elsewhere.state_dict()) <= 1e-7


class _ScriptedDevScores(TextClassifier):
    """Its dev score per epoch is fixed: best after epoch 2, worse after epochs 3 and 4."""

    SCORES = {1: 0.5, 2: 0.9, 3: 0.3, 4: 0.4}

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        result = super().evaluate(*args, **kwargs)
        result.main_score = self.SCORES[self.model_card["training_parameters"]["epoch"]]
        return result


def test_a_resumed_run_keeps_the_best_score_and_replaces_best_model_pt_only_with_a_better_epoch(
    tmp_path: Path,
) -> None:
    """Resumed after epoch 2 (the best, 0.9), epochs 3 (0.3) and 4 (0.4) are worse than the best so far: the resumed
    run leaves best-model.pt as it was, as the uninterrupted run does."""
    settings = {**ONE_DEVICE, "use_final_model_for_eval": False}  # best-model.pt is written

    def train(base_path: Path, **options: Any) -> None:
        model, corpus = _classifier(model_class=_ScriptedDevScores)
        FabricTrainer(model, corpus).train(base_path, **settings, **options)

    train(tmp_path / "once", max_epochs=4)
    train(tmp_path / "twice", max_epochs=2)
    best_after_two = (tmp_path / "twice" / "best-model.pt").read_bytes()
    train(tmp_path / "twice", max_epochs=4, resume_from="auto")
    assert read_progress(newest_checkpoint(tmp_path / "twice")).epoch == 4
    assert read_progress(newest_checkpoint(tmp_path / "twice")).best_epoch_score == 0.9
    assert (tmp_path / "twice" / "best-model.pt").read_bytes() == best_after_two, "a worse epoch replaced it"
    uninterrupted = TextClassifier.load(tmp_path / "once" / "best-model.pt").state_dict()
    assert (
        state_dict_difference(uninterrupted, TextClassifier.load(tmp_path / "twice" / "best-model.pt").state_dict())
        <= 1e-7
    )


class _EpochStart(TrainerPlugin):
    """On global rank 0, at the start of every epoch: the weights, the learning rate, the optimizer's momentum
    buffers and the plugins' schedulers' state, saved to ``<out>/epoch-start.pt`` after training."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.seen = Path(out), {}

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **kw: Any) -> None:
        optimizer = self.trainer.optimizer
        self.seen[epoch] = {
            "weights": {name: value.detach().clone() for name, value in self.model.state_dict().items()},
            "lr": optimizer.param_groups[0]["lr"],
            "momentum": [state["momentum_buffer"].clone() for state in optimizer.state.values()],
            "schedulers": [
                copy.deepcopy(plugin.scheduler.state_dict())
                for plugin in self.trainer.plugins
                if getattr(plugin, "scheduler", None)
            ],
        }

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.is_global_zero:
            torch.save(self.seen, self.out / "epoch-start.pt")


@pytest.mark.multiprocess
def test_a_checkpoint_of_one_process_resumes_on_two(tmp_path: Path) -> None:
    with_momentum = {**ONE_DEVICE, "momentum": 0.9}  # optimizer state that a resume must carry over
    model, corpus = _classifier()
    FabricTrainer(model, corpus).train(tmp_path, max_epochs=2, **with_momentum)
    first_run = torch.load(newest_checkpoint(tmp_path) / "state.ckpt")
    first_schedulers = torch.load(newest_checkpoint(tmp_path) / "extras.pt")["schedulers"]
    resumed, corpus = _classifier()
    settings = {**with_momentum, "devices": 2, "strategy": "ddp_fork", "plugins": [_EpochStart(tmp_path)]}
    FabricTrainer(resumed, corpus).train(tmp_path, max_epochs=3, resume_from="auto", **settings)
    log = (tmp_path / "training.log").read_text()
    assert "resuming a checkpoint of 1 process(es) on 2" in log and "EPOCH 3 done" in log
    assert read_progress(newest_checkpoint(tmp_path)).epoch == 3
    assert [line.split("\t")[0] for line in (tmp_path / "loss.tsv").read_text().splitlines()] == [
        "EPOCH",
        "1",
        "2",
        "3",
    ]
    # model, optimizer and schedule continue where the one-process run stopped
    start = torch.load(tmp_path / "epoch-start.pt")[3]
    assert state_dict_difference(start["weights"], model.state_dict()) <= 1e-7
    saved_momentum = [state["momentum_buffer"] for state in first_run["optimizer"]["state"].values()]
    assert len(start["momentum"]) == len(saved_momentum) > 0
    assert all(torch.equal(a, b) for a, b in zip(start["momentum"], saved_momentum, strict=True))
    assert start["lr"] == first_run["optimizer"]["param_groups"][0]["lr"]
    assert len(start["schedulers"]) == 1, "AnnealOnPlateau"
    assert start["schedulers"] == list(first_schedulers.values()), "the annealing continues from its saved state"


@contextlib.contextmanager
def _refused(pattern: str) -> Iterator[None]:
    """The block must be refused with a ValueError whose message matches ``pattern``. The refusals here are about
    folders and files (base_path, resume_from, a checkpoint): the file system's own error (a folder that cannot be
    made, a progress.json that is not there) reaching the caller instead is the input not refused."""
    with pytest.raises(ValueError) as raised:
        try:
            yield
        except OSError as error:
            pytest.fail(f"not refused with a ValueError that explains it, but {error!r}")
    assert re.search(pattern, str(raised.value)), f"{pattern!r} not in {raised.value}"


def _with_reversed_labels(model: TextClassifier) -> TextClassifier:
    """``model`` with its label dictionary's items in the other order (e.g. built by iterating a set)."""
    labels = Dictionary(add_unk=False)
    for item in reversed(model.label_dictionary.get_items()):
        labels.add_item(item)
    model.label_dictionary = labels
    return model


def _with_other_shapes(corpus: Any) -> TextClassifier:
    """The tiny classifier with the same vocabulary and labels, but embeddings of another length."""
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=8)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(DocumentPoolEmbeddings([words]), label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def test_bad_resume_and_base_path_input_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, corpus = _classifier()
    FabricTrainer(model, corpus).train(tmp_path / "run", max_epochs=1, **ONE_DEVICE)
    files = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    checkpoint = newest_checkpoint(tmp_path / "run")
    assert checkpoint is not None
    try:  # the checkpoint's own epoch is no contradiction: accepted
        assert checkpoint_to_resume(model, tmp_path / "run", 1, "auto") == (checkpoint, 1)
    except ValueError as refused:
        pytest.fail(f"epoch= equal to the checkpoint's epoch was refused: {refused}")
    leftover = tmp_path / "leftover"  # what a crash before the last file leaves: no progress.json
    shutil.copytree(checkpoint, leftover)
    (leftover / "progress.json").unlink()

    no_training_may_start(monkeypatch)  # every refusal comes before the run starts
    other_model = tiny_text_classifier(small_trec(train_size=40, seed=5))  # another vocabulary
    with _refused(r"was written for another model \(differs in: .*vocab_dictionary"):
        FabricTrainer(other_model, corpus).train(tmp_path / "run", max_epochs=2, resume_from="auto", **ONE_DEVICE)
    with _refused(r"was written for another model \(differs in: parameters\)"):
        FabricTrainer(_with_other_shapes(corpus), corpus).train(
            tmp_path / "run", max_epochs=2, resume_from="auto", **ONE_DEVICE
        )
    relabelled = _with_reversed_labels(tiny_text_classifier(corpus))
    with _refused(r"was written for another model \(differs in: dictionary \.label_dictionary\)"):
        FabricTrainer(relabelled, corpus).train(tmp_path / "run", max_epochs=2, resume_from="auto", **ONE_DEVICE)
    with _refused(r"is not a flair-fabric checkpoint \(no progress.json in it\)"):
        FabricTrainer(model, corpus).train(tmp_path / "new", resume_from=tmp_path, **ONE_DEVICE)
    with _refused(r"is not a flair-fabric checkpoint \(no progress.json in it\)"):
        FabricTrainer(model, corpus).train(tmp_path / "new", resume_from=leftover, **ONE_DEVICE)
    with _refused(r"epoch=2 and resume_from=.* \(which ends at epoch 1\) were both given"):
        FabricTrainer(model, corpus).train(tmp_path / "run", epoch=2, resume_from="auto", **ONE_DEVICE)
    for argument, value in [
        ("checkpoint_every_n_epochs", -1),
        ("checkpoint_every_n_steps", 2.5),
        ("checkpoint_every_n_minutes", True),
        ("keep_checkpoints", True),
    ]:
        with _refused(rf"{argument}={value!r} is not valid"):
            FabricTrainer(model, corpus).train(tmp_path / "run", **{**ONE_DEVICE, argument: value})
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with _refused(r"base_path=.*a-file/out' cannot be written .*: pass a folder you can"):
        FabricTrainer(model, corpus).train(blocker / "out", **ONE_DEVICE)
    with _refused(r"base_path='/sys' cannot be written \(Permission denied\)"):  # a folder no one may write in
        FabricTrainer(model, corpus).train(Path("/sys"), **ONE_DEVICE)
    assert {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()} == files
    assert not (tmp_path / "new").exists()


class _CreatesAFile:
    """Unpickling this object creates ``path``: a stand-in for code an attacker would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_tampered_checkpoint_is_refused_and_runs_nothing(tmp_path: Path, strategy: str) -> None:
    model, corpus = _classifier()

    def settings() -> dict[str, Any]:
        chosen = FlairDDPStrategy(start_method="fork") if strategy == "ddp" else FlairFSDPStrategy(start_method="fork")
        return {**ONE_DEVICE, "devices": 2, "strategy": chosen}

    umask = os.umask(0)  # the most permissive umask (forked ranks inherit it): the checkpoint is private all the same
    try:
        FabricTrainer(model, corpus).train(tmp_path / "run", max_epochs=1, **settings())
    finally:
        os.umask(umask)
    written = newest_checkpoint(tmp_path / "run")
    # the checkpoint is the user's alone, whatever the umask
    assert all(
        (path.stat().st_mode & 0o777) == (0o700 if path.is_dir() else 0o600) for path in [written, *written.rglob("*")]
    )
    files = sorted(path.relative_to(written) for path in written.rglob("*") if path.is_file())
    assert len(files) >= (3 if strategy == "ddp" else 6), files  # under fsdp: .metadata, .distcp files, meta.pt
    marker = tmp_path / "code-ran"
    for relative in files:
        tampered = tmp_path / f"tampered-{relative.name}"
        shutil.copytree(written, tampered)
        (tampered / relative).chmod(0o600)
        with (tampered / relative).open("wb") as stream:
            pickle.dump(_CreatesAFile(marker), stream)
        resumed, corpus = _classifier()
        refusal = rf"{re.escape(relative.name)}.* nothing in it was run"
        try:
            with pytest.raises((ValueError, ProcessRaisedException)) as refused:
                FabricTrainer(resumed, corpus).train(
                    tmp_path / "resumed", max_epochs=2, resume_from=tampered, **settings()
                )
        finally:  # also where the file was loaded anyway and the run went wrong later
            assert not marker.exists(), f"replacing {relative} ran code"
        # refused in the caller, before any process starts: a refusal from a worker comes too late
        assert refused.type is ValueError, f"{relative} was not refused before launch: {refused.value}"
        assert re.search(refusal, str(refused.value)), str(refused.value)
