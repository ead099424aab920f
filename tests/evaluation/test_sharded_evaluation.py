"""Sharded evaluation: N ranks predict disjoint whole batches, flair's evaluate scores them once on rank 0."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.data import Label, Relation, Sentence
from flair.datasets import FlairDatapointDataset
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.training_utils import Result
from lightning.fabric import Fabric

import flair_fabric
from flair_fabric.datasets import TREC_LABEL_TYPE, WNUT16_LABEL_TYPE
from flair_fabric.evaluation.batches import batches_of_rank
from flair_fabric.evaluation.predictions import UnsupportedPrediction, record_labels, restore_labels
from flair_fabric.evaluation.sharded import can_shard, evaluate_across_ranks
from flair_fabric.launch.config import make_launch_config
from flair_fabric.training.setup import sample_on_global_zero

from ..support import (
    ANNEALED,
    REPO,
    SCRIPTS,
    CountingSequenceTagger,
    CountingTextClassifier,
    processes,
    run_on_ranks,
    small_trec,
    small_wnut,
    tiny_sequence_tagger,
    tiny_text_classifier,
)

SIZES = (7, 8, 1, 0)  # not divisible by the ranks, divisible, fewer data points than ranks, empty
BATCH = 2
SHAPE = "shape"


class OwnEvaluateClassifier(CountingTextClassifier):
    """A classifier with its own ``evaluate``: it cannot be sharded and must be evaluated on rank 0 alone."""

    def evaluate(self, *args, **kwargs) -> Result:  # type: ignore[override]
        return super().evaluate(*args, **kwargs)


@dataclass
class Case:
    name: str
    model: flair.nn.Classifier
    data: list[Sentence]
    label_type: str

    def split(self, size: int) -> FlairDatapointDataset:
        return FlairDatapointDataset(self.data[:size])


def _shape(text: str) -> str:
    if text.isdigit():
        return "digits"
    if text[:1].isupper():
        return "capital"
    return "lower" if text.isalpha() else "other"


def _cases(folder: Path) -> list[Case]:
    trec = small_trec()
    text = tiny_text_classifier(trec, model_class=CountingTextClassifier)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as built, it predicts one class for everything: labels put back wrongly would not show
        for parameter in text.parameters():
            parameter.normal_(std=3.0, generator=generator)
    own = tiny_text_classifier(trec, model_class=OwnEvaluateClassifier)

    multi_corpus = small_trec(seed=5)
    for index, sentence in enumerate(multi_corpus.get_all_sentences()):
        if index % 3 == 0:
            sentence.add_label(TREC_LABEL_TYPE, "EXTRA")
    multi = tiny_text_classifier(
        multi_corpus, model_class=CountingTextClassifier, multi_label=True, multi_label_threshold=0.45
    )

    wnut = small_wnut(folder / "wnut")
    for sentence in wnut.get_all_sentences():
        for token in sentence:
            token.add_label(SHAPE, _shape(token.text))
    spans = tiny_sequence_tagger(wnut, model_class=CountingSequenceTagger)
    tokens = tiny_sequence_tagger(wnut, model_class=CountingSequenceTagger, tag_type=SHAPE, use_crf=False)

    def first(corpus, count: int = 8) -> list[Sentence]:
        return [corpus.train[index] for index in range(count)]

    return [
        Case("text", text, first(trec), TREC_LABEL_TYPE),
        Case("multi_label", multi, first(multi_corpus), TREC_LABEL_TYPE),
        Case("ner_spans", spans, first(wnut), WNUT16_LABEL_TYPE),
        Case("token_level", tokens, first(wnut), SHAPE),
        Case("own_evaluate", own, first(trec), TREC_LABEL_TYPE),
    ]


def _options(case: Case) -> dict[str, Any]:
    """flair's evaluate arguments other than the defaults: the macro F1, the case's most common class excluded."""
    most_common = Counter(label.value for sentence in case.data for label in sentence.get_labels(case.label_type))
    return {"main_evaluation_metric": ("macro avg", "f1-score"), "exclude_labels": [most_common.most_common(1)[0][0]]}


def _evaluate_every_case(fabric: Fabric, job: tuple[Path, list[Case]]) -> dict[str, Result]:
    """On each rank: every case at every size (the text case with flair's other arguments too); the texts each rank
    predicted go to a file per rank."""
    out, cases = job
    results = {}
    for case in cases:
        if case.name == "text":
            results["text-options"] = evaluate_across_ranks(
                fabric,
                case.model,
                case.split(len(case.data)),
                out_path=None,
                gold_label_type=case.label_type,
                mini_batch_size=BATCH,
                **_options(case),
            )
        case.model.predicted_texts.clear()
        for size in SIZES:
            results[f"{case.name}-{size}"] = evaluate_across_ranks(
                fabric,
                case.model,
                case.split(size),
                out_path=out / f"{case.name}-{size}-sharded.tsv",
                gold_label_type=case.label_type,
                mini_batch_size=BATCH,
            )
    predicted = {case.name: case.model.predicted_texts for case in cases}
    (out / f"predicted-rank{fabric.global_rank}.json").write_text(json.dumps(predicted))
    return results


class _OwnEvaluateWarnings(logging.Handler):
    """The level of every "overrides flair's evaluate" record, from whichever process (forked ranks inherit it)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if "overrides flair's evaluate" in record.getMessage():
            with open(self.path, "a", encoding="utf-8") as stream:
                stream.write(json.dumps([record.levelname, os.getpid()]) + "\n")


def _assert_same_result(sharded: Result, single: Result) -> None:
    assert sharded.main_score == single.main_score
    assert sharded.detailed_results == single.detailed_results
    assert sharded.classification_report == single.classification_report
    assert sharded.scores.keys() == single.scores.keys()
    for key, value in single.scores.items():
        # the same per-batch losses summed in the same order; worker processes may use fewer BLAS threads
        assert sharded.scores[key] == (pytest.approx(value, rel=1e-6, abs=1e-9) if key == "loss" else value), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_evaluation_equals_flair_and_predicts_each_data_point_once(world_size: int, tmp_path: Path) -> None:
    cases = _cases(tmp_path)
    # two jobs, each checked before the next starts: labels on sentences, then on tokens and spans
    for job in (cases[:2] + cases[4:], cases[2:4]):
        _assert_equals_flair_and_predicts_each_data_point_once(world_size, job, tmp_path)


def _assert_equals_flair_and_predicts_each_data_point_once(world_size: int, cases: list[Case], tmp_path: Path) -> None:
    config = make_launch_config(
        accelerator="cpu", devices=world_size, num_nodes=1, strategy="ddp_fork", precision=None, use_amp=False
    )
    warnings = _OwnEvaluateWarnings(tmp_path / "own-evaluate-warnings.jsonl")  # forked ranks inherit it
    logging.getLogger("flair").addHandler(warnings)
    try:
        sharded = run_on_ranks(config, _evaluate_every_case, (tmp_path, cases), result_types=(Result,))
    finally:
        logging.getLogger("flair").removeHandler(warnings)
    if any(case.name == "own_evaluate" for case in cases):  # docs/launching.md: "with a warning", once per evaluation
        written = warnings.path.read_text().splitlines() if warnings.path.exists() else []
        levels = [json.loads(line)[0] for line in written]
        assert levels == ["WARNING"] * len(SIZES), levels
    if "text-options" in sharded:  # flair's evaluate arguments reach flair's evaluate on rank 0
        text = cases[0]
        single = text.model.evaluate(
            text.split(len(text.data)), text.label_type, mini_batch_size=BATCH, **_options(text)
        )
        defaults = text.model.evaluate(text.split(len(text.data)), text.label_type, mini_batch_size=BATCH)
        assert len({sentence.get_label("predicted").value for sentence in text.data}) > 1, "the predictions vary"
        assert (single.main_score, single.detailed_results) != (defaults.main_score, defaults.detailed_results)
        _assert_same_result(sharded["text-options"], single)

    predicted = [json.loads((tmp_path / f"predicted-rank{rank}.json").read_text()) for rank in range(world_size)]
    for case in cases:
        expected_texts = Counter(sentence.to_original_text() for size in SIZES for sentence in case.data[:size])
        per_rank = [Counter(texts[case.name]) for texts in predicted]
        # every data point predicted exactly once in total: no padding duplicates, nothing left out
        assert sum(per_rank, Counter()) == expected_texts, case.name
        if case.name == "own_evaluate":  # not shardable: rank 0 predicts everything
            assert all(not counts for counts in per_rank[1:])
        else:  # whole batches of 2 dealt round robin: batch b of each split is predicted by rank b % N
            dealt = [
                Counter(
                    sentence.to_original_text()
                    for size in SIZES
                    for number, start in enumerate(range(0, size, BATCH))
                    if number % world_size == rank
                    for sentence in case.data[start : min(start + BATCH, size)]
                )
                for rank in range(world_size)
            ]
            assert per_rank == dealt, case.name

        for size in SIZES:
            single = case.model.evaluate(
                case.split(size),
                gold_label_type=case.label_type,
                out_path=tmp_path / f"{case.name}-{size}-single.tsv",
                mini_batch_size=BATCH,
            )
            _assert_same_result(sharded[f"{case.name}-{size}"], single)
            written = (tmp_path / f"{case.name}-{size}-sharded.tsv").read_bytes()
            assert written == (tmp_path / f"{case.name}-{size}-single.tsv").read_bytes(), f"{case.name}-{size}"


def _ranks_disagree(fabric: Fabric, job: tuple[Path, Case, str]) -> Result:
    """Each rank: flair's and FabricTrainer's train sample under different random states (once); then the evaluation
    of data that differ on rank 1 (``how``: reordered, shorter)."""
    out, case, how = job
    if how == "reordered":
        corpus = small_trec()
        random.seed(1000 + fabric.global_rank)
        flair_sample = ModelTrainer(case.model, corpus)._sample_train_split(0.25).indices
        random.seed(1000 + fabric.global_rank)
        fabric_sample = sample_on_global_zero(fabric, ModelTrainer(case.model, corpus)._sample_train_split(0.25))
        (out / f"samples-rank{fabric.global_rank}.json").write_text(json.dumps([flair_sample, fabric_sample.indices]))

    data = case.data
    on_this_rank = {"reordered": data[::-1], "shorter": data[:3]} if fabric.global_rank == 1 else {}
    return evaluate_across_ranks(
        fabric,
        case.model,
        FlairDatapointDataset(on_this_rank.get(how, data)),
        out_path=None,
        gold_label_type=case.label_type,
        mini_batch_size=BATCH,
    )


@pytest.mark.multiprocess
def test_ranks_that_hold_different_data_never_give_a_wrong_number(tmp_path: Path) -> None:
    case = _cases(tmp_path)[0]
    single = case.model.evaluate(case.split(len(case.data)), case.label_type, mini_batch_size=BATCH)
    # rank 1 predicted other sentences than rank 0 would deal it: rank 0 evaluates everything itself. One job each,
    # each checked before the next starts
    for how in ("reordered", "shorter"):
        config = make_launch_config(
            accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_fork", precision=None, use_amp=False
        )
        _assert_same_result(
            run_on_ranks(config, _ranks_disagree, (tmp_path, case, how), result_types=(Result,)), single
        )

    # the monitor_train_sample split: flair draws it from each rank's own random state, FabricTrainer from rank 0's
    (flair0, fabric0), (flair1, fabric1) = (
        json.loads((tmp_path / f"samples-rank{rank}.json").read_text()) for rank in (0, 1)
    )
    assert flair0 != flair1, "the ranks' random states differ, so flair's samples differ"
    assert fabric0 == fabric1 == flair0


@pytest.mark.multiprocess
def test_training_evaluations_are_sharded_and_every_rank_takes_the_same_decisions(
    two_rank_runs: Path, tmp_path: Path
) -> None:
    run_dir = two_rank_runs / "annealed"
    rank0, rank1 = (json.loads((run_dir / f"summary-rank{rank}.json").read_text()) for rank in (0, 1))
    # the same scores, best-model flags and annealed learning rates on both ranks, step by step
    assert rank0["evaluations"] == rank1["evaluations"]
    assert [evaluation["best"] for evaluation in rank0["evaluations"]].count(True) >= 1
    assert rank0["lr_trace"] == rank1["lr_trace"]
    assert len(set(rank0["lr_trace"])) > 1, "the plateau annealed the learning rate at least once"

    # the final test evaluation (sharded) equals flair's evaluate of the best model in one process, file included
    best = TextClassifier.load(run_dir / "best-model.pt")
    single = best.evaluate(
        small_trec().test,
        TREC_LABEL_TYPE,
        out_path=tmp_path / "test.tsv",
        mini_batch_size=ANNEALED["eval_batch_size"],
        return_loss=False,
    )
    assert rank0["result"]["test_score"] == rank1["result"]["test_score"] == single.main_score
    assert (run_dir / "test.tsv").read_bytes() == (tmp_path / "test.tsv").read_bytes()
    # the last dev evaluation wrote dev.tsv once, as flair's evaluate of the weights of that epoch writes it
    best.load_state_dict(torch.load(run_dir / "weights-rank0.pt")["last_evaluated"])
    best.evaluate(small_trec().dev, TREC_LABEL_TYPE, out_path=tmp_path / "dev.tsv", mini_batch_size=2)
    assert (run_dir / "dev.tsv").read_bytes() == (tmp_path / "dev.tsv").read_bytes()
    assert (run_dir / "train_sample.tsv").exists()
    assert [evaluation["scores"][0] for evaluation in rank0["evaluations"]] == rank0["result"]["dev_score_history"]


@pytest.mark.multiprocess
def test_public_evaluate_under_spawn_moves_ner_sentences_and_equals_flair(tmp_path: Path) -> None:
    corpus = small_wnut(tmp_path / "wnut")
    model = tiny_sequence_tagger(corpus)
    sentences = [corpus.dev[index] for index in range(len(corpus.dev))]
    sharded = flair_fabric.evaluate(
        model,
        sentences,
        WNUT16_LABEL_TYPE,
        out_path=tmp_path / "sharded.tsv",
        mini_batch_size=3,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
    )
    # the spawned workers predicted on copies; the caller's sentences now carry rank 0's gathered predictions
    from_workers = [[repr(label) for label in sentence.get_labels("predicted")] for sentence in sentences]
    assert any(from_workers), "the tiny tagger predicts some spans"
    single = model.evaluate(sentences, WNUT16_LABEL_TYPE, out_path=tmp_path / "single.tsv", mini_batch_size=3)
    _assert_same_result(sharded, single)
    assert (tmp_path / "sharded.tsv").read_bytes() == (tmp_path / "single.tsv").read_bytes()
    assert from_workers == [[repr(label) for label in sentence.get_labels("predicted")] for sentence in sentences]


def test_public_evaluate_on_one_device_is_flairs_evaluate(tmp_path: Path) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    untouched = copy.deepcopy(list(corpus.test))  # flair's reference evaluates data our code never saw
    sharded = flair_fabric.evaluate(model, corpus.test, TREC_LABEL_TYPE, accelerator="cpu", devices=1)
    single = model.evaluate(untouched, TREC_LABEL_TYPE)
    assert sharded.scores == single.scores
    assert sharded.detailed_results == single.detailed_results
    assert [s.get_label("predicted").value for s in corpus.test] == [s.get_label("predicted").value for s in untouched]


def test_bad_arguments_are_refused_before_any_process_starts() -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    with pytest.raises(ValueError, match="strategy='nope'"):
        flair_fabric.evaluate(model, corpus.test, TREC_LABEL_TYPE, accelerator="cpu", devices=2, strategy="nope")


@pytest.mark.parametrize(("size", "batch_size", "world_size"), [(7, 2, 2), (8, 2, 3), (1, 2, 3), (0, 4, 2), (9, 3, 2)])
def test_whole_batches_are_dealt_round_robin(size: int, batch_size: int, world_size: int) -> None:
    dealt = [batches_of_rank(size, batch_size, rank, world_size) for rank in range(world_size)]
    numbers = sorted(number for batches in dealt for number, _ in batches)
    indices = sorted(index for batches in dealt for _, batch in batches for index in batch)
    assert numbers == list(range(-(-size // batch_size)))
    assert indices == list(range(size))
    for rank, batches in enumerate(dealt):
        for number, batch in batches:  # the same batches flair's DataLoader makes in one process
            assert list(batch) == list(range(number * batch_size, min((number + 1) * batch_size, size)))
            assert number % world_size == rank, (number, rank)  # batch b on rank b % N


def test_models_with_their_own_evaluate_are_not_sharded() -> None:
    corpus = small_trec()
    assert can_shard(tiny_text_classifier(corpus))
    assert not can_shard(tiny_text_classifier(corpus, model_class=OwnEvaluateClassifier))


def test_predicted_labels_move_to_another_copy_of_the_sentence() -> None:
    def build() -> Sentence:
        return Sentence("George Washington went to Washington .")

    source = build()
    source.add_label("predicted", "PLACE", 0.7)
    source.add_label("predicted", "PERSON", 0.2, note="second")
    source[0].add_label("predicted", "capital", 0.9)
    person, place = source[0:2], source[4:5]
    person.add_label("predicted", "PER", 0.8)
    place.add_label("predicted", "LOC", 0.6)
    Relation(person, place).add_label("predicted", "went_to", 0.5)

    recorded = record_labels(source, "predicted")
    copy = build()
    restore_labels(copy, "predicted", recorded)
    assert [repr(label) for label in copy.get_labels("predicted")] == [
        repr(label) for label in source.get_labels("predicted")
    ]
    assert [label.labeled_identifier for label in copy.get_labels("predicted")] == [
        label.labeled_identifier for label in source.get_labels("predicted")
    ]


def test_a_label_on_something_outside_the_data_point_cannot_be_moved() -> None:
    sentence, elsewhere = Sentence("a b"), Sentence("c")
    sentence.annotation_layers["predicted"] = [Label(elsewhere[0], "X")]
    with pytest.raises(UnsupportedPrediction, match="Token"):
        record_labels(sentence, "predicted")


@pytest.mark.multiprocess
def test_public_evaluate_with_the_script_relaunch_ends_the_job_when_a_rank_raises(tmp_path: Path) -> None:
    """The same launch path as training: the relaunched rank does not outlive rank 0's error."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "evaluate_failing.py")],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        while not any("caught on rank 0" in line for line in lines) and process.poll() is None:
            lines.append(process.stdout.readline())
        assert "injected failure while predicting on rank 0" in "".join(lines)
        deadline = time.monotonic() + 20  # rank 0 is alive: only the launch path can stop the relaunched rank
        while _group_members(process.pid) - {process.pid} and time.monotonic() < deadline:
            time.sleep(0.2)
        # rank 0 itself may be gone by now: Lightning's child-process observer kills it (within 5 s) once the
        # relaunched rank has died, which is what is asked here; rank 0 dies only after it
        assert not _group_members(process.pid) - {process.pid}, "the relaunched rank outlived rank 0's error"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _group_members(group: int) -> set[int]:
    """The live processes of process group ``group`` (zombies do not count)."""
    return {process.pid for process in processes() if process.group == group and process.state != "Z"}


class _BatchSizeRecorder(TextClassifier):
    """Remembers the size of every batch its ``predict`` is called with (flair's evaluate: one call per batch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_sizes: list[int] = []

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        self.batch_sizes.append(len(sentences) if isinstance(sentences, list) else 1)
        return super().predict(sentences, *args, **kwargs)


def test_flairs_evaluate_arguments_reach_flairs_evaluate() -> None:
    """``mini_batch_size``, ``main_evaluation_metric`` and ``exclude_labels`` given to ``flair_fabric.evaluate`` give
    what flair's ``evaluate`` gives with them in one process (batches of 3, the macro F1, the report without the
    excluded class), which is not what it gives without them."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus, model_class=_BatchSizeRecorder)
    model.eval()
    excluded = Counter(sentence.get_label(TREC_LABEL_TYPE).value for sentence in corpus.test).most_common(1)[0][0]
    options = {"mini_batch_size": 3, "main_evaluation_metric": ("macro avg", "f1-score"), "exclude_labels": [excluded]}
    expected = model.evaluate(copy.deepcopy(list(corpus.test)), TREC_LABEL_TYPE, **options)
    flair_batches, model.batch_sizes = model.batch_sizes, []
    defaults = model.evaluate(copy.deepcopy(list(corpus.test)), TREC_LABEL_TYPE)
    model.batch_sizes = []
    assert flair_batches == [3, 3, 3, 3]
    assert defaults.main_score != expected.main_score and defaults.detailed_results != expected.detailed_results

    result = flair_fabric.evaluate(
        model, copy.deepcopy(list(corpus.test)), TREC_LABEL_TYPE, **options, devices=1, accelerator="cpu"
    )
    assert model.batch_sizes == flair_batches
    assert result.main_score == expected.main_score
    assert result.detailed_results == expected.detailed_results
    assert result.classification_report == expected.classification_report
