"""What passes between the caller and its workers, checked in one process: the flair objects spawned workers receive
(spans, relations, transformer models), the device a rank computes on, the model the caller keeps after a double
interrupt, and the output of the evaluation replay (docs/launching.md, docs/notebooks.md)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from pathlib import Path

import flair
import pytest
import torch
from flair.data import Relation, Sentence
from flair.models import TextClassifier
from lightning.fabric import Fabric

from flair_fabric.evaluation.sharded import _without_progress_bars
from flair_fabric.launch import transport
from flair_fabric.launch.config import make_launch_config
from flair_fabric.training.job import TrainedInWorker, take_final_model_written_since

from ..support import make_tiny_bert, run_on_ranks, small_trec, tiny_text_classifier, tiny_transformer_classifier


def _labelled_sentence() -> Sentence:
    sentence = Sentence("Justin Bieber is in New York tonight")
    person, place = sentence[0:2], sentence[4:6]
    person.add_label("ner", "person")
    place.add_label("ner", "location")
    Relation(person, place).add_label("relation", "located_in")
    return sentence


def _labels(sentence: Sentence) -> dict[str, list[tuple[str, str, bool]]]:
    """Every span's and relation's own labels, and whether each belongs to ``sentence`` itself."""
    return {
        "spans": [
            (span.unlabeled_identifier, span.get_label("ner").value, span.sentence is sentence)
            for span in sentence.get_spans("ner")
        ],
        "relations": [
            (relation.unlabeled_identifier, relation.get_label("relation").value, relation.sentence is sentence)
            for relation in sentence.get_relations("relation")
        ],
        "sentence": [(label.data_point.unlabeled_identifier, label.value, True) for label in sentence.get_labels()],
    }


def test_spawned_workers_get_span_and_relation_labels_and_transformer_models_as_the_caller_has_them(
    tmp_path: Path,
) -> None:
    """docs/launching.md: spawned workers get the model and corpus by their flair state; sentences with span and
    relation labels cannot be pickled plainly (their spans are rebuilt), and neither can TransformerEmbeddings."""
    sentence = _labelled_sentence()
    with pytest.raises(TypeError, match=r"Span.__new__\(\) missing"):  # why the transport exists
        pickle.loads(pickle.dumps(sentence))
    moved = transport.loads(transport.dumps(sentence))
    assert _labels(moved) == _labels(sentence)
    assert len(_labels(moved)["spans"]) == 2 and len(_labels(moved)["relations"]) == 1
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    model = tiny_transformer_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus))
    rebuilt = transport.loads(transport.dumps(model))
    assert type(rebuilt) is TextClassifier and rebuilt is not model
    expected = model.state_dict()
    assert rebuilt.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in rebuilt.state_dict().items())


def _flair_device(fabric: Fabric, argument: None) -> str:
    return str(flair.device)


def test_a_rank_sets_flair_device_to_the_device_fabric_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/launching.md: each process uses the device Fabric gives it (its local rank's), not the caller's
    ``flair.device``. Shown for a Fabric that hands this rank cuda:1 (read, not computed on: no GPU is needed)."""
    monkeypatch.setattr(Fabric, "device", property(lambda fabric: torch.device("cuda", 1)))
    monkeypatch.setattr(flair, "device", torch.device("cpu"))
    config = make_launch_config(
        accelerator="cpu", devices=1, num_nodes=1, strategy="auto", precision=None, use_amp=False
    )
    assert run_on_ranks(config, _flair_device, None) == "cuda:1"


def test_the_callers_model_takes_the_trained_weights_into_its_own_parameters_where_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/notebooks.md: the caller's model keeps its own parameters on its own device: the workers' CPU tensors
    are copied into them; nothing moves the model (on a GPU machine the caller's model stays on its GPU)."""
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    model, trained = tiny_text_classifier(corpus), tiny_text_classifier(corpus, seed=99)
    parameters = list(model.parameters())
    moved: list[str] = []
    apply = torch.nn.Module._apply

    def noted_apply(module: torch.nn.Module, *args: object, **kwargs: object) -> torch.nn.Module:
        moved.append(type(module).__name__)  # .to(), .cpu(), .cuda(), .float(), ...
        return apply(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "_apply", noted_apply)
    weights = {name: tensor.clone() for name, tensor in trained.state_dict().items()}
    TrainedInWorker({"test_score": 0.5}, weights, False, None).hand_to(model)
    assert moved == [], "the caller's model was moved"
    assert all(mine is kept for mine, kept in zip(parameters, model.parameters(), strict=True)), "parameters replaced"
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())


def _flair_records() -> tuple[list[logging.LogRecord], logging.Handler]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flair").addHandler(handler)
    return records, handler


def test_after_a_double_interrupt_the_model_takes_final_model_pt_only_if_this_run_wrote_it(tmp_path: Path) -> None:
    """docs/notebooks.md: after a second Ctrl-C the caller's model holds the weights of the final-model.pt the
    workers saved (in eval mode, as flair's trainer leaves it), otherwise it is left as it was and a log says so."""
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    saved = tiny_text_classifier(corpus, seed=99)
    records, handler = _flair_records()
    try:
        started = time.time()
        saved.save(tmp_path / "final-model.pt")  # the workers of this run saved it (a second later)
        os.utime(tmp_path / "final-model.pt", (started + 1, started + 1))
        model = tiny_text_classifier(corpus)
        model.train()
        take_final_model_written_since(model, tmp_path, started)
        assert all(torch.equal(tensor, saved.state_dict()[name]) for name, tensor in model.state_dict().items())
        assert model.training is False
        assert [r.getMessage() for r in records] == [
            f"the workers were stopped; the model holds the weights they saved in {tmp_path / 'final-model.pt'}"
        ]
        records.clear()
        earlier = time.time() - 3600  # a final-model.pt of an earlier run
        os.utime(tmp_path / "final-model.pt", (earlier, earlier))
        model = tiny_text_classifier(corpus)
        model.train()
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        take_final_model_written_since(model, tmp_path, started)
        assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
        assert model.training is True
        assert [r.getMessage() for r in records] == [
            "the workers were stopped before they saved a model: the model was not updated"
        ]
    finally:
        logging.getLogger("flair").removeHandler(handler)


def test_the_evaluation_replay_drops_progress_bars_and_lets_other_stderr_output_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/notebooks.md: flair's evaluation bar during the replay on rank 0 is hidden; what else is written to
    stderr meanwhile (a warning) still appears."""
    with _without_progress_bars():
        sys.stderr.write("  0%|          | 0/3 [00:00<?, ?it/s]\r 100%|##########| 3/3 [00:00<00:00, 9.9it/s]\r")
        sys.stderr.write("UserWarning: keep me\n")
        sys.stderr.write("48it [00:00, 999.9it/s]\n")
        sys.stderr.write("and me\n")
    assert capsys.readouterr().err == "UserWarning: keep me\nand me\n"
