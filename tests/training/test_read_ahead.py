"""The read-ahead of :mod:`flair_fabric.training.read_ahead`: the next batch is built while the caller works on the
current one, in order, in one background thread; a build's error is raised where its batch is read; a read left
early leaves no thread behind and builds at most one batch ahead."""

from __future__ import annotations

import threading

import pytest

from flair_fabric.training.read_ahead import THREAD_NAME, read_ahead, stop_reading

INDEX_BATCHES = [[0, 1], [2, 3], [4, 5], [6]]


def _read_ahead_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(THREAD_NAME)]


def test_batches_come_in_order_built_in_one_background_thread() -> None:
    threads: list[str] = []

    def build(indices: list[int]) -> list[str]:
        threads.append(threading.current_thread().name)
        return [f"point {index}" for index in indices]

    batches = list(read_ahead(build, INDEX_BATCHES))
    assert batches == [[f"point {index}" for index in indices] for indices in INDEX_BATCHES]
    assert len(threads) == 4 and {name.rsplit("_", 1)[0] for name in threads} == {THREAD_NAME}
    assert len(set(threads)) == 1, "one thread"
    assert _read_ahead_threads() == []


def test_the_next_batch_is_built_while_the_caller_holds_the_current_one() -> None:
    """The caller keeps batch 1 and waits, without asking for batch 2: batch 2 gets built all the same."""
    built = {number: threading.Event() for number in range(len(INDEX_BATCHES))}

    def build(indices: list[int]) -> list[int]:
        built[INDEX_BATCHES.index(indices)].set()
        return indices

    batches = read_ahead(build, INDEX_BATCHES)
    assert next(batches) == INDEX_BATCHES[0]
    assert built[1].wait(timeout=30), "batch 2 was not built while the caller worked on batch 1"
    assert not built[2].is_set(), "one batch ahead, not more"
    assert list(batches) == INDEX_BATCHES[1:]


def test_the_index_batches_are_drawn_in_the_callers_thread() -> None:
    """A sampler's random draws happen where flair's loader makes them, not in the background thread."""
    drawn_in: list[str] = []

    def index_batches():  # type: ignore[no-untyped-def]
        for indices in INDEX_BATCHES:
            drawn_in.append(threading.current_thread().name)
            yield indices

    assert list(read_ahead(list, index_batches())) == INDEX_BATCHES
    assert set(drawn_in) == {threading.current_thread().name}


def test_an_error_while_building_a_batch_is_raised_where_that_batch_is_read() -> None:
    def build(indices: list[int]) -> list[int]:
        if indices == INDEX_BATCHES[2]:
            raise FileNotFoundError("a source file went away")
        return indices

    batches = read_ahead(build, INDEX_BATCHES)
    assert [next(batches), next(batches)] == INDEX_BATCHES[:2]
    with pytest.raises(FileNotFoundError, match="a source file went away"):
        next(batches)
    assert _read_ahead_threads() == []


def test_a_read_left_early_ends_its_thread_and_builds_no_further() -> None:
    requested: list[list[int]] = []

    def build(indices: list[int]) -> list[int]:
        requested.append(indices)
        return indices

    batches = read_ahead(build, INDEX_BATCHES)
    assert next(batches) == INDEX_BATCHES[0]
    stop_reading(batches)
    assert _read_ahead_threads() == []
    assert requested in (INDEX_BATCHES[:1], INDEX_BATCHES[:2]), "at most the one batch ahead"


def test_no_index_batches_start_no_thread() -> None:
    assert list(read_ahead(list, [])) == []
    assert _read_ahead_threads() == []
