"""What a rank holds of a mapped corpus: 2 spawned ranks each read their half of 50,000 linked tweets batch by batch.
The heap a rank gains for it (``Anonymous`` of /proc/self/smaps_rollup: its own memory, not the page cache's shared
copy of the mapped file) is compared with what flair's ColumnCorpus costs the same rank: measured in the rank on a
2,000-tweet corpus written the same way, per sentence, times the sentences of the big corpus (flair's heap grows
linearly with the sentences; building 50,000 in each rank would only cost the suite a minute)."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest

from flair_fabric.data import MappedCorpus
from flair_fabric.datasets import WNUT16_LABEL_TYPE
from flair_fabric.launch.config import make_launch_config

from ..launch.test_transport import LINKED_OPTIONS, write_linked_column_files
from ..support import run_on_ranks

SENTENCES = 50_000
SAMPLE = 2_000
COLUMNS = {0: "text", 1: WNUT16_LABEL_TYPE}


def _anonymous_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    raise LookupError("no Anonymous line in /proc/self/smaps_rollup")


def _measure(fabric: Any, argument: tuple[str, str, str, str]) -> None:
    from flair.datasets import ColumnCorpus

    folder, sample_folder, cache, out = argument
    gc.collect()
    start = _anonymous_kib()
    mapped = MappedCorpus.from_column_files(folder, COLUMNS, cache_folder=cache, **LINKED_OPTIONS)
    mine = range(fabric.global_rank, len(mapped.train), fabric.world_size)
    tokens = 0
    for first in range(0, len(mine), 32):
        batch = [mapped.train[index] for index in mine[first : first + 32]]
        tokens += sum(len(sentence) for sentence in batch)
    del batch
    gc.collect()  # flair's sentences are cycles (tokens <-> sentence): what is garbage now is not held
    mapped_kib = _anonymous_kib() - start
    sample = ColumnCorpus(sample_folder, COLUMNS, **LINKED_OPTIONS)
    gc.collect()
    sample_kib = _anonymous_kib() - start - mapped_kib
    sample_sentences = len(sample.train) + len(sample.dev) + len(sample.test)
    result = {
        "mapped": mapped_kib,
        "in_memory": sample_kib / sample_sentences * (len(mapped.train) + len(mapped.dev) + len(mapped.test)),
        "tokens": tokens,
        "sample_train": len(sample.train),
    }
    (Path(out) / f"rank{fabric.global_rank}.json").write_text(json.dumps(result), encoding="utf-8")


def _token_lines(path: Path) -> int:
    """The tokens of a column file, counted by its lines (a document separator is a sentence of one token)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return sum(1 for line in lines if line.strip() and not line.startswith(LINKED_OPTIONS["comment_symbol"]))


@pytest.mark.multiprocess
def test_a_rank_keeps_under_5_percent_of_the_heap_the_corpus_in_memory_costs_it(tmp_path: Path) -> None:
    """What a rank's heap keeps after reading its half batch by batch (the reading machinery and the allocator's
    retained pages) stays under 5% of what flair's corpus in memory costs a rank."""
    folder, sample_folder = tmp_path / "corpus", tmp_path / "sample"
    write_linked_column_files(folder, SENTENCES)
    write_linked_column_files(sample_folder, SAMPLE)
    MappedCorpus.from_column_files(folder, COLUMNS, cache_folder=tmp_path / "cache", **LINKED_OPTIONS)  # built once
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_spawn", precision=None)
    run_on_ranks(config, _measure, (str(folder), str(sample_folder), str(tmp_path / "cache"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]
    assert sum(rank["tokens"] for rank in ranks) == _token_lines(folder / "train.txt"), "the halves read every token"
    for rank in ranks:
        assert rank["sample_train"] == SAMPLE + SAMPLE // 50, "the tweets and one -DOCSTART- sentence per 50"
        assert rank["in_memory"] > 300 * 1024, "the reference: flair's corpus costs every rank its heap"
        assert rank["mapped"] < 0.05 * rank["in_memory"], rank
