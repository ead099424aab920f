"""What the integrity check of a mapped corpus's cache entry costs when the entry is opened:

    python benchmarks/cache_integrity.py [--sizes 200000,1000000] [--repeats 5] [--out benchmarks/results]

For each size, train/dev/test column files (tab-separated token and NER tag; ``size`` WNUT-16 tweets drawn with
replacement, dev and test 200 each, as ``mapped_corpus.py`` writes them) are written into a temporary folder and the
cache entry is built once (a fresh process, timed: ``build_s``, which includes computing the checksums). Then a fresh
process (nothing remembered from the build) measures, each the median of ``--repeats``:

- ``open_unchecked_ms``: ``MappedCorpus.from_column_files`` on the built entry and the first data point of each
  split, with the check switched off (the open as it was before the check: the source files hashed for the key,
  ``meta.json`` read, the three Arrow files memory-mapped);
- ``open_checked_ms``: the same with the check, where an earlier open verified the entry (the marker compared:
  the record's checksum and a ``stat`` of each file); ``marker_check_ms``: that comparison alone;
- ``first_open_ms``: the same without the marker (the first open on a machine): every file read in full (SHA-256);
  ``verify_ms``: that reading alone;
- ``..._cold_ms``: the unchecked open, the first open and the reading with the entry's files dropped from the page
  cache first (``posix_fadvise(DONTNEED)``: read from the disk);
- ``sha256_mb_s``, ``blake2b_mb_s``: each checksum over the train file, warm (why SHA-256: faster here, with SHA-NI).
Writes ``cache_integrity.json`` and ``cache_integrity.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPTIONS: dict[str, Any] = {"column_delimiter": "\t", "sample_missing_splits": False}


def _open(config: dict[str, Any]) -> Any:
    from flair_fabric.data import MappedCorpus

    corpus = MappedCorpus.from_column_files(
        config["folder"], {0: "text", 1: "ner"}, cache_folder=config["cache"], **OPTIONS
    )
    for split in (corpus.train, corpus.dev, corpus.test):
        split[0]
    return corpus


def run_build(config: dict[str, Any]) -> dict[str, Any]:
    """The cold build of the cache entry, timed."""
    started = time.perf_counter()
    corpus = _open(config)
    seconds = time.perf_counter() - started
    assert corpus.built, "the cache entry was expected to be new"
    folder = Path(corpus.cache_folder)
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    return {"build_s": seconds, "entry_mib": size / 2**20, "entry": str(folder)}


def _drop_from_page_cache(folder: Path) -> None:
    for path in folder.glob("*.arrow"):
        with open(path, "rb") as file:
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _throughput(name: str, path: Path) -> float:
    digest, block = hashlib.new(name), bytearray(1 << 20)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(block):
            digest.update(memoryview(block)[:count])
    return path.stat().st_size / 1e6 / (time.perf_counter() - started)


def run_measure(config: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Every timing of one entry, in this fresh process."""
    from flair_fabric.data import cache, integrity, split

    folder = Path(config["entry"])
    meta = cache.read_meta(folder)
    assert meta is not None

    def timed(prepare: Callable[[], None], action: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats):
            prepare()
            cache._CHECKED.clear()
            started = time.perf_counter()
            action()
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)

    def unchecked() -> None:
        real_trusted, real_checked = cache.trusted, split.checked_file
        cache.trusted, split.checked_file = (lambda *_: True), (lambda *_: None)  # type: ignore[assignment]
        try:
            _open(config)
        finally:
            cache.trusted, split.checked_file = real_trusted, real_checked  # type: ignore[assignment]

    def no_marker() -> None:
        (folder / integrity.MARKER).unlink(missing_ok=True)

    def cold_without_marker() -> None:
        no_marker()
        _drop_from_page_cache(folder)

    def nothing() -> None:
        return None

    _open(config)  # imports and first-use costs
    result = {
        "open_unchecked_ms": timed(nothing, unchecked),
        "open_checked_ms": timed(nothing, lambda: _open(config)),
        "marker_check_ms": timed(nothing, lambda: integrity.trusted(folder, cache.read_meta(folder) or {})),
        "first_open_ms": timed(no_marker, lambda: _open(config)),
        "verify_ms": timed(nothing, lambda: integrity.verify(folder, meta)),
        "open_unchecked_cold_ms": timed(lambda: _drop_from_page_cache(folder), unchecked),
        "first_open_cold_ms": timed(cold_without_marker, lambda: _open(config)),
        "verify_cold_ms": timed(lambda: _drop_from_page_cache(folder), lambda: integrity.verify(folder, meta)),
    }
    assert integrity.trusted(folder, meta), "the first open was expected to leave a marker"
    train = folder / "train.arrow"
    result["sha256_mb_s"] = statistics.median(_throughput("sha256", train) for _ in range(repeats))
    result["blake2b_mb_s"] = statistics.median(_throughput("blake2b", train) for _ in range(repeats))
    result["files_mib"] = sum(record["bytes"] for record in meta["files"].values()) / 2**20
    return result


def _child(arguments: list[str], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), *arguments]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_size(size: int, options: argparse.Namespace) -> dict[str, Any]:
    from mapped_corpus import write_corpus

    with tempfile.TemporaryDirectory(prefix="cache-integrity-") as temporary:
        root = Path(temporary)
        write_corpus(root / "data", size)
        config = {"folder": str(root / "data"), "cache": str(root / "cache")}
        (root / "config.json").write_text(json.dumps(config))
        build = _child(["--build", str(root / "config.json")], options.timeout)
        print(f"size {size:,}: build {build['build_s']:.1f} s, {build['entry_mib']:.0f} MiB", flush=True)
        (root / "config.json").write_text(json.dumps({**config, "entry": build["entry"]}))
        measured = _child(["--measure", str(root / "config.json"), "--repeats", str(options.repeats)], options.timeout)
        print(f"size {size:,}: {json.dumps({k: round(v, 1) for k, v in measured.items()})}", flush=True)
        source_mib = sum(path.stat().st_size for path in (root / "data").iterdir()) / 2**20
    return {"sentences": size, "source_mib": source_mib, **{k: v for k, v in build.items() if k != "entry"}, **measured}


def markdown(result: dict[str, Any]) -> str:
    setup = result["setup"]
    lines = [
        f"# Integrity check of a mapped corpus's cache entry ({setup['cpus']} CPUs, median of {setup['repeats']})",
        "",
        "| sentences | entry MiB | build s | open, no check ms | open, check by marker ms (marker alone) |"
        " first open: read in full ms (reading alone) | cold page cache: open no check / first open ms |"
        " SHA-256 / BLAKE2b MB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["sizes"]:
        lines.append(
            f"| {row['sentences']:,} | {row['files_mib']:.0f} | {row['build_s']:.1f} | {row['open_unchecked_ms']:.0f} |"
            f" {row['open_checked_ms']:.0f} ({row['marker_check_ms']:.2f}) |"
            f" {row['first_open_ms']:.0f} ({row['verify_ms']:.0f}) |"
            f" {row['open_unchecked_cold_ms']:.0f} / {row['first_open_cold_ms']:.0f} |"
            f" {row['sha256_mb_s']:.0f} / {row['blake2b_mb_s']:.0f} |"
        )
    lines += [
        "",
        "Every open hashes the source files for the cache key (SHA-256) and maps the three split files; the check by",
        "marker adds reading `verified.json` and one `stat` per file; the first open on a machine reads the entry in",
        f"full. Load average {setup['load_average_start']} at start, {setup['load_average_end']} at end.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="200000,1000000", help="training sentences (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per measurement (the median is kept)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.build:
        print(json.dumps(run_build(json.loads(options.build.read_text()))))
        return
    if options.measure:
        print(json.dumps(run_measure(json.loads(options.measure.read_text()), options.repeats)))
        return
    load = [round(value, 2) for value in os.getloadavg()]
    setup = {"cpus": os.cpu_count(), "repeats": options.repeats, "load_average_start": load}
    result: dict[str, Any] = {"setup": setup, "sizes": []}
    for text in options.sizes.split(","):
        result["sizes"].append(measure_size(int(text), options))
    setup["load_average_end"] = [round(value, 2) for value in os.getloadavg()]
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "cache_integrity.json").write_text(json.dumps(result, indent=2) + "\n")
    (options.out / "cache_integrity.md").write_text(markdown(result))
    print(f"wrote {options.out / 'cache_integrity'}.md")


if __name__ == "__main__":
    main()
