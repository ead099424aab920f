"""flair_fabric.predict against flair's own predict in one process: in memory (every flair model family, 2 and 3
ranks, spawn and fork, uneven sizes), streamed (a 20,000-line file, order, a killed job), the command line, bad
input."""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from flair.data import DataPoint, Label, Relation, Sentence
from flair.datasets import ColumnCorpus, ColumnDataset
from flair.models import SequenceTagger, TextClassifier
from flair.trainers import ModelTrainer
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

import flair_fabric
from flair_fabric import FabricTrainer, cli
from flair_fabric import trainer as trainer_module
from flair_fabric.datasets import TREC_LABEL_TYPE, trec_questions
from flair_fabric.evaluation.predictions import record_labels
from flair_fabric.launch.arguments import LightningArguments
from flair_fabric.prediction import api as prediction_api
from flair_fabric.prediction.sharding import Predicted

from ..model_zoo import ZOO, points_of
from ..support import (
    FABRIC_PRECISIONS,
    REPO,
    bio_tags,
    expect_success,
    out_of_step_is_a_hang,
    run_script,
    small_trec,
    small_wnut,
    tiny_classifier_file,
    tiny_sequence_tagger,
    tiny_text_classifier,
)

FORK = {"accelerator": "cpu", "strategy": "ddp_fork"}
TWO_FORKED = ("--devices", "2", "--strategy", "ddp_fork", "--accelerator", "cpu")


def _labels(data_points: list[DataPoint], names: list[str]) -> list[list[tuple[Any, str, float]]]:
    return [
        [(label.address, label.value, label.score) for name in names for label in record_labels(point, name)]
        for point in data_points
    ]


def _assert_same_labels(ours: list[DataPoint], theirs: list[DataPoint], names: list[str]) -> None:
    expected, got = _labels(theirs, names), _labels(ours, names)
    assert sum(map(len, expected)) > 0, "the model predicts something"
    for mine, reference in zip(got, expected, strict=True):
        assert [(address, value) for address, value, _ in mine] == [(a, v) for a, v, _ in reference]
        assert all(abs(a[2] - b[2]) <= 1e-6 for a, b in zip(mine, reference, strict=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["text", "multi_label", "tagger_crf", "tagger", "relation_extractor", "multitask"])
def test_in_memory_labels_and_scores_equal_flairs_predict(tmp_path: Path, family: str) -> None:
    model, corpus, _ = ZOO[family](tmp_path / "a")
    model.eval()
    _, same_corpus, _ = ZOO[family](tmp_path / "b")  # the same data points again (sentences with spans do not copy)
    reference, ours = points_of(corpus), points_of(same_corpus)
    options = {"mini_batch_size": 4, "return_probabilities_for_all_classes": family == "text"}
    model.predict(reference, **options)
    returned = flair_fabric.predict(model, ours, devices=2, **FORK, **options)
    assert returned is ours
    tasks = getattr(model, "tasks", None)  # a multitask model: every task's labels must come back
    names = [task.label_type for task in tasks.values()] if isinstance(tasks, dict) else [model.label_type]
    _assert_same_labels(ours, reference, names)
    for name in names:
        assert any(record_labels(point, name) for point in reference), f"flair's predict labels {name}"


class _LabelsElsewhere(TextClassifier):
    """Also puts a label on a token of another sentence, for the sentence ``marked``: a label no other process can
    address (under the label name it predicts into)."""

    marked = ""

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        returned = super().predict(sentences, *args, **kwargs)
        for sentence in sentences if isinstance(sentences, list) else [sentences]:
            if sentence.to_original_text() == self.marked:
                elsewhere = Label(Sentence("elsewhere")[0], "ELSEWHERE", 1.0)
                sentence.annotation_layers.setdefault(kwargs.get("label_name") or self.label_type, []).append(elsewhere)
        return returned


@pytest.mark.multiprocess
def test_a_model_whose_labels_cannot_move_is_predicted_by_the_caller_with_a_warning() -> None:
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_LabelsElsewhere)
    model.eval()
    texts = [sentence.to_original_text() for sentence in corpus.train][:20]
    _LabelsElsewhere.marked = max(texts, key=len)  # in the first batch: on rank 0 only, rank 1 must learn of it
    reference, ours = [Sentence(text) for text in texts], [Sentence(text) for text in texts]
    # predict's arguments reach the caller's own prediction too: every class's probability, under another name
    options = {"mini_batch_size": 4, "label_name": "guessed", "return_probabilities_for_all_classes": True}
    model.predict(reference, **options)
    logging.getLogger("flair").addHandler(handler)
    try:
        with out_of_step_is_a_hang():  # ranks that do not agree on the fallback fall out of step
            flair_fabric.predict(model, ours, devices=2, **FORK, **options)
    except ProcessRaisedException as error:
        if "cannot be moved between processes" in str(error):
            pytest.fail(f"a model whose labels cannot move must be predicted by the caller, not end the run: {error}")
        raise
    finally:
        logging.getLogger("flair").removeHandler(handler)

    def shown(sentence: Sentence) -> list[tuple[str, float]]:
        return [(label.value, round(label.score, 6)) for label in sentence.get_labels("guessed")]

    unmarked = next(sentence for sentence in reference if sentence.to_original_text() != _LabelsElsewhere.marked)
    assert len(shown(unmarked)) == len(model.label_dictionary), "a probability for every class"

    assert [shown(sentence) for sentence in ours] == [shown(sentence) for sentence in reference]
    assert sum(value == "ELSEWHERE" for sentence in ours for value, _ in shown(sentence)) == 1
    assert any("predicting in this process only: a predicted label on a Token" in r.getMessage() for r in warnings)


def test_labels_cross_to_the_caller_as_json_unchanged_or_as_objects_when_they_carry_metadata() -> None:
    sentence = Sentence("Ada Lovelace met Charles Babbage in London .")
    sentence.add_label("kind", "meeting", 0.123456789)  # every digit of a score must cross
    sentence[0].add_label("pos", "NNP", 0.5)
    sentence[0:2].add_label("ner", "PER", 0.9)
    sentence[3:5].add_label("ner", "PER", 0.875)
    Relation(sentence[0:2], sentence[3:5]).add_label("relation", "met", 0.625)
    names = ["kind", "pos", "ner", "relation"]
    predicted = Predicted([{name: record_labels(sentence, name) for name in names}], loss=(1.5, 4))
    text = predicted.to_json()
    assert text is not None and Predicted.from_json(text) == predicted
    sentence.add_label("note", "x", 1.0, source="rule")  # metadata: JSON could turn a tuple into a list
    assert Predicted([{"note": record_labels(sentence, "note")}]).to_json() is None


@pytest.mark.multiprocess
@pytest.mark.parametrize(("size", "devices", "strategy"), [(0, 2, "ddp_fork"), (1, 3, "ddp_fork"), (7, 3, "ddp_spawn")])
def test_uneven_sizes_on_2_and_3_ranks_spawned_or_forked(size: int, devices: int, strategy: str) -> None:
    """Labels, and with ``return_loss=True`` flair's loss sum and label count over every rank's batches."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    data = [copy.deepcopy(sentence) for sentence in list(corpus.test)[:size]]  # with their gold labels
    reference = copy.deepcopy(data)
    options = {"mini_batch_size": 2, "label_name": "predicted", "return_loss": True}
    expected = model.predict(reference, **options)
    returned = flair_fabric.predict(model, data, devices=devices, accelerator="cpu", strategy=strategy, **options)
    if not size:
        assert returned == expected == [], "flair returns an empty input as it is"
        return
    (loss, count), (expected_loss, expected_count) = returned, expected
    assert count == expected_count == size
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6, abs=1e-9)
    _assert_same_labels(data, reference, ["predicted"])


@pytest.mark.multiprocess
def test_return_loss_of_a_tagger_is_flairs_loss_sum_and_label_count_over_every_rank(tmp_path: Path) -> None:
    """A tagger labels tokens: flair's count is the number of token labels (more than the 7 sentences), summed with
    the loss over the batches of 2 forked ranks."""
    data = list(small_wnut(tmp_path / "a", train_size=7).train)
    reference = list(small_wnut(tmp_path / "b", train_size=7).train)  # the same sentences (with spans: no deepcopy)
    model = tiny_sequence_tagger(small_wnut(tmp_path / "c", train_size=7))
    model.eval()
    options = {"mini_batch_size": 2, "label_name": "predicted", "return_loss": True}
    expected_loss, expected_count = model.predict(reference, **options)
    loss, count = flair_fabric.predict(model, data, devices=2, **FORK, **options)
    assert count == expected_count > len(data) == 7
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    _assert_same_labels(data, reference, ["predicted"])


class _ArgumentRecorder(TextClassifier):
    """Keeps the arguments of every ``predict`` call (in this process)."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(TextClassifier.predict).bind(self, sentences, *args, **kwargs)
        self.calls.append({name: value for name, value in bound.arguments.items() if name not in ("self", "sentences")})
        return super().predict(sentences, *args, **kwargs)


def test_flairs_predict_arguments_reach_the_models_predict_and_keep_flairs_meaning() -> None:
    """Every flair predict argument given reaches each of the model's predict calls (one process, in this process);
    ``embedding_storage_mode="cpu"`` then keeps the embeddings on the data points as flair's predict does, the
    default "none" drops them."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_ArgumentRecorder)
    model.eval()
    texts = [sentence.to_original_text() for sentence in list(corpus.test)[:6]]
    reference, kept, dropped = ([Sentence(text) for text in texts] for _ in range(3))
    model.predict(reference, mini_batch_size=4, embedding_storage_mode="cpu", label_name="guess")
    assert all(sentence.get_embedding().numel() > 0 for sentence in reference), "flair keeps them"
    one = {"devices": 1, "accelerator": "cpu"}
    given = {"mini_batch_size": 4, "return_probabilities_for_all_classes": True, "verbose": True}
    given |= {"label_name": "guess", "embedding_storage_mode": "cpu"}
    _ArgumentRecorder.calls.clear()
    flair_fabric.predict(model, kept, **given, **one)
    assert len(_ArgumentRecorder.calls) == 2, "batches of 4: two calls"
    assert all({name: call.get(name) for name in given} == given for call in _ArgumentRecorder.calls)
    for ours, theirs in zip(kept, reference, strict=True):
        assert torch.equal(ours.get_embedding(), theirs.get_embedding())
    flair_fabric.predict(model, dropped, mini_batch_size=4, **one)
    assert all(sentence.get_embedding().numel() == 0 for sentence in dropped), "embedding_storage_mode='none'"


def test_predict_checks_lightnings_arguments_and_launches_with_them_as_training_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch predict hands to the job runner holds the arguments given, resolved as training resolves the same
    ones (FabricTrainer.train's launch, recorded instead of run); a bad one is refused before anything starts."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    launched: dict[str, Any] = {}
    monkeypatch.setattr(prediction_api, "run_job", lambda job, config: launched.setdefault("predict", config))
    monkeypatch.setattr(trainer_module, "run_job", lambda job, config: launched.setdefault("train", config) and {})
    lightning = {"devices": 2, "strategy": "ddp_fork", "accelerator": "cpu", "precision": "bf16-mixed"}
    lightning |= {"num_nodes": 1, "collective_timeout": 7}
    flair_fabric.predict(model, [Sentence("What is a cat ?")], **lightning)
    FabricTrainer(model, corpus).train(tmp_path, max_epochs=1, **lightning)
    for config in (launched["predict"], launched["train"]):
        shown = (config.accelerator, config.devices, config.num_nodes, config.precision, config.collective_timeout)
        assert shown == ("cpu", 2, 1, "bf16-mixed", timedelta(seconds=7))
        trained = launched["train"].strategy
        assert config.strategy == trained if isinstance(trained, str) else type(config.strategy) is type(trained)
    for bad, message in (({"num_nodes": 0}, r"num_nodes=0"), ({"collective_timeout": -1}, r"collective_timeout")):
        with pytest.raises(ValueError, match=message):
            flair_fabric.predict(model, [Sentence("What is a cat ?")], **{**lightning, **bad})


class _LabelsWithMetadata(TextClassifier):
    """Adds a second label of its own label type that carries metadata (a tuple, which JSON would make a list)."""

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        returned = super().predict(sentences, *args, **kwargs)
        for sentence in sentences if isinstance(sentences, list) else [sentences]:
            sentence.add_label(self.label_type, "RULE", 0.5, source=("rule", len(sentence)))
        return returned


@pytest.mark.multiprocess
def test_labels_with_metadata_reach_the_caller_unchanged_from_forked_workers() -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_LabelsWithMetadata)
    model.eval()
    texts = [sentence.to_original_text() for sentence in corpus.train][:6]
    reference, ours = [Sentence(text) for text in texts], [Sentence(text) for text in texts]
    model.predict(reference, mini_batch_size=2)
    flair_fabric.predict(model, ours, devices=2, mini_batch_size=2, **FORK)

    def shown(sentence: Sentence) -> list[tuple[str, float, dict]]:
        return [(label.value, round(label.score, 6), label.metadata) for label in sentence.get_labels(TREC_LABEL_TYPE)]

    assert [shown(sentence) for sentence in ours] == [shown(sentence) for sentence in reference]
    for sentence in ours:
        (rule,) = [label for label in sentence.get_labels(TREC_LABEL_TYPE) if label.value == "RULE"]
        assert rule.metadata == {"source": ("rule", len(sentence))} and isinstance(rule.metadata["source"], tuple)


@pytest.fixture(scope="module")
def trained_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TREC classifier trained for one epoch, saved by flair."""
    return tiny_classifier_file(tmp_path_factory.mktemp("classifier"))


def _question_file(path: Path, lines: int) -> Path:
    questions = [text for text, _ in trec_questions()]
    with path.open("w", encoding="utf-8") as stream:
        for number in range(lines):
            stream.write(f"{questions[number % len(questions)]} ({number})\n")
    return path


@pytest.mark.multiprocess
def test_a_20000_line_file_through_2_ranks_equals_one_process_line_by_line(
    trained_classifier: Path, tmp_path: Path
) -> None:
    source = _question_file(tmp_path / "questions.txt", 20_000)
    model = TextClassifier.load(trained_classifier)
    chunk = 4096
    summary = flair_fabric.predict(
        model, source, out_path=tmp_path / "out.jsonl", devices=2, chunk_size=chunk, mini_batch_size=64, **FORK
    )
    assert (summary.read, summary.predicted, summary.skipped) == (20_000, 20_000, [])
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["line"] for row in rows] == list(range(1, 20_001)), "input order"
    lines = source.read_text().splitlines()
    for start in range(0, 20_000, chunk):  # flair's predict, one process, on each of the 5 chunks
        sentences = [Sentence(text) for text in lines[start : start + chunk]]
        model.predict(sentences, mini_batch_size=64)
        for sentence, row in zip(sentences, rows[start : start + chunk], strict=True):
            assert row["text"] == sentence.to_original_text()
            labels = [(label.value, round(label.score, 6)) for label in sentence.get_labels(TREC_LABEL_TYPE)]
            assert [(label["value"], round(label["score"], 6)) for label in row["labels"]] == labels, row["line"]


@pytest.mark.multiprocess
def test_the_progress_bar_is_one_and_counts_every_ranks_data_points(
    trained_classifier: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    source = _question_file(tmp_path / "questions.txt", 700)
    model = TextClassifier.load(trained_classifier)
    flair_fabric.predict(
        model, source, out_path=tmp_path / "out.jsonl", devices=2, chunk_size=256, progress_bar=True, **FORK
    )
    bars = [line for line in capfd.readouterr().err.split("\n") if "predicting" in line]
    assert len(bars) == 1, f"one bar, on global rank 0: {bars}"
    assert re.search(r"predicting: 700 data points .*data points/s", bars[0].split("\r")[-1]), bars


_PEAK_RSS = """
import json, resource, sys
from flair.models import TextClassifier
import flair_fabric
model = TextClassifier.load(sys.argv[1])
flair_fabric.predict(model, sys.argv[2], out_path=sys.argv[3], devices=2, accelerator="cpu", strategy="ddp_fork",
                     chunk_size=256, progress_bar=False)
print(json.dumps(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
"""


@pytest.mark.multiprocess
def test_memory_per_rank_stays_flat_when_the_input_grows_tenfold(trained_classifier: Path, tmp_path: Path) -> None:
    # measured: 5,000 -> 50,000 lines +5% (a one-time rise over the first ~15,000, then flat); the whole input read
    # at once: +32%
    peaks = {}
    for lines in (5_000, 50_000):
        source = _question_file(tmp_path / f"questions-{lines}.txt", lines)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        env.pop("LOCAL_RANK", None)
        command = [sys.executable, "-c", _PEAK_RSS, str(trained_classifier), str(source), str(tmp_path / "out.jsonl")]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
        peaks[lines] = json.loads(done.stdout.splitlines()[-1])  # KiB: the largest of the forked ranks
        assert len((tmp_path / "out.jsonl").read_text().splitlines()) == lines
    assert peaks[50_000] < 1.10 * peaks[5_000], f"peak resident KiB of a rank: {peaks}"


class _DiesOnThirdChunk(TextClassifier):
    calls = 0

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        if type(self).calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().predict(*args, **kwargs)


@pytest.mark.multiprocess
def test_a_killed_job_leaves_no_output_file(trained_classifier: Path, tmp_path: Path) -> None:
    model = TextClassifier.load(trained_classifier)
    model.__class__ = _DiesOnThirdChunk
    source = _question_file(tmp_path / "questions.txt", 400)
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        flair_fabric.predict(model, source, out_path=tmp_path / "out.jsonl", devices=2, chunk_size=64, **FORK)
    assert not (tmp_path / "out.jsonl").exists()


def test_unreadable_lines_are_reported_with_their_numbers_and_counted(trained_classifier: Path, tmp_path: Path) -> None:
    source = tmp_path / "mixed.txt"
    source.write_bytes(b"What is a cat ?\n\nWho wrote Emma ?\n\xff\xfe broken\n" + b"x" * 200 + b"\nWhere is Bath ?\n")
    model = TextClassifier.load(trained_classifier)
    summary = flair_fabric.predict(
        model, source, out_path=tmp_path / "out.conll", devices=1, accelerator="cpu", tokenizer=True
    )
    assert summary.skipped == [(2, "blank line"), (4, "not UTF-8")]
    assert summary.read == 6 and summary.predicted == 4
    assert summary.seconds > 0
    assert summary.per_second == pytest.approx(4 / summary.seconds), "data points predicted per second"
    out = (tmp_path / "out.conll").read_text()
    assert out.count(f"# {TREC_LABEL_TYPE} = ") == 4 and "Bath" in out


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "flair_fabric", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.multiprocess
def test_the_command_line_predicts_and_evaluates_with_a_model_trained_here(tmp_path: Path) -> None:
    small_wnut(tmp_path / "wnut", train_size=30, dev_size=5, test_size=5)
    for split in ("dev.txt", "test.txt"):  # the training tweets again: every tag is known to the tagger
        shutil.copy(tmp_path / "wnut" / "train.txt", tmp_path / "wnut" / split)
    ner = ColumnCorpus(tmp_path / "wnut", {0: "text", 1: "ner"}, column_delimiter="\t")
    tagger = tiny_sequence_tagger(ner)
    ModelTrainer(tagger, ner).train(tmp_path / "tagger", max_epochs=2, mini_batch_size=8)
    model = str(tmp_path / "tagger" / "final-model.pt")
    test_file = str(tmp_path / "wnut" / "test.txt")
    predicted = _cli(
        "predict",
        "--model",
        model,
        "--input",
        test_file,
        "--input-format",
        "conll",
        "--output",
        str(tmp_path / "pred.conll"),
        *TWO_FORKED,
    )
    expect_success(predicted.returncode, "python -m flair_fabric predict", predicted.stderr)
    assert "30 predicted, 0 skipped" in predicted.stdout
    blocks = (tmp_path / "pred.conll").read_text().strip().split("\n\n")
    assert len(blocks) == 30 and all(len(line.split("\t")) == 3 for line in blocks[0].splitlines())
    scored = _cli(
        "evaluate",
        "--model",
        model,
        "--input",
        test_file,
        "--gold-label-type",
        "ner",
        "--json",
        *TWO_FORKED,
    )
    expect_success(scored.returncode, "python -m flair_fabric evaluate", scored.stderr)
    reference = SequenceTagger.load(model)
    expected = reference.evaluate(ColumnDataset(Path(test_file), {0: "text", 1: "ner"}), "ner", mini_batch_size=32)
    assert json.loads(scored.stdout.strip().splitlines()[-1])["main_score"] == pytest.approx(expected.main_score)
    version = _cli("--version")
    assert version.stdout.strip() == f"flair-fabric {flair_fabric.__version__}"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model", "missing.pt"], r"--model missing.pt: no such file"),
        (["--model", "README.md"], r"--model README.md: not a flair model file"),
    ],
)
def test_the_command_line_refuses_a_missing_or_foreign_model_file(arguments: list[str], message: str) -> None:
    completed = _cli("predict", *arguments, "--input", "README.md", "--output", "/tmp/never.jsonl")
    assert completed.returncode != 0
    assert re.search(message, completed.stderr), completed.stderr[-2000:]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"input_format": "xml"}, r"input_format='xml' is not a format", id="unknown-format"),
        pytest.param({"empty": True}, r"is empty: there is nothing to predict", id="empty-input"),
        pytest.param({"missing": True}, r"in\.txt' is not a file", id="missing-input"),
        pytest.param({"out_path": None}, r"out_path is needed when data is a file", id="no-out-path"),
        pytest.param(
            {"out_path": "missing/out.jsonl"},
            r"out_path=.*missing/out\.jsonl'.*folder does not exist",
            id="out-path-folder-missing",
        ),
        pytest.param({"chunk_size": -1}, r"chunk_size=-1 is not valid", id="chunk-size-negative"),
        pytest.param({"chunk_size": 0}, r"chunk_size=0 is not valid", id="chunk-size-0"),
    ],
)
def test_bad_streamed_input_is_refused_before_any_process_starts(
    trained_classifier: Path, tmp_path: Path, options: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = dict(options)
    source = tmp_path / "in.txt"
    if not options.pop("missing", False):
        source.write_text("" if options.pop("empty", False) else "What is a cat ?\n")
    if isinstance(options.get("out_path"), str):
        options["out_path"] = tmp_path / options["out_path"]
    arguments = {"out_path": tmp_path / "out.jsonl", **options}
    model = TextClassifier.load(trained_classifier)

    def no_processes(*args: Any, **kwargs: Any) -> None:
        pytest.fail("processes were started for input that had to be refused before")

    monkeypatch.setattr(prediction_api, "run_job", no_processes)
    # an OSError (e.g. from stat() of a missing file) would be a refusal of the wrong type
    with pytest.raises((ValueError, OSError)) as refused:
        flair_fabric.predict(model, source, devices=2, **FORK, **arguments)
    assert refused.type is ValueError, f"refused with a {refused.type.__name__}, not a ValueError: {refused.value}"
    assert re.search(message, str(refused.value)), str(refused.value)


@pytest.mark.multiprocess
def test_every_rank_of_a_relaunched_script_gets_flairs_labels_on_its_own_sentences(tmp_path: Path) -> None:
    run_script("predict_ddp.py", str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"labels-{rank}.json").read_text())
        assert result["ours"] == result["flair"] and all(result["ours"]), f"rank {rank}"


def test_the_command_line_passes_its_options_on_to_predict(trained_classifier: Path, tmp_path: Path) -> None:
    """--all-probabilities, --label-name and --mini-batch-size reach flair's predict: the file holds what flair's
    predict puts on the sentences with those arguments (one process, in this process)."""
    source = _question_file(tmp_path / "questions.txt", 12)
    out = tmp_path / "out.jsonl"
    options = ["--all-probabilities", "--label-name", "guess", "--mini-batch-size", "5"]
    files = ["--model", str(trained_classifier), "--input", str(source), "--output", str(out)]
    code = cli.main(["predict", *files, *options, "--devices", "1", "--accelerator", "cpu"])
    assert code == 0
    model = TextClassifier.load(trained_classifier)
    reference = [Sentence(line) for line in source.read_text().splitlines()]
    model.predict(reference, mini_batch_size=5, label_name="guess", return_probabilities_for_all_classes=True)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    expected = [
        [(label.value, round(label.score, 5)) for label in sentence.get_labels("guess")] for sentence in reference
    ]
    assert [[(label["value"], round(label["score"], 5)) for label in row["labels"]] for row in written] == expected
    assert all(len(labels) == len(model.label_dictionary) > 1 for labels in expected), "a score for every class"
    assert {label["type"] for row in written for label in row["labels"]} == {"guess"}


def _options_of(command: str) -> list[str]:
    """Every option string of ``python -m flair_fabric <command>``, from its parser."""
    commands = next(action for action in cli.parser()._actions if isinstance(action, argparse._SubParsersAction))
    return [option for action in commands.choices[command]._actions for option in action.option_strings]


def test_the_command_line_answers_help_without_loading_torch_flair_or_lightning() -> None:
    """``python -m flair_fabric ... --help`` (and an argument error) is answered before the heavy imports; the help
    is plain text and offers every Lightning argument."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['flair_fabric', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('flair_fabric', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('loaded:', sorted(name for name in ('torch', 'flair', 'lightning') if name in sys.modules))\n"
    )
    for arguments in (["--help"], ["predict", "--help"], ["evaluate", "--help"], ["predict", "--devices"]):
        completed = subprocess.run(
            [sys.executable, "-c", probe, *arguments], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert completed.stdout.strip().splitlines()[-1] == "loaded: []", (arguments, completed.stderr[-2000:])
        shown = completed.stdout + completed.stderr
        assert "``" not in shown and ":func:" not in shown and ":mod:" not in shown, shown
        if arguments[-1] == "--help" and arguments[0] != "--help":
            for name in LightningArguments.names():
                assert f"--{name.replace('_', '-')}" in shown, name
            for option in _options_of(arguments[0]):  # every option of the command, not only Lightning's
                assert re.search(rf"(^|[\s,]){re.escape(option)}\b", shown), (arguments[0], option)


@pytest.mark.parametrize("precision", FABRIC_PRECISIONS)
def test_every_precision_name_predicts_or_is_refused_and_the_callers_model_keeps_its_dtype(precision: Any) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    sentences = [Sentence(sentence.to_original_text()) for sentence in list(corpus.test)[:6]]
    if str(precision) in ("16", "16-mixed", "16-true") or str(precision).startswith("transformer-engine"):
        with pytest.raises(ValueError, match=re.escape(f"precision={precision!r}")):
            flair_fabric.predict(model, sentences, devices=1, accelerator="cpu", precision=precision)
        return
    flair_fabric.predict(model, sentences, devices=1, accelerator="cpu", precision=precision, mini_batch_size=4)
    assert all(sentence.get_labels(TREC_LABEL_TYPE) for sentence in sentences)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}, "the caller's model is as it was"


class _BatchRecorder(TextClassifier):
    """Appends the texts of every batch it encodes, with its process id, to the file ``record_to`` (set before the
    ranks fork)."""

    record_to: Path | None = None

    def _encode_data_points(self, sentences: Any, data_points: Any) -> Any:
        if self.record_to is not None:
            with self.record_to.open("a", encoding="utf-8") as stream:
                texts = [sentence.to_original_text() for sentence in sentences]
                stream.write(json.dumps({"pid": os.getpid(), "texts": texts}) + "\n")
        return super()._encode_data_points(sentences, data_points)


def _recorded_batches(path: Path) -> dict[int, list[list[str]]]:
    """Each process's batches (their texts, in order), in the order it encoded them."""
    batches: dict[int, list[list[str]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        batches.setdefault(row["pid"], []).append(row["texts"])
    return batches


@pytest.mark.multiprocess
def test_each_rank_predicts_whole_batches_of_flairs_sort_and_cut_dealt_round_robin(tmp_path: Path) -> None:
    """11 sentences of different lengths (some of equal length) in batches of 3 on 2 forked ranks: the batches are
    the ones flair's predict makes in one process (longest first, a stable sort, cut every 3), with the same members
    in the same order; one rank predicts batches 0 and 2, the other 1 and 3; the labels are flair's."""
    lengths = [2, 5, 3, 7, 5, 1, 4, 5, 6, 3, 2]
    texts = [" ".join([f"s{index}", *["what"] * (length - 1)]) for index, length in enumerate(lengths)]
    model = tiny_text_classifier(small_trec(), model_class=_BatchRecorder)
    model.eval()
    _BatchRecorder.record_to = tmp_path / "flair.jsonl"
    reference = [Sentence(text) for text in texts]
    model.predict(reference, mini_batch_size=3)
    (flair_batches,) = _recorded_batches(tmp_path / "flair.jsonl").values()
    assert [len(batch) for batch in flair_batches] == [3, 3, 3, 2]

    _BatchRecorder.record_to = tmp_path / "ours.jsonl"
    ours = [Sentence(text) for text in texts]
    flair_fabric.predict(model, ours, devices=2, mini_batch_size=3, **FORK)
    per_process = sorted(_recorded_batches(tmp_path / "ours.jsonl").values())
    assert per_process == sorted([flair_batches[0::2], flair_batches[1::2]])
    _assert_same_labels(ours, reference, [TREC_LABEL_TYPE])


def test_the_command_line_passes_its_process_options_on_to_predict(
    trained_classifier: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--accelerator, --devices, --num-nodes, --strategy, --precision and --collective-timeout reach
    ``flair_fabric.predict`` (recorded instead of run); options not given are left to predict's defaults."""
    source = _question_file(tmp_path / "questions.txt", 3)
    calls: list[dict[str, Any]] = []

    def recorded(model: Any, data: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return flair_fabric.PredictionSummary(read=3, predicted=3, seconds=1.0)

    monkeypatch.setattr(flair_fabric, "predict", recorded)
    files = ["--model", str(trained_classifier), "--input", str(source), "--output", str(tmp_path / "out.jsonl")]
    processes = ["--devices", "2", "--strategy", "ddp_fork", "--accelerator", "cpu", "--num-nodes", "1"]
    extra = ["--precision", "bf16-mixed", "--collective-timeout", "90"]
    flair_options = ["--mini-batch-size", "5", "--label-name", "guess", "--all-probabilities"]
    file_options = ["--chunk-size", "9", "--tokenizer", "space"]
    assert cli.main(["predict", *files, *processes, *extra, *flair_options, *file_options]) == 0
    (given,) = calls
    passed_on = {"mini_batch_size": 5, "label_name": "guess", "return_probabilities_for_all_classes": True}
    passed_on |= {"chunk_size": 9, "tokenizer": False}
    assert {name: given.get(name) for name in passed_on} == passed_on
    expected = {
        "devices": 2,
        "strategy": "ddp_fork",
        "accelerator": "cpu",
        "num_nodes": 1,
        "precision": "bf16-mixed",
        "collective_timeout": 90,
    }
    assert {name: given.get(name) for name in expected} == expected
    calls.clear()
    assert cli.main(["predict", *files]) == 0
    (given,) = calls
    defaults = LightningArguments().as_dict()
    assert {name: given.get(name, defaults[name]) for name in defaults} == defaults, "none given: the defaults"


def test_the_command_line_evaluate_scores_the_gold_column_as_flairs_evaluate(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The gold column (1 by default, or ``--column``) of a CoNLL file, scored by ``python -m flair_fabric evaluate``
    as flair's ``evaluate`` scores it. The gold tags are the tagger's own predictions (flair's predict), so the score
    is far from 0; a third column holds other tags, which must not be read as gold."""
    corpus = small_wnut(tmp_path / "wnut", train_size=20, dev_size=2, test_size=2)
    tagger = tiny_sequence_tagger(corpus)
    tagger.eval()
    label_type = tagger.label_type
    sentences = [Sentence([token.text for token in sentence]) for sentence in list(corpus.train)[:12]]
    tagger.predict(sentences)
    assert any(sentence.get_spans(label_type) for sentence in sentences), "the tiny tagger predicts spans"
    lines = []
    for sentence in sentences:
        for token, tag in zip(sentence, bio_tags(sentence, label_type), strict=True):
            lines.append(f"{token.text}\t{tag}\tO\n")
        lines.append("\n")
    gold = tmp_path / "gold.conll"
    gold.write_text("".join(lines), encoding="utf-8")
    model = tmp_path / "tagger.pt"
    tagger.save(model)

    gold_type = "gold"  # not the tagger's own label type: --gold-label-type names the labels scored

    def scored(*options: str) -> float:
        capsys.readouterr()
        arguments = ["--model", str(model), "--input", str(gold), "--gold-label-type", gold_type, "--json"]
        assert cli.main(["evaluate", *arguments, *options, "--devices", "1", "--accelerator", "cpu"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["main_score"]

    reference = SequenceTagger.load(model)
    assert reference.label_type != gold_type
    expected = reference.evaluate(ColumnDataset(gold, {0: "text", 1: gold_type}), gold_type, mini_batch_size=32)
    assert expected.main_score > 0.5, "the gold column holds the tagger's own predictions"
    assert scored() == pytest.approx(expected.main_score)
    other = reference.evaluate(ColumnDataset(gold, {0: "text", 2: gold_type}), gold_type, mini_batch_size=32)
    assert other.main_score != pytest.approx(expected.main_score)
    assert scored("--column", "2") == pytest.approx(other.main_score)
