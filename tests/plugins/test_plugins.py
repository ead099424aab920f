"""Rank-aware plugins on 2 CPU ranks: loggers on global rank 0 only, functional plugins in lockstep, flair's
distributed plugin bugs fixed."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.data import Sentence
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.nn import DeepNCMDecoder
from flair.trainers.plugins import DeepNCMPlugin, TrainerPlugin
from lightning.fabric.loggers import CSVLogger
from torch.multiprocessing import ProcessRaisedException

from flair_fabric import FabricTrainer, GlobalZeroPlugin, LightningLoggerPlugin, rank_zero_only
from flair_fabric.datasets import TREC_LABEL_TYPE
from flair_fabric.strategies.probing import parameters_without_gradient
from flair_fabric.training.progress_bar import show_progress_bar
from flair_fabric.training.run import TrainingRun

from ..plugin_support import HookCounter, StepRecorder, StopOnOneRank
from ..support import (
    UNION,
    make_tiny_bert,
    out_of_step_is_a_hang,
    run_script,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
    tiny_transformer_classifier,
    write_config,
)

EPOCHS = 3


def _records(out: Path) -> tuple[dict, dict]:
    rank0, rank1 = (json.loads((out / f"record-rank{rank}.json").read_text()) for rank in (0, 1))
    return rank0, rank1


def _weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights-rank{rank}.pt")


# --- every logger in a real 2-rank script -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict, str]:
    out = tmp_path_factory.mktemp("loggers")
    kwargs = {
        "max_epochs": EPOCHS,
        "mini_batch_size": 4,
        "eval_batch_size": 4,
        "devices": 2,
        "save_model_each_k_epochs": 2,
        "progress_bar": True,
        "collective_timeout": 60,  # a rank left waiting ends the run (and fails the tests) within a minute
    }
    runs = [{"name": "loggers", "method": "train", "kwargs": kwargs, "loggers": True, "count_saves": True}]
    run_dir = out / "loggers"
    with out_of_step_is_a_hang():  # a rank left waiting in a collective (a save on one rank only) is a hang
        output = run_script("ddp_runs.py", str(write_config(out / "config.json", {"out": str(out), "runs": runs})))
    summary0, summary1 = (json.loads((run_dir / f"summary-rank{rank}.json").read_text()) for rank in (0, 1))
    return run_dir, summary0, summary1, output


def _scalar_events(folder: Path, tag: str) -> dict[str, int]:
    """Per TensorBoard event file: how many scalar events with ``tag`` it holds."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    counts = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        events = EventFileLoader(str(path)).Load()
        counts[path.name] = sum(1 for event in events for value in event.summary.value if value.tag == tag)
    return counts


@pytest.mark.multiprocess
def test_each_logger_writes_once_per_event_on_global_zero_only(logged_run: tuple[Path, dict, dict, str]) -> None:
    run_dir, rank0, rank1, _ = logged_run
    log_text = (run_dir / "training.log").read_text()
    assert [log_text.count(f"EPOCH {epoch} done") for epoch in range(1, EPOCHS + 1)] == [1] * EPOCHS
    loss_rows = (run_dir / "loss.tsv").read_text().splitlines()
    assert len(loss_rows) == 1 + EPOCHS and loss_rows[0].startswith("EPOCH")

    # flair's TensorboardLogger: rank 1 built one too (its constructor opens a file), but only rank 0 wrote to it
    per_file = _scalar_events(run_dir / "tensorboard", "train/loss")
    assert sorted(per_file.values()) == [0, EPOCHS]
    assert rank0["tensorboard_closed"] == rank1["tensorboard_closed"] == [True], "closed where it never ran, too"
    # closed at set-up where it is not attached, while global rank 0's is still open for writing
    assert (rank0["tensorboard_closed_at_setup"], rank1["tensorboard_closed_at_setup"]) == ([False], [True])

    assert rank1["clearml_scalars"] == []
    assert sum(series == "train.loss" for series, _, _ in rank0["clearml_scalars"]) == EPOCHS
    assert len(rank0["result"]["train_loss_history"]) == EPOCHS  # MetricHistoryPlugin, from rank 0

    loggers = ("TensorboardLogger", "ClearmlLoggerPlugin", "LightningLoggerPlugin")
    assert all(rank0["attached"][name] for name in loggers)
    assert not any(rank1["attached"][name] for name in loggers)


@pytest.mark.multiprocess
def test_rank_zero_only_hook_runs_on_rank_zero_and_normal_hook_everywhere(
    logged_run: tuple[Path, dict, dict, str],
) -> None:
    _, rank0, rank1, _ = logged_run
    assert (rank0["every_rank_calls"], rank0["rank_zero_calls"]) == (EPOCHS, EPOCHS)
    assert (rank1["every_rank_calls"], rank1["rank_zero_calls"]) == (EPOCHS, 0)
    assert rank0["attached"]["HookCounter"] and rank1["attached"]["HookCounter"]


@pytest.mark.multiprocess
def test_checkpoint_every_epoch_finishes_and_writes_one_loadable_file_per_epoch(
    logged_run: tuple[Path, dict, dict, str],
) -> None:
    """save_model_each_k_epochs=2 in 3 epochs: model_epoch_2.pt, written once (by global rank 0), with the weights at
    epoch 2's end; the run ends (every rank reaches the save)."""
    run_dir, _, _, _ = logged_run
    assert sorted(path.name for path in run_dir.glob("model_epoch_*.pt")) == ["model_epoch_2.pt"]
    assert not list(run_dir.glob(".*.tmp"))
    saves = (run_dir / "saves.txt").read_text().splitlines()
    assert [line for line in saves if "model_epoch" in line] == ["0 model_epoch_2.pt"]
    # model_epoch_k.pt holds the weights at the end of epoch k: those the ranks started epoch k + 1 with
    _, summary, _, _ = logged_run
    saved = TextClassifier.load(run_dir / "model_epoch_2.pt")
    total = sum(float(parameter.double().sum()) for parameter in saved.parameters())
    assert total == pytest.approx(summary["weight_trace"][2], rel=1e-12)
    assert summary["weight_trace"][1] != summary["weight_trace"][2], "the weights changed between epochs"


_LOSS_FILE_COLUMNS = {"LOSS": "loss", "PRECISION": "micro avg/precision", "RECALL": "micro avg/recall"}
_LOSS_FILE_COLUMNS |= {"F1": "micro avg/f1-score", "ACCURACY": "accuracy"}


def _metric_of_loss_file_column(header: str) -> str | None:
    if header in ("EPOCH", "TIMESTAMP"):
        return None
    if header in ("LEARNING_RATE", "BAD_EPOCHS"):
        return header.lower()
    prefix, _, column = header.rpartition("_")
    return f"{prefix.lower()}/{_LOSS_FILE_COLUMNS[column]}"


@pytest.mark.multiprocess
def test_lightning_logger_bridge_writes_what_the_loss_file_writes(logged_run: tuple[Path, dict, dict, str]) -> None:
    run_dir, _, _, _ = logged_run
    with (run_dir / "csv" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    header, *lines = [line.split("\t") for line in (run_dir / "loss.tsv").read_text().splitlines()]
    _, rank0, _, _ = logged_run
    steps_per_epoch = len(rank0["lr_trace"]) // EPOCHS
    logged_steps = [int(row["step"]) for row in rows]
    assert logged_steps == sorted(logged_steps), "one step axis (the optimizer steps), never going back"
    compared = 0
    for line in lines:
        epoch = int(line[0])  # an epoch's metrics are logged at its last optimizer step
        for name, text in zip(header, line, strict=True):
            metric = _metric_of_loss_file_column(name)
            if metric is None:
                continue
            # the row's learning rate is the one of the epoch's start (also logged there by the per-step records)
            step = (epoch - 1 if metric == "learning_rate" else epoch) * steps_per_epoch
            values = [float(row[metric]) for row in rows if row.get(metric) and int(row["step"]) == step]
            assert len(values) == 1 or (metric == "learning_rate" and len(set(values)) == 1), (metric, epoch)
            expected = str(int(values[0])) if name == "BAD_EPOCHS" else f"{values[0]:.4f}"
            assert expected == text, (metric, epoch)
            compared += 1
    assert compared >= EPOCHS * 4
    # the per-step records too: every train/batch_loss record of global rank 0, with its step (1, 2, ...) and value
    forwarded = [[int(row["step"]), float(row["train/batch_loss"])] for row in rows if row.get("train/batch_loss")]
    assert forwarded == rank0["batch_loss_records"]
    assert [step for step, _ in forwarded] == list(range(1, len(rank0["lr_trace"]) + 1))
    # Lightning's TensorBoardLogger got the same records, from one writer
    assert sorted(_scalar_events(run_dir / "lightning_tensorboard", "train/loss").values()) == [EPOCHS]


@pytest.mark.multiprocess
def test_functional_plugins_get_the_same_inputs_on_every_rank(logged_run: tuple[Path, dict, dict, str]) -> None:
    """after_evaluation (flair's AnnealingPlugin runs on every rank) gets the same validation scores and best-model
    decisions on both ranks, and both ranks train with the same learning rate at every step."""
    _, rank0, rank1, _ = logged_run
    assert len(rank0["evaluations"]) == EPOCHS
    assert rank0["evaluations"] == rank1["evaluations"]
    assert len(rank0["lr_trace"]) == EPOCHS * 6 and rank0["lr_trace"] == rank1["lr_trace"]


@pytest.mark.multiprocess
def test_progress_bar_is_drawn_by_global_zero_when_asked(logged_run: tuple[Path, dict, dict, str]) -> None:
    *_, output = logged_run
    assert all(f"epoch {epoch}" in output for epoch in range(1, EPOCHS + 1))
    assert "samples/s" in output and "loss=" in output
    # one bar per epoch, whatever the number of processes: a bar renders its empty start (no rate, no loss yet) once
    # when it is created, so each epoch's start appears once in the ranks' shared output
    started = re.findall(r"epoch (\d+): +0%\|[^\r\n]*\| 0/\d+ \[00:00<\?, \?step/s\]", output)
    assert sorted(started) == [str(epoch) for epoch in range(1, EPOCHS + 1)], started


def test_progress_bar_choice() -> None:
    assert show_progress_bar(True, is_global_zero=True)
    assert not show_progress_bar(True, is_global_zero=False)
    assert not show_progress_bar(False, is_global_zero=True)
    with pytest.raises(ValueError, match="progress_bar='yes'"):
        show_progress_bar("yes", is_global_zero=True)  # type: ignore[arg-type]


# --- functional plugins in lockstep (forked ranks) ----------------------------------------------------------------


def _train(
    out: Path,
    model: flair.nn.Model,
    corpus: Any,
    devices: int,
    plugins: list[TrainerPlugin],
    method: str = "train_custom",
    **kwargs: Any,
) -> dict:
    strategy = "ddp_fork" if devices > 1 else "auto"
    trainer = FabricTrainer(model, corpus)
    return getattr(trainer, method)(
        out, plugins=plugins, accelerator="cpu", devices=devices, strategy=strategy, **kwargs
    )


def _two_ranks_and_one_process(
    tmp_path: Path, build: Any, corpus: Any, extra_plugins: Any = list, **settings: Any
) -> tuple[Path, Path]:
    """The same training on 2 ranks with batch 4 (into ``two/``) and in one process with batch 8 (into ``one/``),
    each with a StepRecorder that saves every rank's weights."""
    for name, devices, batch_size in (("two", 2, 4), ("one", 1, 8)):
        plugins = [*extra_plugins(), StepRecorder(tmp_path / name, save_weights=True)]
        _train(tmp_path / name, build(), corpus, devices, plugins, mini_batch_size=batch_size, **settings)
    return tmp_path / "two", tmp_path / "one"


@pytest.mark.multiprocess
def test_linear_schedule_in_lockstep(tmp_path: Path) -> None:
    """49 questions on 2 ranks with batch 4: the 7 steps of one process with batch 8 (6 of 8 questions, then one
    question, read by rank 0 while rank 1 reads none); a count of each rank's shard of 24 or 25 would give 6."""
    corpus = small_trec(train_size=49)
    schedule = {"max_epochs": 2, "learning_rate": 0.05, "mini_batch_size": 4, "shuffle": True, "method": "fine_tune"}
    _train(tmp_path, tiny_text_classifier(corpus), corpus, 2, [StepRecorder(tmp_path)], **schedule)
    rank0, rank1 = _records(tmp_path)
    # fine_tune's LinearSchedulerPlugin: the same learning rate on both ranks at every step, over the exact steps
    assert rank0["learning_rates"] == rank1["learning_rates"]
    assert len(rank0["learning_rates"]) == 14 and len(set(rank0["learning_rates"])) > 2
    # trainer.steps_per_epoch, read inside a hook, is the steps each rank runs: the schedule ends exactly at 0
    for record in (rank0, rank1):
        assert record["batch_counts"] == list(range(1, 15)) and record["epochs"] == [1, 2]
        assert record["steps_per_epoch"] == 7
        assert record["learning_rate_at_the_end"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", [{"at_step": 5}, {"at_epoch": 2}])
def test_a_stop_on_one_rank_stops_both_ranks_at_the_same_point(where: dict[str, int], tmp_path: Path) -> None:
    corpus = small_trec()
    recorder = StepRecorder(tmp_path)
    _train(
        tmp_path,
        tiny_text_classifier(corpus),
        corpus,
        2,
        [recorder, StopOnOneRank(rank=1, **where)],
        mini_batch_size=4,
        max_epochs=4,
    )
    rank0, rank1 = _records(tmp_path)
    assert rank0["batch_counts"] == rank1["batch_counts"]
    assert rank0["epochs"] == rank1["epochs"]
    if "at_step" in where:
        assert rank0["batch_counts"][-1] == 5
    else:
        assert rank0["epochs"] == [1, 2] and rank0["batch_counts"][-1] == 12  # 24 questions per rank, batch 4
    assert (tmp_path / "final-model.pt").exists()
    log_text = (tmp_path / "training.log").read_text()
    if "at_epoch" in where:  # agreed right after after_training_epoch: epoch 2 is not evaluated, as in flair
        assert log_text.count("DEV : loss") == 1
    # global rank 0's log names the rank that stopped and its TrainingInterrupt's message (which names no rank)
    reason = "plugin wants to stop after step 5" if "at_step" in where else "plugin wants to stop after epoch 2"
    assert f"{reason} (stopped by rank 1; every rank stops here)" in log_text, log_text[-3000:]


@pytest.mark.multiprocess
def test_reduce_transformer_vocab_keeps_the_ranks_equal(tmp_path: Path) -> None:
    corpus = small_trec(train_size=32)
    bert = make_tiny_bert(tmp_path / "bert", corpus)
    settings = {"max_epochs": 2, "learning_rate": 1e-3, "shuffle": False, "reduce_transformer_vocab": True}
    full_vocabulary = tiny_transformer_classifier(corpus, bert).embeddings.model.get_input_embeddings().weight.shape
    build = lambda: tiny_transformer_classifier(corpus, bert)  # noqa: E731
    two, one = tmp_path / "two", tmp_path / "one"
    failed: ProcessRaisedException | None = None
    with pytest.MonkeyPatch.context() as patch:  # the forked ranks inherit it
        patch.setattr(TrainingRun, "_before_wrapping", _recording_rows(TrainingRun._before_wrapping))
        try:
            _train(two, build(), corpus, 2, [StepRecorder(two, save_weights=True)], mini_batch_size=4, **settings)
        except ProcessRaisedException as error:  # DDP refuses ranks whose shapes differ: the rows are asserted first
            failed = error
    # the embedding rows each rank hands to DDP: the same reduced vocabulary on both
    wrapped = [two / f"wrapped-rows-rank{rank}.txt" for rank in (0, 1)]
    rows = [int(path.read_text()) if path.exists() else None for path in wrapped]
    assert rows[0] is not None and rows[0] == rows[1] < full_vocabulary[0], rows
    if failed is not None:
        raise failed
    _train(one, build(), corpus, 1, [StepRecorder(one, save_weights=True)], mini_batch_size=8, **settings)
    rank0, rank1 = _weights(two, 0), _weights(two, 1)
    assert state_dict_difference(rank0, rank1) == 0.0, "the ranks' weights must not diverge"
    assert state_dict_difference(rank0, _weights(one, 0)) <= 1e-5, "as one process on the union"
    saved = TextClassifier.load(tmp_path / "two" / "best-model.pt")
    assert saved.embeddings.model.get_input_embeddings().weight.shape == full_vocabulary
    # final-model.pt, written during training, keeps the reduced vocabulary, as flair's plugin leaves it in one process
    for folder in (two, one):
        final = TextClassifier.load(folder / "final-model.pt").embeddings.model.get_input_embeddings().weight.shape
        assert final[0] == rows[0], folder.name
    sentence = Sentence("What is the capital of France ?")
    saved.predict(sentence)
    assert sentence.get_label(TREC_LABEL_TYPE).value in saved.label_dictionary.get_items()


def _recording_rows(before_wrapping: Any) -> Any:
    """``TrainingRun._before_wrapping`` that writes the input-embedding rows of the model this rank is about to wrap
    to ``<base_path>/wrapped-rows-rank<r>.txt``."""

    def recording(run: TrainingRun, optimizer: Any) -> None:
        before_wrapping(run, optimizer)
        rows = run.trainer.model.embeddings.model.get_input_embeddings().weight.shape[0]
        (Path(run.base_path) / f"wrapped-rows-rank{run.fabric.global_rank}.txt").write_text(str(rows))

    return recording


def _deep_ncm_classifier(corpus: Any) -> TextClassifier:
    flair.set_seed(7)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=16)
    document = DocumentPoolEmbeddings([words], fine_tune_mode="nonlinear")
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    decoder = DeepNCMDecoder(labels, embeddings_size=document.embedding_length, mean_update_method="online")
    return TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels, decoder=decoder)


@pytest.mark.multiprocess
def test_deep_ncm_prototypes_are_updated_from_all_ranks(tmp_path: Path) -> None:
    corpus = small_trec()
    build = lambda: _deep_ncm_classifier(corpus)  # noqa: E731
    two, one = _two_ranks_and_one_process(tmp_path, build, corpus, lambda: [DeepNCMPlugin()], **UNION)
    rank0, rank1 = _weights(two, 0), _weights(two, 1)
    prototypes = "decoder.class_prototypes"
    assert torch.equal(rank0[prototypes], rank1[prototypes])
    assert torch.allclose(rank0[prototypes], _weights(one, 0)[prototypes], atol=1e-5, rtol=0)


# --- the plugin API in one process --------------------------------------------------------------------------------


class _LateLogger(GlobalZeroPlugin):
    pass


def test_plugin_api_in_one_process(tmp_path: Path) -> None:
    corpus = small_trec()
    counter = HookCounter()
    assert not _LateLogger().attach_to_all_processes
    _train(tmp_path, tiny_text_classifier(corpus), corpus, 1, [counter, _LateLogger()], max_epochs=2)
    assert (counter.every_rank_calls, counter.rank_zero_calls) == (2, 2)


def test_rank_zero_only_keeps_the_hook_registration() -> None:
    class Plugin(TrainerPlugin):
        @rank_zero_only
        @TrainerPlugin.hook
        def after_training_epoch(self, **kw: Any) -> None:
            pass

    assert Plugin.after_training_epoch._plugin_hook_events == ("after_training_epoch",)  # type: ignore[attr-defined]


def test_lightning_logger_plugin_refuses_what_is_not_a_logger() -> None:
    with pytest.raises(TypeError, match=r"lightning\.fabric\.loggers\.Logger"):
        LightningLoggerPlugin(["logs/"])  # type: ignore[list-item]
    assert str(LightningLoggerPlugin(CSVLogger("unused"))) == "LightningLoggerPlugin(CSVLogger)"


def test_the_unused_parameter_probe_leaves_no_trace_in_stateful_modules() -> None:
    corpus = small_trec()
    model = _deep_ncm_classifier(corpus)
    parameters_without_gradient(model, [corpus.train[index] for index in range(4)])
    # the DeepNCM decoder accumulates prototype updates in every training forward pass; the probe's are undone
    assert not model.decoder.prototype_updates.any() and not model.decoder.prototype_update_counts.any()
