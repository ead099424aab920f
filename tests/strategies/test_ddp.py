"""Two CPU processes (gloo): the script relaunch and torchrun paths, checked against one process."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import MetricHistoryPlugin, TrainerPlugin

from flair_fabric import FabricTrainer

from ..support import (
    GROUPED_BY_2,
    UNION,
    GroupedByLength,
    RunCrashed,
    make_tiny_bert,
    run_script,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
    write_config,
)

pytestmark = pytest.mark.multiprocess


def _weights(run_dir: Path, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(run_dir / f"weights-rank{rank}.pt")


def _summary(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"summary-rank{rank}.json").read_text())


def _epoch_lines(path: Path, marker: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if marker in line]


LOG_POINT = re.compile(r"epoch (\d+) - iter (\d+)/(\d+) - loss ([0-9.]+)")
"""flair's line at a log point: epoch, iter i/n and the epoch's train loss so far."""


@pytest.fixture(scope="module")
def flair_on_the_union(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[float], Path]:
    """The reference: flair's own ModelTrainer in one process, on the union of the two ranks' batches (batches of
    2 x 4), with the same arguments: its weights, its train losses and its training.log."""
    out = tmp_path_factory.mktemp("flair-on-the-union")
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    result = ModelTrainer(model, corpus).train_custom(out, **UNION, mini_batch_size=8, plugins=[MetricHistoryPlugin()])
    return model.state_dict(), result["train_loss_history"], out / "training.log"


def test_two_ranks_equal_one_process_on_the_union_of_their_batches(
    two_rank_runs: Path, flair_on_the_union: tuple[dict[str, torch.Tensor], list[float], Path]
) -> None:
    """docs/ddp-communication.md: with the exact defaults 2 ranks end within 1e-5 of flair's one-process training on
    the union of their batches (dealt by length, strided, chunked). docs/launching.md: the train loss, at each log
    point and at each epoch's end, is the sample-weighted mean over every rank's data points, as flair's one process
    computes it over the same points."""
    reference_weights, reference_losses, reference_log = flair_on_the_union
    flairs_log_points = LOG_POINT.findall(reference_log.read_text())
    assert len(flairs_log_points) == 3 * 6, "flair logs every step of its 3 epochs of 6 steps"
    for name in ("union", "union_chunked", "strided"):
        weights = _weights(two_rank_runs / name, 0)
        assert state_dict_difference(weights["initial"], weights["final"]) > 1e-3, "the model must have trained"
        assert state_dict_difference(weights["final"], reference_weights) <= 1e-5, name
        # the logged train loss is the global, sample-weighted mean: equal to one process seeing all data
        losses = _summary(two_rank_runs / name, 0)["result"]["train_loss_history"]
        for expected, actual in zip(reference_losses, losses, strict=True):
            assert math.isclose(expected, actual, rel_tol=1e-5), (name, expected, actual)
        log_points = LOG_POINT.findall((two_rank_runs / name / "training.log").read_text())
        assert [point[:3] for point in log_points] == [point[:3] for point in flairs_log_points], name
        for (epoch, step, _, expected), (*_, actual) in zip(flairs_log_points, log_points, strict=True):
            assert math.isclose(float(expected), float(actual), rel_tol=1e-5), (name, epoch, step, expected, actual)
        # and training.log's "EPOCH n done: loss X" line shows that global loss (4 decimals), not rank 0's own
        logged = re.findall(r"EPOCH (\d+) done: loss ([0-9.]+)", (two_rank_runs / name / "training.log").read_text())
        assert logged == [(str(epoch), f"{loss:.4f}") for epoch, loss in enumerate(losses, start=1)], name


def test_shuffled_two_ranks_equal_flairs_one_process_shuffling_with_the_double_batch(two_rank_runs: Path) -> None:
    """docs/launching.md: with shuffling on, 2 ranks with global_batch_size=8 (4 each, started by the script
    relaunch) read, step by step, the batches flair's one process draws with batch 8 from the same random state, and
    end at its weights (within 1e-6)."""
    out = two_rank_runs / "flair-shuffled"
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    reference = ModelTrainer(model, corpus).train_custom(
        out, **{**UNION, "shuffle": True}, mini_batch_size=8, plugins=[MetricHistoryPlugin()]
    )
    weights = _weights(two_rank_runs / "union_shuffled", 0)
    assert state_dict_difference(weights["initial"], weights["final"]) > 1e-3, "the model must have trained"
    assert state_dict_difference(weights["final"], model.state_dict()) <= 1e-6
    losses = _summary(two_rank_runs / "union_shuffled", 0)["result"]["train_loss_history"]
    assert losses == pytest.approx(reference["train_loss_history"], rel=1e-6)
    in_order = _weights(two_rank_runs / "union", 0)["final"]
    assert state_dict_difference(in_order, weights["final"]) > 1e-4, "shuffling changed the run"


def test_grouped_two_ranks_equal_flairs_one_process_reading_the_grouped_order(two_rank_runs: Path) -> None:
    """docs/launching.md: group_by_length on 2 ranks started by the script relaunch (global batch 8, windows of 2
    batches) ends at the weights of flair's one process with batch 8 reading the documented grouped order through a
    sampler, from the same random state (within 1e-6)."""
    out = two_rank_runs / "flair-grouped"
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    sampler = GroupedByLength(8, GROUPED_BY_2["group_by_length_window"])
    ModelTrainer(model, corpus).train_custom(out, **{**UNION, "shuffle": True}, mini_batch_size=8, sampler=sampler)
    weights = _weights(two_rank_runs / "union_grouped", 0)
    assert state_dict_difference(weights["final"], model.state_dict()) <= 1e-6
    shuffled = _weights(two_rank_runs / "union_shuffled", 0)["final"]
    assert state_dict_difference(shuffled, weights["final"]) > 1e-4, "grouping changed the run"


def test_balanced_steps_hold_the_strided_steps_data_and_pad_the_slowest_rank_less(two_rank_runs: Path) -> None:
    """balance_batches (the default) against strided shards: every step trains the same questions, the slowest
    rank's padded batch (questions x longest) is smaller, and the result is the same up to the order of additions."""
    balanced = [_summary(two_rank_runs / "union", rank)["batches"] for rank in (0, 1)]
    strided = [_summary(two_rank_runs / "strided", rank)["batches"] for rank in (0, 1)]
    assert len(balanced[0]) == len(balanced[1]) == len(strided[0]) == len(strided[1]) > 0

    def padded(batch: list[list]) -> int:
        return len(batch) * max(length for _, length in batch)

    slowest_balanced = slowest_strided = 0
    for step in range(len(strided[0])):
        assert sorted(map(tuple, balanced[0][step] + balanced[1][step])) == sorted(
            map(tuple, strided[0][step] + strided[1][step])
        ), step
        slowest = max(padded(balanced[r][step]) for r in (0, 1))
        assert slowest <= max(padded(strided[r][step]) for r in (0, 1)), step
        slowest_balanced += slowest
        slowest_strided += max(padded(strided[r][step]) for r in (0, 1))
    assert slowest_balanced < 0.9 * slowest_strided, (slowest_balanced, slowest_strided)
    # balance_batches=False: strided shards of equal size, rank r reading the epoch's order[r::2] in batches of 4
    train = list(small_trec().train)  # the runs' corpus; shuffle=False: every epoch reads it in this order
    for rank in (0, 1):
        shard = [[sentence.to_original_text(), len(sentence)] for sentence in train[rank::2]]
        expected = [shard[start : start + 4] for start in range(0, len(shard), 4)] * UNION["max_epochs"]
        assert strided[rank] == expected, f"rank {rank}"
    final = {name: _weights(two_rank_runs / name, 0)["final"] for name in ("union", "strided")}
    assert state_dict_difference(final["union"], final["strided"]) <= 1e-6


def test_all_ranks_end_with_the_same_weights_and_results(two_rank_runs: Path) -> None:
    for name in ("union", "union_chunked", "defaults"):
        rank0, rank1 = _weights(two_rank_runs / name, 0), _weights(two_rank_runs / name, 1)
        assert state_dict_difference(rank0["final"], rank1["final"]) == 0.0, name
        summary0, summary1 = _summary(two_rank_runs / name, 0), _summary(two_rank_runs / name, 1)
        assert summary0["result"] == summary1["result"], "every rank returns rank 0's values"
        assert summary0["lr_trace"] == summary1["lr_trace"]
        assert (summary0["world_size"], summary1["world_size"]) == (2, 2)
        # the script's model (rank 0 is the user's process under the relaunch) is left as flair's trainer leaves it
        assert summary0["training"] is False and summary0["model_card"] is not None, name
    # including what a plugin added on global rank 0 only
    assert _summary(two_rank_runs / "defaults", 1)["result"].get("added_on_rank_zero") == 1.0


def test_a_one_machine_run_listens_on_loopback_only(two_rank_runs: Path) -> None:
    """The rendezvous store and gloo's sockets of the relaunched job: nothing another host could connect to."""
    listening = json.loads((two_rank_runs / "defaults" / "listening.json").read_text())
    assert listening, "rank 0 hosts the rendezvous store"
    assert all(address.startswith(("127.0.0.1:", "::1:")) for _, address in listening), listening


def test_logs_and_models_are_written_once(two_rank_runs: Path) -> None:
    run_dir = two_rank_runs / "defaults"
    loss_rows = (run_dir / "loss.tsv").read_text().splitlines()
    assert loss_rows[0].startswith("EPOCH")
    assert [row.split("\t")[0] for row in loss_rows[1:]] == ["1", "2", "3"]
    assert len(_epoch_lines(run_dir / "training.log", "done: loss")) == 3
    assert len(_epoch_lines(run_dir / "training.log", "DEV : loss")) == 3
    log_text = (run_dir / "training.log").read_text()
    assert 'global batch size: "8" (2 process(es))' in log_text
    assert 'balance_batches: "True" (each step\'s data points dealt by length)' in log_text
    assert not list(run_dir.glob(".*.tmp")), "no temporary model files are left behind"
    # best model chosen on dev and loaded on every rank at the end; the file loads with flair's own loader
    best = TextClassifier.load(run_dir / "best-model.pt")
    assert state_dict_difference(best.state_dict(), _weights(run_dir, 1)["final"]) == 0.0
    assert (run_dir / "final-model.pt").exists()


def test_torchrun_launched_script_trains_unchanged(
    tmp_path: Path, flair_on_the_union: tuple[dict[str, torch.Tensor], list[float], Path]
) -> None:
    runs = [{"name": "torchrun", "method": "train_custom", "kwargs": {**UNION, "mini_batch_size": 4, "devices": 2}}]
    config = write_config(tmp_path / "config.json", {"out": str(tmp_path), "runs": runs})
    torchrun = shutil.which("torchrun", path=str(Path(flair.__file__).parents[4] / "bin"))
    if torchrun is None:
        raise RunCrashed("torchrun is not installed beside flair")
    run_script("ddp_runs.py", str(config), launcher=[torchrun, "--standalone", "--nproc_per_node=2"])
    summaries = [_summary(tmp_path / "torchrun", rank) for rank in (0, 1)]
    assert all(summary["torchelastic"] for summary in summaries), "both ranks were started by torchrun"
    assert sorted(summary["local_rank"] for summary in summaries) == [0, 1]
    reference_weights, _, _ = flair_on_the_union
    assert state_dict_difference(_weights(tmp_path / "torchrun", 1)["final"], reference_weights) <= 1e-5


def test_transformer_classifier_fine_tunes_on_two_ranks_in_bf16(tmp_path: Path) -> None:
    corpus_size = {"train_size": 50}
    bert_dir = make_tiny_bert(tmp_path / "bert", small_trec(**corpus_size))
    kwargs = {"max_epochs": 2, "mini_batch_size": 4, "learning_rate": 5e-3, "devices": 2, "precision": "bf16-mixed"}
    runs = [{"name": "bert", "model": "bert", "method": "fine_tune", "kwargs": kwargs}]
    config = {"out": str(tmp_path), "bert_dir": str(bert_dir), "corpus": corpus_size, "runs": runs}
    run_script("ddp_runs.py", str(write_config(tmp_path / "config.json", config)))

    run_dir = tmp_path / "bert"
    rank0, rank1 = _weights(run_dir, 0), _weights(run_dir, 1)
    assert state_dict_difference(rank0["initial"], rank0["final"]) > 1e-4, "the transformer must have trained"
    assert state_dict_difference(rank0["final"], rank1["final"]) == 0.0
    log = (run_dir / "training.log").read_text()
    assert "find_unused_parameters=True" in log, "the BERT pooler gets no gradient: DDP must search for it"
    assert "precision: bf16-mixed" in log
    # The linear schedule is sized to the steps each rank really runs: 50 questions over 2 ranks are shards of 25,
    # 7 batches of 4 per epoch, 14 steps in all, 1 of them warm-up. The trace holds the rate each step used: the
    # last one used 1/13 of the peak, so the schedule reaches 0 exactly after it. (flair's own formula,
    # int((50 + 3) / 4 / 2 * 2) = 13 steps, would have trained the last step with a learning rate of 0.)
    trace = _summary(run_dir, 0)["lr_trace"]
    assert len(trace) == 14 and trace[0] == 0.0 and trace[1] == pytest.approx(5e-3)
    assert trace[-1] == pytest.approx(5e-3 / 13)
    loaded = TextClassifier.load(run_dir / "final-model.pt")
    sentence = flair.data.Sentence("What is the capital of France ?")
    loaded.predict(sentence)
    assert sentence.get_label("question_class").value in loaded.label_dictionary.get_items()


class _OwnRandomStatePerRank(TrainerPlugin):
    """Gives every rank its own random number generators before the run draws anything (as processes seeded by
    their rank, or by the time they started, would have), and records the texts of every batch of every epoch."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.seen = out, {}

    def attach_to(self, pluggable: Any) -> None:
        super().attach_to(pluggable)
        rank = pluggable.global_rank
        torch.manual_seed(1000 + rank)
        random.seed(1000 + rank)

    @TrainerPlugin.hook
    def after_training_batch(self, batch: list, epoch: int, **kw: Any) -> None:
        self.seen.setdefault(epoch, []).extend(sentence.to_original_text() for sentence in batch)

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        (self.out / f"seen-rank{self.trainer.global_rank}.json").write_text(json.dumps(self.seen))


def _recording_samples(draw: Any, out: Path) -> Any:
    """``FabricTrainer._sample_train_split`` that writes, per rank, flair's own draw from this rank's random state and
    the sample the run uses to ``<out>/sample-rank<r>.json``."""

    def recording(trainer: FabricTrainer, monitor_train_sample: float) -> Any:
        state = random.getstate()
        own = list(ModelTrainer._sample_train_split(trainer, monitor_train_sample).indices)
        random.setstate(state)
        sample = draw(trainer, monitor_train_sample)
        rank = trainer.global_rank
        (out / f"sample-rank{rank}.json").write_text(json.dumps({"own": own, "used": list(sample.indices)}))
        return sample

    return recording


def test_ranks_with_different_random_states_still_read_every_data_point_once_per_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = small_trec(train_size=49)  # an uneven split: one rank has a point more
    monkeypatch.setattr(  # the forked ranks inherit it
        FabricTrainer, "_sample_train_split", _recording_samples(FabricTrainer._sample_train_split, tmp_path)
    )
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=2,
        mini_batch_size=4,
        shuffle=True,
        monitor_train_sample=0.25,
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        plugins=[_OwnRandomStatePerRank(tmp_path)],
    )
    seen = [json.loads((tmp_path / f"seen-rank{rank}.json").read_text()) for rank in (0, 1)]
    every_text = Counter(sentence.to_original_text() for sentence in corpus.train)
    for epoch in ("1", "2"):
        assert Counter(seen[0][epoch]) + Counter(seen[1][epoch]) == every_text, f"epoch {epoch}"
    assert seen[0]["1"] != seen[0]["2"], "the order is shuffled anew each epoch"
    # monitor_train_sample: flair's draw on rank 0, on both ranks (their own draws differ), so the sample's sharded
    # evaluation needs no fallback to rank 0
    samples = [json.loads((tmp_path / f"sample-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert samples[0]["own"] != samples[1]["own"], "the ranks' random states differ, so flair's draws differ"
    assert samples[0]["used"] == samples[1]["used"] == samples[0]["own"]
    assert "evaluated other data than global rank 0" not in (tmp_path / "training.log").read_text()
