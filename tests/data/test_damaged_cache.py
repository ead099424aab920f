"""A damaged cache entry is never read: each file's size and checksum are recorded when the entry is complete and
compared when it is opened. With its sources at hand a damaged entry is rebuilt and reads as flair's reader reads the
sources; without them it is refused with an error naming the file and the fix. Every damaged entry is opened in a
fresh interpreter, so that a crash (a segmentation fault) fails the test by its exit code."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flair.datasets import ColumnCorpus

from flair_fabric.data import MappedCorpus, integrity, map_corpus
from flair_fabric.data import cache as cache_module
from flair_fabric.datasets import WNUT16_FILE, trec_corpus

from .damage import REOPEN, WITHOUT_SOURCES, cases
from .reference import describe_split, write

REPO = Path(__file__).resolve().parents[2]
SENTENCES = 500


def _source(folder: Path) -> Path:
    tweets = WNUT16_FILE.read_text(encoding="utf-8").strip().split("\n\n")[:SENTENCES]
    write(folder / "train.txt", "\n\n".join(tweets) + "\n")
    return folder


def _digest(split: object) -> str:
    return hashlib.sha256(repr(describe_split(split)).encode()).hexdigest()


def _run(script: str, *args: str) -> list[dict]:
    """The script's JSON lines; its exit code must be 0 (a segmentation fault is -11)."""
    environment = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    completed = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=environment
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, (
        f"the interpreter that opened the damaged entry ended with {completed.returncode}:\n{output[-4000:]}"
    )
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]


def test_a_damaged_entry_is_rebuilt_from_its_sources_never_read(tmp_path: Path) -> None:
    """Column files: truncated, 16 bytes overwritten at each of 19 offsets (one at a time and all at once, as the
    trial did), the end overwritten, the file missing, the record changed: each time the next open rebuilds the entry
    and reads flair's data. Every case damages an entry that an earlier open verified. A corpus in memory mapped
    again: the same for three of the cases."""
    source = _source(tmp_path / "src")
    reference = ColumnCorpus(source, {0: "text", 1: "ner"}, column_delimiter="\t", sample_missing_splits=False)
    corpus = MappedCorpus.from_column_files(
        source, {0: "text", 1: "ner"}, column_delimiter="\t", sample_missing_splits=False, cache_folder=tmp_path / "c"
    )
    assert corpus.built
    map_corpus(trec_corpus(300, 0, 0), cache_folder=tmp_path / "m")
    trial = cases("train.arrow")
    some = [case for case in trial if case["name"] in ("truncated", "overwrite-9-of-19", "missing")]
    jobs = [
        {"source": str(source), "cache": str(tmp_path / "c"), "cases": trial},
        {"source": "memory:300", "cache": str(tmp_path / "m"), "cases": some},
    ]
    seen = _run(REOPEN, json.dumps(jobs))
    expected = [(_digest(reference.train), trial), (_digest(trec_corpus(300, 0, 0).train), some)]
    assert seen == [{"case": case["name"], "built": True, "data": data} for data, each in expected for case in each]


def test_a_damaged_entry_without_its_sources_is_refused_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    """A split sent to another process (by its path) whose entry was damaged, the sources gone (the column files
    removed; a mapped corpus's data points are never at hand there): reading it raises DamagedCacheError."""
    source = _source(tmp_path / "src")
    columns = MappedCorpus.from_column_files(
        source, {0: "text", 1: "ner"}, column_delimiter="\t", sample_missing_splits=False, cache_folder=tmp_path / "c"
    )
    memory = map_corpus(trec_corpus(300, 0, 0), cache_folder=tmp_path / "c")
    splits = [columns.train, memory.train]
    (tmp_path / "splits").write_text("\n".join(pickle.dumps(split).hex() for split in splits))
    originals = {}
    for split in splits:
        for name in ("train.arrow", "meta.json"):
            original = Path(split.path).parent / name
            originals[str(original)] = str(shutil.copy(original, tmp_path / f"{original.parent.name}-{name}"))
    shutil.rmtree(source)
    trial = cases("train.arrow")
    seen = _run(WITHOUT_SOURCES, str(tmp_path / "splits"), json.dumps(originals), json.dumps(trial))
    assert len(seen) == 2 * len(trial)
    for case in seen:
        assert case["error"] is not None, f"{case['case']}: the damaged {case['file']} was read"
        assert f"the cache file {case['file']} is damaged" in case["error"], case
        assert "Open the corpus again from its sources" in case["error"], case
        assert f"remove {Path(case['file']).parent}" in case["error"], case


def test_an_entry_is_read_in_full_once_then_compared_by_size_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build computes the checksums; a later open (another process: nothing remembered) reads no file in full
    while every file keeps its size, time and inode; a write to a file makes the next open read the entry again."""
    source = _source(tmp_path / "src")
    read: list[str] = []
    real = integrity.file_checksum

    def counted(path: Path) -> str:
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(integrity, "file_checksum", counted)
    built = map_corpus(trec_corpus(300, 20, 20), cache_folder=tmp_path / "c")
    columns = MappedCorpus.from_column_files(
        source, {0: "text", 1: "ner"}, column_delimiter="\t", sample_missing_splits=False, cache_folder=tmp_path / "c"
    )
    assert sorted(read) == ["dev.arrow", "test.arrow", "train.arrow", "train.arrow"]
    time.sleep(0.05)  # past the clock tick of the markers
    (built.cache_folder / "verified.json").touch()
    (columns.cache_folder / "verified.json").touch()
    read.clear()
    cache_module._CHECKED.clear()
    again = map_corpus(trec_corpus(300, 20, 20), cache_folder=tmp_path / "c")
    pickle.loads(pickle.dumps(again.dev))[0]
    assert (again.built, read) == (False, [])
    train = built.cache_folder / "train.arrow"
    os.utime(train, ns=(time.time_ns(), time.time_ns()))
    cache_module._CHECKED.clear()
    assert map_corpus(trec_corpus(300, 20, 20), cache_folder=tmp_path / "c").built is False
    assert sorted(read) == ["dev.arrow", "test.arrow", "train.arrow"]
