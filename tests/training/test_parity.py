"""One device: FabricTrainer reproduces flair's ModelTrainer (losses, weights, events)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.models import TextClassifier
from flair.samplers import FlairSampler
from flair.trainers import ModelTrainer
from flair.trainers.plugins import MetricHistoryPlugin

from flair_fabric import FabricTrainer

from ..support import (
    EventRecorder,
    small_trec,
    small_wnut,
    state_dict_difference,
    tiny_sequence_tagger,
    tiny_text_classifier,
)

FABRIC_ONLY_SETUP_KEYS = {
    "accelerator",
    "devices",
    "num_nodes",
    "strategy",
    "precision",
    "global_batch_size",
    "group_by_length",
    "group_by_length_window",
    "progress_bar",
    "checkpoint_every_n_epochs",
    "resume_from",
    "collective_timeout",
    "checkpoint_every_n_steps",
    "checkpoint_every_n_minutes",
    "keep_checkpoints",
    "requeue_signal",
    "balance_batches",
    "val_check_interval",
    "save_adapters",
}


def _train_both(build, method: str, tmp_path: Path, **kwargs: Any):
    """Train the same model with flair's trainer and with FabricTrainer(devices=1); return both sides."""
    sides = {}
    for name, trainer_class, extra in (
        ("flair", ModelTrainer, {}),
        ("fabric", FabricTrainer, {"accelerator": "cpu", "devices": 1}),
    ):
        model, corpus = build()
        recorder = EventRecorder()
        flair.set_seed(11)
        trainer = trainer_class(model, corpus)
        plugins = [MetricHistoryPlugin(), recorder]
        result = getattr(trainer, method)(tmp_path / name, plugins=plugins, **kwargs, **extra)
        sides[name] = (model, result, recorder.events, tmp_path / name)
    return sides


# docs/launching.md: what FabricTrainer records besides flair's records, at each log point
THROUGHPUT_RECORDS = {"train/tokens_per_second", "train/padded_tokens_per_second", "train/padding_fraction"}


def _assert_same_events(flair_events: list, fabric_events: list) -> None:
    added = [
        event for event in fabric_events if event[0] == "metric_recorded" and event[1]["name"] in THROUGHPUT_RECORDS
    ]
    assert {event[1]["name"] for event in added} <= THROUGHPUT_RECORDS
    fabric_events = [event for event in fabric_events if event not in added]
    assert [name for name, _ in flair_events] == [name for name, _ in fabric_events]
    for (name, expected), (_, actual) in zip(flair_events, fabric_events, strict=True):
        if name == "after_setup":
            assert set(actual) - set(expected) == FABRIC_ONLY_SETUP_KEYS
            expected = {k: v for k, v in expected.items() if not str(v).startswith("<")}
            actual = {k: v for k, v in actual.items() if k in expected}
        assert expected.keys() == actual.keys(), name
        for key, value in expected.items():
            assert value == actual[key], (name, key)  # floats too: one device is flair's run, exactly


def test_text_classifier_matches_flair_train(tmp_path: Path) -> None:
    def build():
        corpus = small_trec()
        return tiny_text_classifier(corpus), corpus

    sides = _train_both(build, "train", tmp_path, max_epochs=3, mini_batch_size=8, learning_rate=0.1)
    (flair_model, flair_result, flair_events, flair_dir) = sides["flair"]
    (fabric_model, fabric_result, fabric_events, fabric_dir) = sides["fabric"]

    assert len(flair_result["train_loss_history"]) == 3
    assert fabric_result["train_loss_history"] == flair_result["train_loss_history"]
    assert flair_result["test_score"] == fabric_result["test_score"]
    assert state_dict_difference(flair_model.state_dict(), fabric_model.state_dict()) == 0.0
    _assert_same_events(flair_events, fabric_events)
    assert (fabric_dir / "best-model.pt").exists() and (fabric_dir / "final-model.pt").exists()
    assert (flair_dir / "dev.tsv").read_bytes() == (fabric_dir / "dev.tsv").read_bytes()
    assert (flair_dir / "test.tsv").read_bytes() == (fabric_dir / "test.tsv").read_bytes()


def test_sequence_tagger_matches_flair_fine_tune(tmp_path: Path) -> None:
    def build():
        corpus = small_wnut(tmp_path / "wnut")
        return tiny_sequence_tagger(corpus), corpus

    sides = _train_both(
        build,
        "fine_tune",
        tmp_path,
        max_epochs=2,
        mini_batch_size=8,
        mini_batch_chunk_size=3,
        learning_rate=0.01,
        embeddings_storage_mode="cpu",
    )
    (flair_model, flair_result, flair_events, _) = sides["flair"]
    (fabric_model, fabric_result, fabric_events, _) = sides["fabric"]

    assert fabric_result["train_loss_history"] == flair_result["train_loss_history"]
    assert state_dict_difference(flair_model.state_dict(), fabric_model.state_dict()) == 0.0
    _assert_same_events(flair_events, fabric_events)


def test_shuffle_first_epoch_false_matches_flair(tmp_path: Path) -> None:
    """README: flair's arguments keep flair's meaning: shuffle=True with shuffle_first_epoch=False reads the first
    epoch in order and shuffles the later ones, as flair's trainer does (same losses, same weights)."""

    def build():
        corpus = small_trec()
        return tiny_text_classifier(corpus), corpus

    arguments = {"max_epochs": 2, "mini_batch_size": 8, "learning_rate": 0.1, "shuffle": True}
    sides = _train_both(build, "train_custom", tmp_path, shuffle_first_epoch=False, **arguments)
    (flair_model, flair_result, _, _), (fabric_model, fabric_result, _, _) = sides["flair"], sides["fabric"]
    assert len(flair_result["train_loss_history"]) == 2
    assert fabric_result["train_loss_history"] == flair_result["train_loss_history"]
    assert state_dict_difference(flair_model.state_dict(), fabric_model.state_dict()) == 0.0


class _EveryThirdFirst(FlairSampler):
    """A sampler of the test's own: every third data point first, then the ones after them, ... (flair's samplers
    call ``Sampler.__init__(None)``, which torch 2.13 no longer takes)."""

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(range(self.num_samples), key=lambda index: (index % 3, index)))


FLAIR_ARGUMENT_SETS = {
    "dev-and-test-splits-clipping-decoder-rate-excluded-labels": {
        "train_with_dev": True,
        "monitor_test": True,
        "monitor_train_sample": 0.25,
        "max_grad_norm": 0.5,
        "decoder_learning_rate": 0.2,
        "exclude_labels": ["ABBR"],
        "eval_batch_size": 5,
        "embeddings_storage_mode": "none",
    },
    "sampler-start-epoch-metric-model-files-weights": {
        "sampler": _EveryThirdFirst,
        "epoch": 1,
        "main_evaluation_metric": ("macro avg", "f1-score"),
        "save_model_each_k_epochs": 1,
        "save_optimizer_state": True,
        "write_weights": True,
        "mini_batch_chunk_size": 3,
    },
    "test-split-best-model-optimizer-and-its-arguments": {
        "train_with_test": True,
        "use_final_model_for_eval": False,
        "optimizer": torch.optim.AdamW,
        "weight_decay": 0.3,
        "learning_rate": 0.02,
        "create_loss_file": False,
        "save_final_model": False,
    },
}
"""flair's arguments beyond the ones the runs above pass, each set run by both trainers."""


def _files(folder: Path) -> dict[str, Any]:
    """What a run wrote, comparable across the two trainers: text files as bytes (loss.tsv without its timestamps),
    model files as their weights (and optimizer state); training.log (times, the Computation section) left out."""
    found: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.name == "training.log":
            continue
        if path.suffix == ".pt":
            saved = torch.load(path, map_location="cpu", weights_only=False)
            found[path.name] = (saved["state_dict"], str(saved.get("optimizer_state_dict")))
        elif path.name == "loss.tsv":
            rows = [line.split("\t") for line in path.read_text().splitlines()]
            found[path.name] = [row[:1] + row[2:] for row in rows]  # EPOCH, (TIMESTAMP), LEARNING_RATE, ...
        else:
            found[path.name] = path.read_bytes()
    return found


@pytest.mark.parametrize("arguments", FLAIR_ARGUMENT_SETS.values(), ids=FLAIR_ARGUMENT_SETS.keys())
def test_flairs_arguments_keep_their_meaning(tmp_path: Path, arguments: dict[str, Any]) -> None:
    """README: flair's arguments keep flair's meaning. Each set, passed to flair's trainer and to FabricTrainer on one
    device: the same losses, weights, events and files (the splits trained on and evaluated, the clipping, the
    decoder's learning rate, the excluded labels, the sampler, the start epoch, the metric, every model file and
    weights.txt, the optimizer and its own arguments)."""

    def build():
        corpus = small_trec()
        return tiny_text_classifier(corpus), corpus

    sides = _train_both(build, "train_custom", tmp_path, max_epochs=3, mini_batch_size=8, **arguments)
    (flair_model, flair_result, flair_events, flair_dir) = sides["flair"]
    (fabric_model, fabric_result, fabric_events, fabric_dir) = sides["fabric"]
    assert fabric_result == flair_result
    assert state_dict_difference(flair_model.state_dict(), fabric_model.state_dict()) == 0.0
    _assert_same_events(flair_events, fabric_events)
    flairs, ours = _files(flair_dir), _files(fabric_dir)
    assert ours.keys() == flairs.keys()
    for name, (expected, actual) in ((name, (flairs[name], ours[name])) for name in flairs):
        if isinstance(expected, tuple):
            assert state_dict_difference(expected[0], actual[0]) == 0.0, name
            assert actual[1] == expected[1], name
        else:
            assert actual == expected, name


def test_saved_model_loads_with_flair(tmp_path: Path) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    FabricTrainer(model, corpus).train(tmp_path, max_epochs=1, mini_batch_size=8, accelerator="cpu", devices=1)
    loaded = flair.models.TextClassifier.load(tmp_path / "final-model.pt")
    assert state_dict_difference(loaded.state_dict(), model.state_dict()) == 0.0
    assert loaded.model_card["training_parameters"]["devices"] == 1


def _train_recording_decoder_dtypes(tmp_path: Path, **precision: Any) -> tuple[set[torch.dtype], dict]:
    """One epoch on one CPU; the dtypes the decoder computed in during training, and the trained weights."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    seen: set[torch.dtype] = set()
    model.decoder.register_forward_hook(
        lambda module, inputs, output: seen.add(output.dtype) if module.training else None
    )
    FabricTrainer(model, corpus).train(
        tmp_path, max_epochs=1, mini_batch_size=8, accelerator="cpu", devices=1, **precision
    )
    assert torch.isfinite(torch.cat([p.float().flatten() for p in model.parameters()])).all()
    return seen, dict(model.state_dict())


@pytest.mark.parametrize(
    ("precision", "computes_in", "weights_in"),
    [
        ({"precision": "bf16-mixed"}, torch.bfloat16, torch.float32),
        ({"use_amp": True}, torch.bfloat16, torch.float32),  # flair's switch: bf16-mixed on CPU
        ({"precision": "bf16-true"}, torch.bfloat16, torch.bfloat16),
    ],
)
def test_bf16_on_one_cpu_computes_in_bf16_and_changes_the_result(
    tmp_path: Path, precision: dict[str, Any], computes_in: torch.dtype, weights_in: torch.dtype
) -> None:
    seen, weights = _train_recording_decoder_dtypes(tmp_path / "bf16", **precision)
    assert seen == {computes_in}
    assert {value.dtype for value in weights.values() if value.is_floating_point()} == {weights_in}
    reference_seen, reference = _train_recording_decoder_dtypes(tmp_path / "fp32")
    assert reference_seen == {torch.float32}
    assert state_dict_difference(weights, reference) > 1e-4, "bf16 arithmetic must leave a trace in the weights"


@pytest.mark.parametrize("umask", [0o002, 0o077])
def test_model_files_get_the_same_permissions_as_flairs(tmp_path: Path, umask: int) -> None:
    """docs/security.md: best-model.pt and final-model.pt are flair's own files, with the permissions flair's own
    trainer gives them under the same umask, and load with flair's Model.load."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    kept = os.umask(umask)
    try:
        ModelTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path / "flair", max_epochs=1)
        FabricTrainer(model, corpus).train(tmp_path / "fabric", max_epochs=1, accelerator="cpu")
    finally:
        os.umask(kept)
    for name in ("final-model.pt", "best-model.pt"):
        flair_mode = (tmp_path / "flair" / name).stat().st_mode
        assert (tmp_path / "fabric" / name).stat().st_mode == flair_mode, name
        loaded = TextClassifier.load(tmp_path / "fabric" / name)  # one epoch: the best model is the final one
        assert state_dict_difference(loaded.state_dict(), model.state_dict()) == 0.0, name
    assert flair_mode & 0o777 == 0o666 & ~umask
