"""Mapped corpora whose sources (or cache) lie in an S3 bucket (moto's server on loopback, reached through s3fs): read
as flair reads the same files from a local folder, built once and published beside the sources, downloaded by a
machine with another cache folder; bad URLs and a read-only bucket refused with one line; no credential written."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest
import s3fs
from flair.datasets import ClassificationCorpus, ColumnCorpus, CSVClassificationCorpus

from flair_fabric.data import DamagedCacheError, MappedCorpus, map_corpus
from flair_fabric.data.remote import STORE_FOLDER
from flair_fabric.storage import StorageError

from ..data.reference import COLUMN_FORMAT, COLUMNS, CSV, FASTTEXT, describe_split, write
from ..storage_server import BUCKET, KEY_ID, SECRET, S3Server
from ..support import REPO
from .read_only_server import READ_ONLY_BUCKET, read_only_bucket
from .test_bad_urls import _absent_package_scheme

OPEN = {"sample_missing_splits": False}
ROOT = "corpora"
"""This module's prefix in the session's bucket (other tests write theirs)."""


def _upload(folder: Path, prefix: str) -> str:
    """The files of ``folder`` put under ``s3://bucket/corpora/<prefix>/``; returns that URL."""
    fs = fsspec.filesystem("s3")
    for path in sorted(folder.iterdir()):
        fs.put_file(str(path), f"{BUCKET}/{ROOT}/{prefix}/{path.name}")
    return f"s3://{BUCKET}/{ROOT}/{prefix}"


def _column_sources(folder: Path, repeat: int = 1) -> Path:
    for name, text in (("train.txt", COLUMNS * repeat), ("dev.txt", COLUMNS[200:]), ("test.txt", COLUMNS[:400])):
        write(folder / name, text)
    return folder


def _published(prefix: str, options: dict | None = None) -> dict[str, bytes]:
    """Every object under ``prefix`` (relative name -> bytes)."""
    fs = fsspec.filesystem("s3", **(options or {}))
    fs.invalidate_cache()
    where = f"{BUCKET}/{ROOT}/{prefix}"
    return {name.removeprefix(f"{where}/"): fs.cat_file(name) for name in fs.find(where)}


def _entry_files(corpus: MappedCorpus) -> dict[str, bytes]:
    """The files of the corpus's node-local entry that a published entry holds too (not the local markers)."""
    folder = Path(corpus.cache_folder)
    local = ("used", "verified.json")
    return {f"{folder.name}/{path.name}": path.read_bytes() for path in folder.iterdir() if path.name not in local}


def _files_hold_no_secret(*folders: Path) -> None:
    for folder in folders:
        for path in folder.rglob("*"):
            assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_a_corpus_in_the_bucket_reads_as_flair_reads_its_files_is_published_once_and_downloaded_elsewhere(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = _Recorded()
    logging.getLogger("flair").addHandler(recorded)
    try:
        _published_once_and_downloaded_elsewhere(tmp_path, monkeypatch)
    finally:
        logging.getLogger("flair").removeHandler(recorded)
    assert any(f"Reading data from s3://{BUCKET}/{ROOT}/ner" in message for message in recorded.messages)
    assert not [message for message in recorded.messages if SECRET in message or KEY_ID in message]


def _published_once_and_downloaded_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _column_sources(tmp_path / "src")
    url = _upload(local, "ner")
    reference = ColumnCorpus(local, COLUMN_FORMAT)
    built = MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-a", **OPEN)
    assert (built.built, built.downloaded) == (True, False)
    for split in ("train", "dev", "test"):
        assert describe_split(getattr(built, split)) == describe_split(getattr(reference, split)), split
    published = _published(f"ner/{STORE_FOLDER}")
    entry = Path(built.cache_folder).name
    names = ["dev.arrow", "meta.json", "test.arrow", "train.arrow"]
    assert sorted(published) == [f"{entry}/{name}" for name in names], "the split files and meta.json, nothing else"
    assert _entry_files(built) == published
    elsewhere = MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-b", **OPEN)
    assert (elsewhere.built, elsewhere.downloaded) == (False, True)
    assert describe_split(elsewhere.train) == describe_split(reference.train)
    assert _entry_files(elsewhere) == published
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # the same credentials given explicitly: the same key, nothing new
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()
    options = {"key": KEY_ID, "secret": SECRET}
    again = MappedCorpus.from_column_files(
        url, COLUMN_FORMAT, cache_folder=tmp_path / "node-a", storage_options=options
    )
    assert (again.built, again.downloaded, again.cache_folder) == (False, False, built.cache_folder)
    fsspec.filesystem("s3", **options).pipe(f"{BUCKET}/{ROOT}/ner/train.txt", (COLUMNS * 2).encode())
    changed = MappedCorpus.from_column_files(
        url, COLUMN_FORMAT, cache_folder=tmp_path / "node-b", storage_options=options
    )
    write(tmp_path / "changed" / "train.txt", COLUMNS * 2)
    assert changed.built and describe_split(changed.train) == describe_split(
        ColumnCorpus(tmp_path / "changed", COLUMN_FORMAT, **OPEN).train
    )
    assert len({name.split("/")[0] for name in _published(f"ner/{STORE_FOLDER}", options)}) == 2
    _files_hold_no_secret(tmp_path)
    assert all(SECRET.encode() not in data for data in published.values())


def test_classification_and_csv_files_in_the_bucket_read_as_flair_reads_them(s3: S3Server, tmp_path: Path) -> None:
    write(tmp_path / "fasttext" / "train.txt", FASTTEXT)
    write(tmp_path / "csv" / "train.csv", CSV)
    mapped = MappedCorpus.from_classification_files(
        _upload(tmp_path / "fasttext", "fasttext"), label_type="topic", cache_folder=tmp_path / "cache", **OPEN
    )
    expected = ClassificationCorpus(tmp_path / "fasttext", label_type="topic", **OPEN)
    assert describe_split(mapped.train) == describe_split(expected.train) and len(mapped.train) > 3
    columns = {0: "text", 1: "label", 3: "pair"}
    mapped_pairs = MappedCorpus.from_csv(
        _upload(tmp_path / "csv", "csv"), columns, "label", skip_header=True, cache_folder=tmp_path / "cache", **OPEN
    )
    pairs = CSVClassificationCorpus(tmp_path / "csv", columns, "label", skip_header=True, **OPEN)
    assert describe_split(mapped_pairs.train) == describe_split(pairs.train) and len(pairs.train) == 4


def test_local_sources_with_a_cache_url_publish_there_and_another_machine_downloads(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = _column_sources(tmp_path / "src")
    monkeypatch.setenv("FLAIR_FABRIC_CACHE", str(tmp_path / "node-a"))
    built = MappedCorpus.from_column_files(
        local, COLUMN_FORMAT, cache_folder=f"s3://{BUCKET}/{ROOT}/shared-cache", **OPEN
    )
    assert built.built and Path(built.cache_folder).parent == tmp_path / "node-a"
    monkeypatch.setenv("FLAIR_FABRIC_CACHE", str(tmp_path / "node-b"))
    fetched = MappedCorpus.from_column_files(
        local, COLUMN_FORMAT, cache_folder=f"s3://{BUCKET}/{ROOT}/shared-cache", **OPEN
    )
    assert (fetched.built, fetched.downloaded) == (False, True)
    assert describe_split(fetched.train) == describe_split(ColumnCorpus(local, COLUMN_FORMAT).train)
    assert _published("shared-cache") == _entry_files(built) == _entry_files(fetched)


def _refused(data_folder: str, cache: Path, **options: object) -> str:
    with pytest.raises(StorageError) as refused:
        arguments = {"cache_folder": cache, **options}
        MappedCorpus.from_column_files(data_folder, COLUMN_FORMAT, **arguments)  # type: ignore[arg-type]
    message = str(refused.value)
    assert "\n" not in message and SECRET not in message and KEY_ID not in message, message
    return message


def test_bad_urls_are_one_line_naming_the_argument_and_the_fix_and_nothing_is_written(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    _upload(_column_sources(tmp_path / "src"), "bad")
    message = _refused("nosuch://bucket/ner", cache)
    assert message.startswith("data_folder='nosuch://bucket/ner': unknown URL scheme nosuch://; fsspec knows:")
    scheme, package = _absent_package_scheme()
    assert _refused(f"{scheme}://bucket/ner", cache) == (
        f"data_folder='{scheme}://bucket/ner': {scheme}:// needs {package}, which is not installed:"
        f" pip install {package}."
    )
    no_folder = "no such folder (nothing under it): pass the sources' URL."
    assert _refused("s3://no-such-bucket/ner", cache) == f"data_folder='s3://no-such-bucket/ner': {no_folder}"
    absent = f"s3://{BUCKET}/{ROOT}/absent"
    assert _refused(absent, cache) == f"data_folder='{absent}': {no_folder}"
    assert _refused(str(tmp_path / "src"), cache, cache_folder="s3://no-such-bucket/cache") == (
        "cache_folder='s3://no-such-bucket/cache': no-such-bucket does not exist (bucket or folder): create it first."
    )
    with pytest.raises(StorageError, match=r"^cache_folder='s3://bucket/cache': map_corpus keeps its cache on this"):
        map_corpus(ColumnCorpus(tmp_path / "src", COLUMN_FORMAT), cache_folder=f"s3://{BUCKET}/cache")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()
    assert _refused(f"s3://{BUCKET}/{ROOT}/bad", cache) == (
        f"data_folder='s3://{BUCKET}/{ROOT}/bad': no credentials found: set the provider's variables"
        " (AWS_ACCESS_KEY_ID, ...) or pass storage_options."
    )
    assert not cache.exists() or not [path for path in cache.iterdir() if path.name != "locks"]
    assert sorted(_published_with({"key": KEY_ID, "secret": SECRET}, "bad")) == ["dev.txt", "test.txt", "train.txt"]


def _published_with(options: dict, prefix: str) -> list[str]:
    fs = fsspec.filesystem("s3", **options)
    where = f"{BUCKET}/{ROOT}/{prefix}"
    return [name.removeprefix(f"{where}/") for name in fs.find(where)]


def test_a_read_only_bucket_fails_at_the_first_write_naming_the_place_and_the_fix_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    sources = {f"ner/{name}": text for name, text in (("train.txt", COLUMNS), ("dev.txt", COLUMNS[200:]))}
    with read_only_bucket(sources) as options:
        url = f"s3://{READ_ONLY_BUCKET}/ner"
        message = _refused(url, tmp_path / "cache", storage_options=options, **OPEN)
        assert message.startswith(f"data_folder='{url}': the corpus's cache entry cannot be published to {url}/")
        assert message.endswith("(access denied): pass cache_folder= a URL this job may write to")
        assert options["secret"] not in message and options["key"] not in message
        fs = s3fs.S3FileSystem(**options)
        assert sorted(fs.find(READ_ONLY_BUCKET)) == [f"{READ_ONLY_BUCKET}/{name}" for name in sorted(sources)]
        assert [path.name for path in (tmp_path / "cache").iterdir()] == ["locks"], "no entry, no temporary folder"


CHILD = """
import json, os, sys, time
from pathlib import Path
from flair_fabric.data import DamagedCacheError, MappedCorpus, map_corpus
from tests.data.reference import COLUMN_FORMAT, describe_split
ready = Path(sys.argv[1])
options = {"cache_folder": sys.argv[2], "sample_missing_splits": False}
MappedCorpus.from_column_files(sys.argv[4], COLUMN_FORMAT, **options)  # warm: the first open's costs paid
(ready / "child").touch()
while not (ready / "parent").exists():
    time.sleep(0.002)
corpus = MappedCorpus.from_column_files(sys.argv[3], COLUMN_FORMAT, **options)
found = {"built": corpus.built, "downloaded": corpus.downloaded, "folder": str(corpus.cache_folder)}
print(json.dumps({**found, "train": repr(describe_split(corpus.train))}))
"""


def _published_equals_entries(prefix: str, *folders: Path) -> None:
    """The one published entry under ``prefix`` is, byte for byte, each node-local entry (less its local marker)."""
    published = _published(prefix)
    assert len({name.split("/")[0] for name in published}) == 1
    for folder in folders:
        local = {f"{folder.name}/{path.name}": path.read_bytes() for path in folder.glob("*.*")}
        assert local.pop(f"{folder.name}/verified.json") and local == published


@pytest.mark.multiprocess
def test_two_jobs_building_the_same_corpus_at_once_both_build_and_publish_the_same_bytes(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs (a child process and this one, node rank 0, each with its own cache folder) open the same corpus
    from the bucket at the same moment: both build and upload, the last upload wins, and the published entry is the
    same bytes as each one's entry, read as flair reads the files."""
    for name in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    local = _column_sources(tmp_path / "src", repeat=40)
    url = _upload(local, "race")
    warm = _upload(_column_sources(tmp_path / "warm"), "warm")
    ready = tmp_path / "ready"
    ready.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ready), str(tmp_path / "job-a"), url, warm],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        MappedCorpus.from_column_files(warm, COLUMN_FORMAT, cache_folder=tmp_path / "job-b", **OPEN)
        deadline = time.monotonic() + 120
        while not (ready / "child").exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        (ready / "parent").touch()
        here = MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "job-b", **OPEN)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    there = json.loads(out.strip().splitlines()[-1])
    assert (there["built"], here.built) == (True, True), "both jobs built"
    expected = repr(describe_split(ColumnCorpus(local, COLUMN_FORMAT).train))
    assert there["train"] == expected == repr(describe_split(here.train))
    _published_equals_entries(f"race/{STORE_FOLDER}", Path(there["folder"]), Path(here.cache_folder))
    assert SECRET not in out + err
    _files_hold_no_secret(tmp_path)


class _Recorded(logging.Handler):
    """Keeps every message of flair's logger (which does not propagate to the root: caplog does not see it)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Waiting(logging.Handler):
    """Sets ``event`` when flair-fabric logs that it waits for the first node."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for the first node" in record.getMessage():
            self.event.set()


def test_a_process_of_another_node_builds_nothing_it_waits_for_the_first_node_and_downloads(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of node rank 1 (a job's second node) opens the corpus before anything is published: it waits; once
    the first node (node rank 0, another cache folder) has built and published the entry, it downloads it."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("FLAIR_FABRIC_CORPUS_WAIT", "60")
    local = _column_sources(tmp_path / "src")
    url = _upload(local, "nodes")
    waiting, opened = _Waiting(), []
    logging.getLogger("flair").addHandler(waiting)
    second = threading.Thread(
        target=lambda: opened.append(
            MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-1", **OPEN)
        )
    )
    try:
        second.start()
        deadline = time.monotonic() + 60
        while not waiting.event.wait(timeout=0.05) and second.is_alive() and time.monotonic() < deadline:
            pass
        assert waiting.event.is_set() and second.is_alive(), "the second node did not wait"
        assert not _published(f"nodes/{STORE_FOLDER}") and second.is_alive()
        monkeypatch.setenv("NODE_RANK", "0")
        first = MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-0", **OPEN)
        second.join(timeout=60)
    finally:
        logging.getLogger("flair").removeHandler(waiting)
    assert first.built and len(opened) == 1 and (opened[0].built, opened[0].downloaded) == (False, True)
    assert describe_split(opened[0].train) == describe_split(ColumnCorpus(local, COLUMN_FORMAT).train)
    _published_equals_entries(f"nodes/{STORE_FOLDER}", Path(first.cache_folder), Path(opened[0].cache_folder))


def test_a_published_file_that_differs_from_its_record_is_refused_never_read(s3: S3Server, tmp_path: Path) -> None:
    """A published split file with other bytes (same size) than its published record says: the download is refused
    with a DamagedCacheError naming the file in the store and the fix; no entry is left in the node-local cache."""
    url = _upload(_column_sources(tmp_path / "src"), "tampered")
    built = MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-a", **OPEN)
    entry = f"{BUCKET}/{ROOT}/tampered/{STORE_FOLDER}/{Path(built.cache_folder).name}"
    fs = fsspec.filesystem("s3")
    data = bytearray(fs.cat_file(f"{entry}/train.arrow"))
    data[200:216] = bytes(16)
    fs.pipe_file(f"{entry}/train.arrow", bytes(data))
    with pytest.raises(DamagedCacheError) as refused:
        MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-b", **OPEN)
    assert f"s3://{entry}/train.arrow is damaged" in str(refused.value)
    assert f"remove s3://{entry} from the store" in str(refused.value)
    assert [path.name for path in (tmp_path / "node-b").iterdir()] == ["locks"]


def test_file_and_memory_urls_work_as_a_bucket_and_meta_json_is_published_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any fsspec URL: sources under ``memory://`` read as flair reads them; a ``file://`` cache URL holds the
    published entry (its meta.json written after every split file) and another machine downloads it."""
    local = _column_sources(tmp_path / "src")
    memory = fsspec.filesystem("memory")
    for path in local.iterdir():
        memory.pipe_file(f"/{tmp_path.name}/{path.name}", path.read_bytes())
    from_memory = MappedCorpus.from_column_files(
        f"memory://{tmp_path.name}", COLUMN_FORMAT, cache_folder=tmp_path / "m"
    )
    assert describe_split(from_memory.dev) == describe_split(ColumnCorpus(local, COLUMN_FORMAT).dev)
    store = f"file://{tmp_path}/store"
    monkeypatch.setenv("FLAIR_FABRIC_CACHE", str(tmp_path / "node-a"))
    built = MappedCorpus.from_column_files(local, COLUMN_FORMAT, cache_folder=store, **OPEN)
    entry = tmp_path / "store" / Path(built.cache_folder).name
    times = {path.name: path.stat().st_mtime_ns for path in entry.iterdir()}
    assert sorted(times) == ["dev.arrow", "meta.json", "test.arrow", "train.arrow"]
    assert times["meta.json"] >= max(times.values()), "meta.json, the completion marker, is written last"
    monkeypatch.setenv("FLAIR_FABRIC_CACHE", str(tmp_path / "node-b"))
    fetched = MappedCorpus.from_column_files(local, COLUMN_FORMAT, cache_folder=store, **OPEN)
    assert (fetched.built, fetched.downloaded) == (False, True)
    assert _entry_files(fetched) == {f"{entry.name}/{path.name}": path.read_bytes() for path in entry.iterdir()}


def test_a_process_of_another_node_waits_at_most_the_wait_limit_then_names_the_entry_and_the_fix(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node rank 1 and nothing published, FLAIR_FABRIC_CORPUS_WAIT=1: a TimeoutError within seconds that names the
    entry's meta.json and the fix; nothing is left in the node-local cache."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("FLAIR_FABRIC_CORPUS_WAIT", "1")
    url = _upload(_column_sources(tmp_path / "src"), "alone")
    raised: list[TimeoutError] = []

    def open_alone() -> None:
        try:
            MappedCorpus.from_column_files(url, COLUMN_FORMAT, cache_folder=tmp_path / "node-1", **OPEN)
        except TimeoutError as error:  # the thread hands the error the test expects to it
            raised.append(error)

    waiting = threading.Thread(target=open_alone, daemon=True)
    waiting.start()
    waiting.join(timeout=20)
    assert not waiting.is_alive(), "still waiting 20 s after a limit of 1 s"
    assert len(raised) == 1, "no TimeoutError"
    message = str(raised[0])
    assert (
        message.startswith(f"waited 1 s for {url}/{STORE_FOLDER}/remote-") and "/meta.json, which a process" in message
    )
    assert message.endswith("open the same corpus there, or raise FLAIR_FABRIC_CORPUS_WAIT")
    assert [path.name for path in (tmp_path / "node-1").iterdir()] == ["locks"]
    assert not _published(f"alone/{STORE_FOLDER}")
