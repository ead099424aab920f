"""What ``ddp_spawn`` pays to hand an in-memory flair corpus to its workers, one invocation:

    python benchmarks/spawn_hand_off.py [--sizes 5000,20000,50000] [--out benchmarks/results]

For each size, a flair ``ColumnCorpus`` of that many linked training sentences (WNUT-16 tweets repeated, documents of
50, the corpus of ``tests/launch/test_transport.py``) is read by flair, then sent as ``ddp_spawn`` sends it
(``flair_fabric.launch.transport``: ``dumps`` in the caller, ``loads`` in each worker), each size in a fresh process.
Measured: flair's reading time and the corpus's heap (resident memory before and after reading), the payload's size,
the seconds of ``dumps`` and of ``loads``, and the resident memory ``loads`` adds (what every spawned worker pays once
more). Plain pickling is tried too (it fails with a RecursionError on a linked corpus). Writes
``spawn_hand_off.json`` and ``spawn_hand_off.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _resident_mib() -> float:
    """This process's resident memory (VmRSS of /proc/self/status)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def measure(size: int) -> dict[str, Any]:
    """One size, in this process."""
    sys.path.insert(0, str(REPO))
    from flair_fabric.launch import transport
    from tests.launch.test_transport import linked_column_corpus

    with tempfile.TemporaryDirectory() as folder:
        before = _resident_mib()
        started = time.perf_counter()
        corpus = linked_column_corpus(Path(folder), size)
        read_seconds = time.perf_counter() - started
        corpus_mib = _resident_mib() - before
        try:
            pickle.dumps(corpus)
            plain = "pickled"
        except RecursionError:
            plain = "RecursionError"
        started = time.perf_counter()
        payload = transport.dumps(corpus)
        dumps_seconds = time.perf_counter() - started
        before_loads = _resident_mib()
        started = time.perf_counter()
        crossed = transport.loads(payload)
        loads_seconds = time.perf_counter() - started
        loads_mib = _resident_mib() - before_loads
        assert len(crossed.train) == len(corpus.train)
    return {
        "sentences": size,
        "read_seconds": round(read_seconds, 2),
        "corpus_mib": round(corpus_mib),
        "plain_pickle": plain,
        "payload_mib": round(len(payload) / 2**20, 1),
        "dumps_seconds": round(dumps_seconds, 2),
        "loads_seconds": round(loads_seconds, 2),
        "loads_mib": round(loads_mib),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# What ddp_spawn pays to hand an in-memory corpus to its workers",
        "",
        "`benchmarks/spawn_hand_off.py`: a linked flair `ColumnCorpus` (WNUT-16 tweets, documents of 50), sent as",
        "`ddp_spawn` sends it. The caller pays `dumps` once; every worker pays `loads` and holds its own copy.",
        "",
        "| sentences | flair reads | corpus in memory | plain pickle | payload | dumps | loads (each worker) |"
        " memory loads adds (each worker) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['sentences']:,} | {row['read_seconds']} s | {row['corpus_mib']} MiB | {row['plain_pickle']} |"
            f" {row['payload_mib']} MiB | {row['dumps_seconds']} s | {row['loads_seconds']} s |"
            f" {row['loads_mib']} MiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="5000,20000,50000")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a worker: measure this size, print JSON
    options = parser.parse_args()
    if options.one:
        print(json.dumps(measure(options.one)))
        return
    rows = []
    for size in (int(text) for text in options.sizes.split(",")):
        completed = subprocess.run(
            [sys.executable, __file__, "--one", str(size)], capture_output=True, text=True, check=True, cwd=REPO
        )
        rows.append(json.loads(completed.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "spawn_hand_off.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    (options.out / "spawn_hand_off.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
