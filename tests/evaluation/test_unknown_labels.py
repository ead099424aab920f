"""A test set with a gold label the model never saw (docs/evaluation.md): flair's loss cannot encode it (a bare
IndexError in flair's evaluate); ``python -m flair_fabric evaluate`` scores it without the loss, as flair's trainer
scores its final test, and a loss asked for (``--loss``, or the Python API's default ``return_loss=True``, flair's)
ends with an error that names the label."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from flair.datasets import ColumnDataset
from flair.models import SequenceTagger
from torch.multiprocessing.spawn import ProcessRaisedException

import flair_fabric
from flair_fabric import cli

from ..support import bio_tags, small_wnut, tiny_sequence_tagger

NEW = "alien"  # a label type the tagger was not made with


@pytest.fixture(scope="module")
def tagger_and_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, str]:
    """A saved tagger, a CoNLL file of its corpus's gold spans (``known.conll``) and the same file with one entity of
    a type the tagger's dictionary lacks (``unseen.conll``)."""
    folder = tmp_path_factory.mktemp("unknown-labels")
    corpus = small_wnut(folder / "wnut", train_size=30, dev_size=2, test_size=2)
    tagger = tiny_sequence_tagger(corpus)
    label_type = tagger.label_type
    sentences = [sentence for sentence in corpus.train if sentence.get_spans(label_type)][:12]
    assert len(sentences) >= 6, "enough sentences with entities"
    known, unseen = [], []
    for index, sentence in enumerate(sentences):
        tags = bio_tags(sentence, label_type)
        changed = [tag[:2] + NEW if tag != "O" else tag for tag in tags] if index == 3 else tags
        for token, tag, other in zip(sentence, tags, changed, strict=True):
            known.append(f"{token.text}\t{tag}\n")
            unseen.append(f"{token.text}\t{other}\n")
        known.append("\n")
        unseen.append("\n")
    (folder / "known.conll").write_text("".join(known), encoding="utf-8")
    (folder / "unseen.conll").write_text("".join(unseen), encoding="utf-8")
    assert NEW not in " ".join(tagger.label_dictionary.get_items())
    tagger.save(folder / "tagger.pt")
    return folder / "tagger.pt", folder / "known.conll", folder / "unseen.conll", label_type


def _gold(file: Path, label_type: str) -> ColumnDataset:
    return ColumnDataset(file, {0: "text", 1: label_type})


def _command(model: Path, file: Path, label_type: str, *options: str) -> list[str]:
    return [
        "evaluate",
        "--model",
        str(model),
        "--input",
        str(file),
        "--gold-label-type",
        label_type,
        "--json",
        *options,
    ]


def _evaluate(capsys: pytest.CaptureFixture, arguments: list[str]) -> tuple[object, str]:
    """The command's exit code (0, or what it exited with) and what it printed."""
    capsys.readouterr()
    try:
        code: object = cli.main([*arguments, "--devices", "1", "--accelerator", "cpu"])
    except SystemExit as exited:
        code = exited.code
    return code, capsys.readouterr().out


def test_the_command_scores_an_unseen_label_without_the_loss_as_flairs_final_test(
    tagger_and_files: tuple[Path, Path, Path, str], capsys: pytest.CaptureFixture
) -> None:
    model, known, unseen, label_type = tagger_and_files
    reference = SequenceTagger.load(model)
    with pytest.raises(IndexError):  # the defect's cause: flair's loss cannot encode the unseen label
        reference.evaluate(_gold(unseen, label_type), label_type, mini_batch_size=32)
    expected = reference.evaluate(_gold(unseen, label_type), label_type, mini_batch_size=32, return_loss=False)
    assert NEW in expected.detailed_results, "the unseen label is scored"

    code, printed = _evaluate(capsys, _command(model, unseen, label_type))
    assert code == 0, code
    scores = json.loads(printed.strip().splitlines()[-1])
    assert scores["main_score"] == pytest.approx(expected.main_score)
    assert scores["micro avg f1-score"] == pytest.approx(expected.scores[("micro avg", "f1-score")])
    assert "loss" not in scores, "no loss computed, none printed"

    with pytest.raises((SystemExit, IndexError)) as refused:  # (flair's bare IndexError: the defect)
        cli.main([*_command(model, unseen, label_type, "--loss"), "--devices", "1", "--accelerator", "cpu"])
    assert isinstance(refused.value, SystemExit), f"a clear error, not {refused.value!r}"
    message = str(refused.value.code)
    assert f"the gold label '{NEW}' of label type {label_type!r} is not in" in message, "this label, no other"
    assert "--loss" in message, message

    with_loss = reference.evaluate(_gold(known, label_type), label_type, mini_batch_size=32)
    assert with_loss.loss > 0
    code, printed = _evaluate(capsys, _command(model, known, label_type, "--loss"))
    assert code == 0, code
    scores = json.loads(printed.strip().splitlines()[-1])
    assert scores["loss"] == pytest.approx(with_loss.loss, rel=1e-6), "--loss: flair's loss"
    assert scores["main_score"] == pytest.approx(with_loss.main_score)


def test_the_python_api_keeps_flairs_loss_default_and_names_an_unseen_label(
    tagger_and_files: tuple[Path, Path, Path, str],
) -> None:
    """flair_fabric.evaluate computes the loss by default, as flair's model.evaluate does (return_loss=True): where
    flair raises a bare IndexError, it raises a ValueError that names the label; return_loss=False scores as flair."""
    model, known, unseen, label_type = tagger_and_files
    tagger = SequenceTagger.load(model)
    data = list(_gold(known, label_type))
    flairs = SequenceTagger.load(model).evaluate(_gold(known, label_type), label_type)
    ours = flair_fabric.evaluate(tagger, data, label_type, accelerator="cpu", devices=1)
    assert flairs.loss > 0 and ours.loss == pytest.approx(flairs.loss, rel=1e-6), "the loss by default, as flair's"

    with pytest.raises((ValueError, IndexError)) as refused:  # (flair's bare IndexError: the defect)
        flair_fabric.evaluate(tagger, list(_gold(unseen, label_type)), label_type, accelerator="cpu", devices=1)
    assert isinstance(refused.value, ValueError), f"a clear error, not {refused.value!r}"
    pattern = rf"the gold label '{NEW}' of label type {label_type!r} is not in .*return_loss=False"
    assert re.search(pattern, str(refused.value)), str(refused.value)
    expected = SequenceTagger.load(model).evaluate(_gold(unseen, label_type), label_type, return_loss=False)
    ours = flair_fabric.evaluate(
        tagger, list(_gold(unseen, label_type)), label_type, return_loss=False, accelerator="cpu", devices=1
    )
    assert ours.main_score == pytest.approx(expected.main_score) and ours.detailed_results == expected.detailed_results


@pytest.mark.multiprocess
def test_on_two_ranks_the_rank_that_meets_the_unseen_label_names_it(
    tagger_and_files: tuple[Path, Path, Path, str],
) -> None:
    """Batches of 2: the unseen entity (sentence 4, in the second batch) is predicted by rank 1 of 2 forked ranks."""
    model, _, unseen, label_type = tagger_and_files
    tagger = SequenceTagger.load(model)
    data = list(_gold(unseen, label_type))
    with pytest.raises((ValueError, ProcessRaisedException), match=rf"'{NEW}'.*return_loss=False"):
        flair_fabric.evaluate(
            tagger, data, label_type, mini_batch_size=2, accelerator="cpu", devices=2, strategy="ddp_fork"
        )
