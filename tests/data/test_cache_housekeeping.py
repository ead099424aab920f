"""A cache folder's housekeeping: a build killed with SIGKILL leaves its temporary folder, which the next build of
that key removes; entries are listed with their sizes and last use and pruned by age (never one whose key a build
holds); a cache folder that cannot be written is named with the fix, also for root."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flair_fabric.data import CacheFolderError, MappedCorpus, map_corpus
from flair_fabric.data.command import main as cache_command
from flair_fabric.data.housekeeping import list_entries, prune
from flair_fabric.datasets import WNUT16_FILE, trec_corpus

from .reference import write

REPO = Path(__file__).resolve().parents[2]
DAY = 86400.0

# argv: the source folder, the cache folder; writes the train split's first rows, says so, then waits to be killed
KILLED_BUILD = r"""
import sys, time
import flair_fabric.data.builders as builders
from flair_fabric.data import MappedCorpus
real = builders.write_split
def stalls(path, data_points, kind=None):
    def first_rows():
        for number, point in enumerate(data_points):
            yield point
            if number == 2000:
                print("WRITING", path, flush=True)
                time.sleep(600)
    return real(path, first_rows(), kind)
builders.write_split = stalls
MappedCorpus.from_column_files(sys.argv[1], {0: "text", 1: "ner"}, column_delimiter="\t",
                               sample_missing_splits=False, cache_folder=sys.argv[2])
"""


# argv: the cache folder; converts a corpus in memory, says so in the middle, then waits to be killed
KILLED_CONVERSION = (
    KILLED_BUILD.split("MappedCorpus.from_column_files")[0]
    + """
from flair_fabric.data import map_corpus
from flair_fabric.datasets import trec_corpus
map_corpus(trec_corpus(3000, 10, 10), cache_folder=sys.argv[1])
"""
)


def _environment() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}


def _open(source: Path, cache: Path) -> MappedCorpus:
    return MappedCorpus.from_column_files(
        source, {0: "text", 1: "ner"}, column_delimiter="\t", sample_missing_splits=False, cache_folder=cache
    )


def _kill_a_build(source: Path | None, cache: Path) -> Path:
    """Start a build (of ``source``'s column files, or a ``map_corpus``) in another process, SIGKILL it while it
    writes; the temporary folder it leaves."""
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONVERSION, str(cache)]
        if source is None
        else [sys.executable, "-c", KILLED_BUILD, str(source), str(cache)],
        stdout=subprocess.PIPE,
        text=True,
        env=_environment(),
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        lines = iter(process.stdout.readline, "")  # flair logs to stdout too
        line = next((line for line in lines if line.startswith("WRITING")), "the build ended without writing")
        assert line.startswith("WRITING"), line
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    left = Path(line.split()[1]).parent
    assert left.name.startswith(".converting-" if source is None else ".") and left.is_dir()
    return left


def _bytes(folder: Path) -> int:
    return sum(os.path.getsize(path) for path in folder.rglob("*") if path.is_file())


def test_a_killed_builds_folder_is_removed_by_the_next_build_of_its_key(tmp_path: Path) -> None:
    """Column files: the next build of the key removes it; a killed map_corpus: the next map_corpus removes it."""
    source = tmp_path / "src"
    write(source / "train.txt", WNUT16_FILE.read_text(encoding="utf-8"))
    left = _kill_a_build(source, tmp_path / "c")
    assert [entry.path for entry in list_entries(tmp_path / "c")] == [left]
    assert list_entries(tmp_path / "c")[0].state == "left by a killed build"
    corpus = _open(source, tmp_path / "c")
    assert corpus.built and not left.exists()
    assert sorted(path.name for path in (tmp_path / "c").iterdir()) == sorted(["locks", corpus.cache_folder.name])
    converting = _kill_a_build(None, tmp_path / "c")
    assert {entry.path: entry.state for entry in list_entries(tmp_path / "c")}[converting] == "left by a killed build"
    mapped = map_corpus(trec_corpus(30, 5, 5), cache_folder=tmp_path / "c")
    assert mapped.built and not converting.exists()
    names = sorted(path.name for path in (tmp_path / "c").iterdir())
    assert names == sorted(["locks", corpus.cache_folder.name, mapped.cache_folder.name])


def test_entries_are_listed_with_sizes_and_last_use_and_pruned_by_age(tmp_path: Path) -> None:
    """Three entries: one used 40 days ago, one 40 days ago whose key a build holds, one now; a killed build's
    folder. prune(30 days) removes the first and the dead folder, keeps the others; list says their sizes."""
    cache = tmp_path / "c"
    sources = [write(tmp_path / f"s{i}" / "train.txt", f"word{i}\tO\nmore\tO\n\nnext\tB-X\n").parent for i in (0, 1)]
    old, held = (_open(source, cache).cache_folder for source in sources)
    recent = map_corpus(trec_corpus(200, 10, 10), cache_folder=cache).cache_folder
    left = _kill_a_build(write(tmp_path / "big" / "train.txt", WNUT16_FILE.read_text(encoding="utf-8")).parent, cache)
    then = time.time() - 40 * DAY
    for entry in (old, held):
        os.utime(entry / "used", (then, then))
    listed = {entry.path: entry for entry in list_entries(cache)}
    assert set(listed) == {old, held, recent, left}
    assert {path: entry.size for path, entry in listed.items()} == {path: _bytes(path) for path in listed}
    assert abs(listed[old].last_used - then) < 2 and abs(listed[recent].last_used - time.time()) < 60
    assert [listed[path].state for path in (old, recent, left)] == ["complete", "complete", "left by a killed build"]
    with open(cache / "locks" / f"{held.name}.lock", "a") as lock:  # as a build of that key holds it
        fcntl.flock(lock, fcntl.LOCK_EX)
        would_go, _ = prune(cache, 30, dry_run=True)
        assert {entry.path for entry in would_go} == {old, left} and old.exists() and left.exists()
        removed, kept = prune(cache, 30)
    assert {entry.path for entry in removed} == {old, left}
    assert [entry.path for entry in kept] == [held]
    assert not old.exists() and not left.exists() and held.exists() and recent.exists()
    assert _open(sources[1], cache).built is False  # opening it again records its use: not pruned next time
    assert prune(cache, 30) == ([], [])
    with pytest.raises(ValueError, match=r"older_than_days=-1: give a number of days"):
        prune(cache, -1)


def test_the_cache_command_lists_prunes_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "c"
    entry = map_corpus(trec_corpus(200, 10, 10), cache_folder=cache).cache_folder
    then = time.time() - 10 * DAY
    os.utime(entry / "used", (then, then))
    listed = subprocess.run(
        [sys.executable, "-m", "flair_fabric", "cache", "list", "--cache-folder", str(cache)],
        capture_output=True,
        text=True,
        timeout=240,
        env=_environment(),
        cwd=REPO,
    )
    assert listed.returncode == 0, listed.stderr
    assert f"{_bytes(entry) / 2**20:10.1f} MiB      10.0 days ago  complete" in listed.stdout, listed.stdout
    assert str(entry) in listed.stdout

    def command(*words: str) -> tuple[int, str]:
        code = cache_command([*words, "--cache-folder", str(cache)])
        return code, capsys.readouterr().out

    with open(entry / "dev.arrow", "r+b") as file:
        file.seek(100)
        file.write(b"\xff" * 16)
    code, output = command("verify")
    assert code == 1 and f"DAMAGED: dev.arrow: its checksum differs from the one recorded  {entry}" in output
    assert command("prune", "--older-than", "11") == (0, f"{cache}: removed 0 folder(s), 0.0 MiB\n")
    assert entry.exists()
    with pytest.raises(SystemExit) as refused:
        command("prune", "--older-than", "soon")
    assert refused.value.code == 2 and "'soon': give a number of days" in capsys.readouterr().err
    size = _bytes(entry)
    code, output = command("prune", "--older-than", "9")
    assert code == 0 and not entry.exists()
    assert output.strip().splitlines()[-1] == f"{cache}: removed 1 folder(s), {size / 2**20:.1f} MiB"


# argv: the source folder, the read-only empty cache folder, a read-only folder with a complete entry
READ_ONLY = r"""
import os, sys
from pathlib import Path
from flair_fabric.data import CacheFolderError, MappedCorpus, map_corpus
from flair_fabric.data.command import main as cache_command
from flair_fabric.datasets import trec_corpus
corpus = trec_corpus(50, 5, 5)
if os.geteuid() == 0:  # root writes anywhere: run as nobody
    os.setgid(65534)
    os.setuid(65534)
def columns(cache):
    return MappedCorpus.from_column_files(sys.argv[1], {0: "text", 1: "ner"}, column_delimiter="\t",
                                          sample_missing_splits=False, cache_folder=cache)
for attempt in (lambda: columns(sys.argv[2]), lambda: map_corpus(corpus, cache_folder=sys.argv[2]),
                lambda: columns(None)):
    try:
        attempt()
        print("OPENED")
    except CacheFolderError as error:
        print("REFUSED", error)
print("COMPLETE", columns(sys.argv[3]).built, columns(sys.argv[3]).train[0].to_tagged_string())
"""


def test_a_cache_folder_that_cannot_be_written_is_named_with_the_fix() -> None:
    """An empty read-only cache folder (as root: the check runs as the user nobody): from_column_files, map_corpus
    and $FLAIR_FABRIC_CACHE are refused naming the folder, cache_folder= and FLAIR_FABRIC_CACHE; so is a path under
    a file. A read-only cache
    folder whose entry is complete and intact still opens it (read in full: no marker of a verification)."""
    base = Path(tempfile.mkdtemp(prefix="flair-fabric-read-only-"))
    try:
        base.chmod(0o755)
        source = write(base / "src" / "train.txt", "Paris\tB-LOC\nis\tO\n\nnice\tO\n").parent
        empty, complete = base / "empty", base / "complete"
        empty.mkdir()
        opened = _open(source, complete)
        expected = opened.train[0].to_tagged_string()
        (opened.cache_folder / "verified.json").unlink()  # as where another machine built it: verified at the open
        for folder in (source, empty, complete, *complete.iterdir()):
            folder.chmod(0o555 if folder != source else 0o755)
        environment = {**_environment(), "FLAIR_FABRIC_CACHE": str(empty)}
        completed = subprocess.run(
            [sys.executable, "-c", READ_ONLY, str(source), str(empty), str(complete)],
            capture_output=True,
            text=True,
            timeout=240,
            env=environment,
            cwd=REPO,
        )
        lines = [line for line in completed.stdout.splitlines() if line.startswith(("REFUSED", "OPENED", "COMPLETE"))]
        assert completed.returncode == 0, completed.stderr[-3000:]
        message = (
            f"REFUSED the cache folder {empty} cannot be written (Permission denied): pass a writable folder as "
            "cache_folder=, or set FLAIR_FABRIC_CACHE to one"
        )
        assert lines == [message, message, message, f"COMPLETE False {expected}"], completed.stdout
        assert list(empty.iterdir()) == []
        assert issubclass(CacheFolderError, OSError)
        under_a_file = source / "train.txt" / "cache"
        with pytest.raises(CacheFolderError, match=rf"the cache folder {under_a_file} cannot be written \(Not a dir"):
            _open(source, under_a_file)
    finally:
        for folder in base.rglob("*"):
            folder.chmod(0o755) if folder.is_dir() else None
        subprocess.run(["rm", "-rf", str(base)], check=True)
