"""Throughput at log points (docs/launching.md): tokens per second, real and padded, and the padding fraction of
the steps since the last log point, global across ranks; checked against counts made by hand on a tiny corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flair.trainers.plugins import MetricRecord, TrainerPlugin

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier

NAMES = ("tokens_per_second", "padded_tokens_per_second", "padding_fraction")


class _Throughput(TrainerPlugin):
    """On global rank 0: the three throughput records per step, written to ``<out>/throughput.json``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.records = out, {}

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        name = str(record.name).split("/")[-1]
        if name in NAMES:
            self.records.setdefault(record.global_step, {})[name] = float(record.value)

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.is_global_zero:
            (self.out / "throughput.json").write_text(json.dumps(self.records))


def _padded(lengths: list[int]) -> int:
    return len(lengths) * max(lengths) if lengths else 0


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "options"),
    [
        (2, {"balance_batches": False}),
        (1, {"mini_batch_chunk_size": 3}),
        (2, {"balance_batches": False, "mini_batch_chunk_size": 1}),
    ],
)
def test_the_padding_fraction_and_token_rates_are_the_counts_of_every_ranks_passes(
    tmp_path: Path, devices: int, options: dict[str, Any]
) -> None:
    """8 questions in order, global batch 4, a log point after each of the 2 steps. By hand: step k holds questions
    4k..4k+3; 2 ranks read strided shares of 2 (each pass padded to its longest), 1 process chunks of 3 and 1; with
    chunks of 1 nothing is padded."""
    corpus = small_trec(train_size=8)
    lengths = [len(sentence) for sentence in corpus.train]
    assert len(set(lengths)) > 2
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    run = {"max_epochs": 1, "global_batch_size": 4, "shuffle": False, "accelerator": "cpu", "strategy": "ddp_fork"}
    trainer.train(tmp_path, devices=devices, plugins=[_Throughput(tmp_path)], **run, **options)
    records = {int(step): values for step, values in json.loads((tmp_path / "throughput.json").read_text()).items()}
    assert sorted(records) == [1, 2]
    for step in (1, 2):
        points = lengths[4 * (step - 1) : 4 * step]
        chunk = options.get("mini_batch_chunk_size")
        if devices == 2:
            shares = [points[0::2], points[1::2]]
            passes = [share[i : i + (chunk or 2)] for share in shares for i in range(0, len(share), chunk or 2)]
        else:
            passes = [points[0:3], points[3:]]
        real, padded = sum(points), sum(_padded(each) for each in passes)
        values = records[step]
        assert values["padding_fraction"] == pytest.approx(1 - real / padded, abs=1e-12)
        assert values["tokens_per_second"] / values["padded_tokens_per_second"] == pytest.approx(real / padded)
        assert values["tokens_per_second"] > 0
    if options.get("mini_batch_chunk_size") == 1:
        assert all(values["padding_fraction"] == 0 for values in records.values())
    log = (tmp_path / "training.log").read_text()
    assert log.count(" - tokens/sec: ") == 2 and " - padding: " in log
