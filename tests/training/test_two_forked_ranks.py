"""One short run on two forked CPU ranks, checked against what flair and the docs say: flair's arguments keep their
meaning on several processes, the log's samples/second are global, the train sample is global rank 0's and evaluated
sharded, only global rank 0 logs, and the ranks talk over the loopback interface."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier

pytestmark = pytest.mark.multiprocess

IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PAUSE = 0.1  # seconds before every step: the log's times (2 decimals) are then long enough to check its rates


class _RankObserver(TrainerPlugin):
    """On every rank: its own random state (seeded by its rank before the run draws anything, as processes seeded
    by their rank or start time would have), a pause before each step, the texts of every batch of every epoch, its
    pid and the network variables it runs with."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.batches: dict[str, list[list[str]]] = {}

    def attach_to(self, pluggable: Any) -> None:
        super().attach_to(pluggable)
        random.seed(1000 + pluggable.global_rank)
        torch.manual_seed(1000 + pluggable.global_rank)

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        self.environment = {name: os.environ.get(name) for name in IFNAMES}

    @TrainerPlugin.hook
    def before_training_batch(self, **kw: Any) -> None:
        time.sleep(PAUSE)

    @TrainerPlugin.hook
    def after_training_batch(self, batch: list, epoch: int, **kw: Any) -> None:
        self.batches.setdefault(str(epoch), []).append([sentence.to_original_text() for sentence in batch])

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        seen = {"pid": os.getpid(), "environment": self.environment, "batches": self.batches}
        (self.out / f"seen-rank{self.trainer.global_rank}.json").write_text(json.dumps(seen))


class _RecordsByProcess(logging.Handler):
    """Appends (pid, message) of every record of the ``flair`` logger to a file, from whichever process logs it
    (forked ranks inherit the handler)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        with open(self.path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps([os.getpid(), record.getMessage()]) + "\n")


@pytest.fixture(scope="module")
def forked_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """flair's train_custom on 2 forked CPU ranks: shuffled, except the first epoch, with a monitored train sample."""
    out = tmp_path_factory.mktemp("forked")
    corpus = small_trec()  # 48 questions: 6 steps of 2 x 4 per epoch
    flair_log = logging.getLogger("flair")
    records = _RecordsByProcess(out / "records.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        for name in IFNAMES:
            patch.delenv(name, raising=False)
        flair_log.addHandler(records)
        try:
            FabricTrainer(tiny_text_classifier(corpus), corpus).train_custom(
                out / "run",
                max_epochs=2,
                mini_batch_size=4,
                learning_rate=0.1,
                shuffle=True,
                shuffle_first_epoch=False,
                monitor_train_sample=0.25,
                eval_batch_size=4,  # the 12 sampled questions in 3 batches, dealt to both ranks
                accelerator="cpu",
                devices=2,
                strategy="ddp_fork",
                plugins=[_RankObserver(out)],
            )
        finally:
            flair_log.removeHandler(records)
    lines = (out / "records.jsonl").read_text().splitlines()
    return {
        "corpus": corpus,
        "seen": [json.loads((out / f"seen-rank{rank}.json").read_text()) for rank in (0, 1)],
        "log": (out / "run" / "training.log").read_text(),
        "train_sample": (out / "run" / "train_sample.tsv").read_text(),
        "records": [tuple(json.loads(line)) for line in lines],
    }


def _steps(seen: list[dict], epoch: int) -> list[list[str]]:
    """The texts all ranks read at each step of ``epoch``."""
    return [first + second for first, second in zip(*(s["batches"][str(epoch)] for s in seen), strict=True)]


def test_shuffle_first_epoch_false_reads_the_first_epoch_in_order_on_two_ranks(forked_run: dict[str, Any]) -> None:
    """README: FabricTrainer keeps flair's arguments with flair's meaning. shuffle_first_epoch=False: the first
    epoch reads the train split in its order (flair's loader without shuffling), the later ones shuffled."""
    texts = [sentence.to_original_text() for sentence in forked_run["corpus"].train]
    start = 0
    for number, step in enumerate(_steps(forked_run["seen"], 1)):
        assert Counter(step) == Counter(texts[start : start + len(step)]), f"epoch 1, step {number}: not in order"
        start += len(step)
    assert start == len(texts)
    second = [text for step in _steps(forked_run["seen"], 2) for text in step]
    assert Counter(second) == Counter(texts) and second != texts, "the second epoch is shuffled (shuffle=True)"


_THROUGHPUT = re.compile(r"epoch (\d+) - iter (\d+)/\d+ - loss \S+ - time \(sec\): ([\d.]+) - samples/sec: ([\d.]+)")


def test_samples_per_second_in_the_log_count_every_ranks_data_points(forked_run: dict[str, Any]) -> None:
    """docs/launching.md: samples/second in the log are global: times the seconds logged, they give the data points
    all ranks read in the epoch so far (each rank reads half of them)."""
    lines = _THROUGHPUT.findall(forked_run["log"])
    assert len(lines) == 12, forked_run["log"][-3000:]
    for epoch, iteration, seconds, rate in lines:
        read = sum(len(step) for step in _steps(forked_run["seen"], int(epoch))[: int(iteration)])
        assert float(seconds) >= PAUSE
        assert float(rate) * float(seconds) == pytest.approx(read, rel=0.15), (epoch, iteration, seconds, rate, read)


def test_the_train_sample_is_global_rank_0s_and_evaluated_sharded(forked_run: dict[str, Any]) -> None:
    """docs/launching.md: evaluation of monitor_train_sample is sharded: the sample is drawn once, on global rank 0,
    so the ranks evaluate the same data although their random states differ; no rank 0-only fallback."""
    log = forked_run["log"]
    assert log.count("TRAIN_SAMPLE : loss") == 2, "the train sample is evaluated after each epoch"
    assert "evaluating on global rank 0 only" not in log
    # the questions evaluated are the ones flair's own draw gives from global rank 0's random state
    corpus = forked_run["corpus"]
    random.seed(1000)  # what _RankObserver seeded rank 0 with
    expected = [sentence.to_original_text() for sentence in ModelTrainer(None, corpus)._sample_train_split(0.25)]
    written = [block.splitlines()[0] for block in forked_run["train_sample"].split("\n\n") if block.strip()]
    assert written == expected


def test_only_global_rank_0_logs(forked_run: dict[str, Any]) -> None:
    """docs/notebooks.md: only global rank 0 logs; the flair logger stays silent in every other rank."""
    rank0, rank1 = (seen["pid"] for seen in forked_run["seen"])
    by_process = Counter(pid for pid, _ in forked_run["records"])
    assert by_process[rank0] > 0 and rank1 not in by_process, by_process
    assert {pid for pid in by_process} <= {rank0, os.getpid()}
    assert sum(message.startswith("EPOCH 1 done") for _, message in forked_run["records"]) == 1


def test_every_rank_talks_over_the_loopback_interface(forked_run: dict[str, Any]) -> None:
    """docs/security.md: the gloo / NCCL sockets of every rank use the loopback interface: GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME are the loopback interface's name in every rank (the user had set neither)."""
    if not Path("/sys/class/net").is_dir():
        pytest.skip("no /sys/class/net to read the network interfaces from")
    loopback = {entry.name for entry in Path("/sys/class/net").iterdir() if int((entry / "flags").read_text(), 16) & 8}
    for seen in forked_run["seen"]:
        assert all(seen["environment"][name] in loopback for name in IFNAMES), seen["environment"]
