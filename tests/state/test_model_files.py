"""Model files are written atomically: a failed save leaves the previous file as it was."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flair.nn
import pytest
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricTrainer
from flair_fabric.state import model_files
from flair_fabric.state.model_files import save_model_atomically, save_on_global_zero

from ..support import counting_saves, small_trec, state_dict_difference, tiny_text_classifier


def test_a_save_that_fails_midway_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_text_classifier(small_trec())
    target = tmp_path / "best-model.pt"
    save_model_atomically(model, target)
    before = target.read_bytes()

    original_save = TextClassifier.save

    def save_half_then_crash(self, model_file, checkpoint=False):
        original_save(self, model_file, checkpoint)
        Path(model_file).write_bytes(Path(model_file).read_bytes()[:100])
        raise OSError("disk full")

    monkeypatch.setattr(TextClassifier, "save", save_half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_model_atomically(model, target)

    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["best-model.pt"], "the temporary file is removed"
    assert state_dict_difference(TextClassifier.load(target).state_dict(), model.state_dict()) == 0.0


def test_a_sharded_models_save_that_fails_midway_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's save of a sharded model (its whole weights gathered to global rank 0, written as a flair model
    file) goes through the temporary file and the rename too."""
    model = tiny_text_classifier(small_trec())
    target = tmp_path / "final-model.pt"
    rank_zero = SimpleNamespace(is_global_zero=True, world_size=1)
    save_on_global_zero(rank_zero, model, target, False, weights=model.state_dict())  # type: ignore[arg-type]
    before = target.read_bytes()
    assert state_dict_difference(TextClassifier.load(target).state_dict(), model.state_dict()) == 0.0

    def write_half_then_crash(state: Any, path: Any) -> None:
        Path(path).write_bytes(b"x" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(model_files, "save_flair_state", write_half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_on_global_zero(rank_zero, model, target, False, weights=model.state_dict())  # type: ignore[arg-type]
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["final-model.pt"], "the temporary file is removed"


class _BetterEveryEpoch(TextClassifier):
    """Its dev score rises every epoch, so the trainer writes best-model.pt after every epoch."""

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        result = super().evaluate(*args, **kwargs)
        result.main_score = float(self.model_card["training_parameters"]["epoch"]) / 10
        return result


@pytest.mark.parametrize(
    ("target", "failing_save", "devices"),
    [
        ("best-model.pt", 2, 1),
        ("final-model.pt", 1, 1),
        # in one process flair's own CheckpointPlugin writes model_epoch_k.pt with model.save (not atomically)
        pytest.param("model_epoch_1.pt", 1, 2, marks=pytest.mark.multiprocess),
    ],
)
def test_a_model_file_the_trainer_fails_to_write_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, failing_save: int, devices: int
) -> None:
    """best-model.pt, final-model.pt and (with several processes) model_epoch_k.pt written by the trainer itself go
    through the temporary file and the rename: a save that fails half-way leaves the file the previous save (or an
    earlier run) wrote, and no temporary file."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_BetterEveryEpoch)
    base_path = tmp_path / "run"
    base_path.mkdir()
    if target != "best-model.pt":  # an earlier run's file (best-model.pt is removed when a run starts)
        save_model_atomically(tiny_text_classifier(corpus), base_path / target)
    complete = {target: (base_path / target).read_bytes()} if (base_path / target).exists() else {}
    calls = []
    original_save = TextClassifier.save

    def save(self: TextClassifier, model_file: Any, checkpoint: bool = False) -> None:
        original_save(self, model_file, checkpoint)
        if target not in Path(model_file).name:
            return
        calls.append(model_file)
        if len(calls) == failing_save:
            Path(model_file).write_bytes(Path(model_file).read_bytes()[:100])
            raise OSError("disk full")
        complete[target] = Path(model_file).read_bytes()

    monkeypatch.setattr(TextClassifier, "save", save)
    with pytest.raises(
        (OSError, ProcessRaisedException), match="disk full"
    ):  # from a forked worker: forwarded as another exception
        FabricTrainer(model, corpus).train(
            base_path,
            max_epochs=2,
            mini_batch_size=8 // devices,
            accelerator="cpu",
            devices=devices,
            strategy="ddp_fork" if devices > 1 else "auto",
            save_model_each_k_epochs=1,
            create_file_logs=False,
            collective_timeout=5,  # the other rank waits for the failed one no longer than that
        )
    monkeypatch.undo()
    assert devices > 1 or len(calls) == failing_save  # (a forked worker counts in its own memory)
    assert (base_path / target).read_bytes() == complete[target], f"{target} is what its last complete save wrote"
    TextClassifier.load(base_path / target)
    assert not list(base_path.glob(".*.tmp")), "the temporary file is removed"


@pytest.mark.multiprocess
def test_every_model_file_is_written_once_by_global_rank_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model files a run writes (best-model.pt after each better epoch, model_epoch_k.pt, final-model.pt), as
    flair's own trainer in one process writes them: on two ranks each is written once, by global rank 0 (forked
    workers inherit the count)."""
    corpus = small_trec()
    options: dict[str, Any] = {"max_epochs": 2, "save_model_each_k_epochs": 1, "create_file_logs": False}
    flair_save = flair.nn.Model.save
    flairs, ours = tmp_path / "flair-saves.txt", tmp_path / "saves.txt"
    monkeypatch.setattr(flair.nn.Model, "save", counting_saves(flairs, flair_save))
    model = tiny_text_classifier(corpus, model_class=_BetterEveryEpoch)
    ModelTrainer(model, corpus).train(tmp_path / "flair", mini_batch_size=8, **options)
    monkeypatch.setattr(flair.nn.Model, "save", counting_saves(ours, flair_save))
    model = tiny_text_classifier(corpus, model_class=_BetterEveryEpoch)
    FabricTrainer(model, corpus).train(
        tmp_path / "fabric", mini_batch_size=4, accelerator="cpu", devices=2, strategy="ddp_fork", **options
    )
    written = sorted(line.split()[1] for line in flairs.read_text().splitlines())
    assert {"best-model.pt", "model_epoch_1.pt", "model_epoch_2.pt", "final-model.pt"} <= set(written), written
    assert sorted(ours.read_text().splitlines()) == [f"0 {name}" for name in written]
