"""The cache: built once per content and reused, rebuilt for a changed source or another format version, a source
changed during a run refused by name, a failed build leaves nothing, two processes build once and read the same,
a split pickles as its path."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import flair
import pytest
from flair.datasets import ColumnCorpus

from flair_fabric.data import MappedCorpus, SourceChangedError, default_cache_folder, map_corpus
from flair_fabric.data import cache as cache_module
from flair_fabric.data import split as split_module
from flair_fabric.data import storage as storage_module
from flair_fabric.datasets import WNUT16_FILE, trec_corpus

from .reference import COLUMNS, describe_split, write

REPO = Path(__file__).resolve().parents[2]


def _open(folder: Path, cache: Path) -> MappedCorpus:
    return MappedCorpus.from_column_files(
        folder, {0: "text", 1: "pos", 2: "ner"}, sample_missing_splits=False, cache_folder=cache
    )


def _entries(cache: Path) -> list[str]:
    return sorted(path.name for path in cache.iterdir() if path.name != "locks")


def test_a_cache_is_built_once_and_reused_and_rebuilt_when_its_source_changes(tmp_path: Path) -> None:
    source = write(tmp_path / "src" / "train.txt", COLUMNS)
    first, second = _open(tmp_path / "src", tmp_path / "c"), _open(tmp_path / "src", tmp_path / "c")
    assert (first.built, second.built) == (True, False)
    assert first.cache_folder == second.cache_folder and len(_entries(tmp_path / "c")) == 1
    write(source, COLUMNS.replace("Tokyo", "Kyoto"))
    changed = _open(tmp_path / "src", tmp_path / "c")
    assert changed.built and changed.cache_folder != first.cache_folder
    assert "Kyoto" in changed.train[len(changed.train) - 1].to_original_text()


def test_the_key_holds_the_reading_options_and_flairs_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same files read with other options (one cache folder) are another entry, read as flair reads them with
    those options; another flair version builds anew."""
    write(tmp_path / "src" / "train.txt", COLUMNS)
    plain = _open(tmp_path / "src", tmp_path / "c")
    options = {"document_separator_token": "-DOCSTART-", "label_name_map": {"LOC": "place"}}
    other = MappedCorpus.from_column_files(
        tmp_path / "src",
        {0: "text", 1: "pos", 2: "ner"},
        sample_missing_splits=False,
        cache_folder=tmp_path / "c",
        **options,
    )
    assert other.built and other.cache_folder != plain.cache_folder
    reference = ColumnCorpus(tmp_path / "src", {0: "text", 1: "pos", 2: "ner"}, sample_missing_splits=False, **options)
    assert describe_split(other.train) == describe_split(reference.train)
    assert describe_split(_open(tmp_path / "src", tmp_path / "c").train) != describe_split(reference.train)
    monkeypatch.setattr(flair, "__version__", "0.0.0-another")
    assert _open(tmp_path / "src", tmp_path / "c").built


def test_a_source_that_changes_during_a_run_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write(tmp_path / "src" / "train.txt", COLUMNS)
    corpus = _open(tmp_path / "src", tmp_path / "c")
    corpus.train[0]
    os.utime(source, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(SourceChangedError, match=r"train\.txt changed"):
        corpus.train.check_sources()
    monkeypatch.setattr(split_module, "SOURCE_CHECK_INTERVAL", 0.0)
    with pytest.raises(SourceChangedError, match=r"train\.txt changed"):
        corpus.train[1]
    restored = pickle.loads(pickle.dumps(corpus.train))
    with pytest.raises(SourceChangedError, match=r"train\.txt changed"):
        restored[0]


def test_a_cache_of_another_format_version_is_rebuilt_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "src" / "train.txt", COLUMNS)
    corpus = _open(tmp_path / "src", tmp_path / "c")
    meta_file = corpus.cache_folder / "meta.json"
    meta = json.loads(meta_file.read_text())
    other = b"written by another version"  # with a complete record of it: only the format version tells
    (corpus.cache_folder / "train.arrow").write_bytes(other)
    meta["files"]["train.arrow"] = {"bytes": len(other), "sha256": hashlib.sha256(other).hexdigest()}
    body = {key: value for key, value in {**meta, "format_version": "0"}.items() if key != "checksum"}
    record = json.dumps(body, sort_keys=True).encode()
    meta_file.write_text(json.dumps({**body, "checksum": hashlib.sha256(record).hexdigest()}))
    reopened = _open(tmp_path / "src", tmp_path / "c")
    assert reopened.built and reopened.cache_folder == corpus.cache_folder
    assert describe_split(reopened.train) == describe_split(corpus.train)
    monkeypatch.setattr(cache_module, "FORMAT_VERSION", "999")
    assert _open(tmp_path / "src", tmp_path / "c").built


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk in the middle of writing a split: the error reaches the caller, no entry, no temporary folder."""
    write(tmp_path / "src" / "train.txt", COLUMNS * 600)
    write(tmp_path / "src" / "test.txt", COLUMNS)
    real, written = storage_module.encode, []

    def disk_fills(*args: object) -> object:
        written.append(1)
        if len(written) == 3 * storage_module.ROWS_PER_BATCH // 2:
            raise OSError(28, "No space left on device")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(storage_module, "encode", disk_fills)
    with pytest.raises(OSError, match="No space left"):
        _open(tmp_path / "src", tmp_path / "c")
    assert _entries(tmp_path / "c") == []
    monkeypatch.undo()
    assert _open(tmp_path / "src", tmp_path / "c").built


def test_the_default_cache_folder_is_the_environment_variable_or_the_home_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLAIR_FABRIC_CACHE", str(tmp_path / "mine"))
    assert default_cache_folder() == tmp_path / "mine"
    monkeypatch.delenv("FLAIR_FABRIC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_folder() == tmp_path / "home" / ".cache" / "flair_fabric" / "corpora"


def test_a_split_pickles_as_its_path_and_reopens(tmp_path: Path) -> None:
    corpus = map_corpus(trec_corpus(train_size=3000, dev_size=100, test_size=100), cache_folder=tmp_path / "c")
    payload = pickle.dumps(corpus.train)
    assert len(payload) < 2048, len(payload)
    restored = pickle.loads(payload)
    assert len(restored) == 3000
    assert describe_split(restored)[::500] == describe_split(corpus.train)[::500]


BUILD = """
import sys, time
from flair_fabric.data import MappedCorpus
from flair_fabric.data import storage
real = storage.write_split
def slow(*args, **kwargs):
    time.sleep(1.5)
    return real(*args, **kwargs)
storage.write_split = slow
import flair_fabric.data.builders as builders
builders.write_split = slow
corpus = MappedCorpus.from_column_files(sys.argv[1], {0: "text", 1: "ner"}, column_delimiter="\\t",
                                        sample_missing_splits=False, cache_folder=sys.argv[2])
print("BUILT" if corpus.built else "OPENED", len(corpus.train), corpus.train[7].to_tagged_string(), flush=True)
"""


@pytest.mark.multiprocess
def test_two_processes_building_the_same_cache_build_once_and_read_the_same(tmp_path: Path) -> None:
    folder = tmp_path / "src"
    write(folder / "train.txt", WNUT16_FILE.read_text(encoding="utf-8"))
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(folder), str(tmp_path / "c")],
            stdout=subprocess.PIPE,
            text=True,
            env=environment,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=240)[0].strip().splitlines()[-1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0]
    assert sorted(output.split(" ", 1)[0] for output in outputs) == ["BUILT", "OPENED"]
    assert outputs[0].split(" ", 1)[1] == outputs[1].split(" ", 1)[1]
    assert len(_entries(tmp_path / "c")) == 1
