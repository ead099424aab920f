"""What a rank holds of a mapped corpus: 2 spawned ranks each read their half of 20,000 linked tweets batch by batch.
The heap a rank gains for it (``Anonymous`` of /proc/self/smaps_rollup: its own memory, not the page cache's shared
copy of the mapped file) is compared with what flair's ColumnCorpus of the same files costs the same rank."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest

from flair_fabric.data import MappedCorpus
from flair_fabric.datasets import WNUT16_LABEL_TYPE
from flair_fabric.launch.config import make_launch_config

from ..launch.test_transport import linked_column_corpus
from ..support import run_on_ranks

SENTENCES = 20_000
COLUMNS = {0: "text", 1: WNUT16_LABEL_TYPE}
OPTIONS: dict[str, Any] = {"column_delimiter": "\t", "comment_symbol": "# ", "document_separator_token": "-DOCSTART-"}


def _anonymous_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    raise LookupError("no Anonymous line in /proc/self/smaps_rollup")


def _measure(fabric: Any, argument: tuple[str, str, str]) -> None:
    from flair.datasets import ColumnCorpus

    folder, cache, out = argument
    gc.collect()
    start = _anonymous_kib()
    mapped = MappedCorpus.from_column_files(folder, COLUMNS, cache_folder=cache, sample_missing_splits=False, **OPTIONS)
    mine = range(fabric.global_rank, len(mapped.train), fabric.world_size)
    tokens = 0
    for first in range(0, len(mine), 32):
        batch = [mapped.train[index] for index in mine[first : first + 32]]
        tokens += sum(len(sentence) for sentence in batch)
    del batch
    gc.collect()  # flair's sentences are cycles (tokens <-> sentence): what is garbage now is not held
    mapped_kib = _anonymous_kib() - start
    in_memory = ColumnCorpus(folder, COLUMNS, sample_missing_splits=False, **OPTIONS)
    gc.collect()
    memory_kib = _anonymous_kib() - start - mapped_kib
    result = {
        "mapped": mapped_kib,
        "memory": memory_kib,
        "tokens": tokens,
        "sentences": len(in_memory.train),
    }
    (Path(out) / f"rank{fabric.global_rank}.json").write_text(json.dumps(result), encoding="utf-8")


@pytest.mark.multiprocess
def test_a_rank_keeps_under_10_percent_of_the_heap_the_corpus_in_memory_costs_it(tmp_path: Path) -> None:
    """What a rank's heap keeps after reading its half batch by batch (the reading machinery and the allocator's
    retained pages) stays under 10% of what flair's corpus in memory costs the same rank."""
    folder = tmp_path / "corpus"
    reference = linked_column_corpus(folder, SENTENCES)  # writes the files; flair's own reading of them
    expected_tokens = sum(len(sentence) for sentence in reference.train)
    del reference
    MappedCorpus.from_column_files(
        folder, COLUMNS, cache_folder=tmp_path / "cache", sample_missing_splits=False, **OPTIONS
    )  # built once, before the ranks start (they open it)
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_spawn", precision=None)
    run_on_ranks(config, _measure, (str(folder), str(tmp_path / "cache"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]
    assert sum(rank["tokens"] for rank in ranks) == expected_tokens, "the two halves read every data point"
    for rank in ranks:
        assert rank["sentences"] == SENTENCES + SENTENCES // 50
        assert rank["memory"] > 100 * 1024, "the reference: flair's corpus costs every rank its heap"
        assert rank["mapped"] < 0.10 * rank["memory"], rank
