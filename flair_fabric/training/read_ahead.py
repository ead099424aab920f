"""Reading ahead: the next batch's data points are built in a background thread while the current step trains.

Used for splits that build each data point when it is read (a mapped corpus, :mod:`flair_fabric.data`): there,
building a batch of 32 tweets costs about 8 ms, a third of a small tagger's step on a CPU (measured in
``benchmarks/mapped_corpus.py``), and the step's tensor work runs while the thread builds. The index batches are
drawn in the calling thread, one step ahead (flair's samplers draw their order when an epoch starts, so nothing
drawn changes). An error raised while building a batch (a source file that changed) is raised where that batch is
read, and an epoch left early leaves no thread behind.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

Batch = TypeVar("Batch")

THREAD_NAME = "flair-fabric-read-ahead"


def read_ahead(build: Callable[[list[int]], Batch], index_batches: Iterable[list[int]]) -> Iterator[Batch]:
    """``build(indices)`` of each index batch, in order; the next one is built in a background thread while the
    caller works on the current one."""
    indices = iter(index_batches)
    first = next(indices, None)
    if first is None:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME) as pool:
        pending: Future[Batch] | None = pool.submit(build, first)
        try:
            for following in indices:
                assert pending is not None
                built = pending.result()
                pending = pool.submit(build, following)
                yield built
            assert pending is not None
            last, pending = pending, None
            yield last.result()
        finally:
            if pending is not None:  # left early: a batch not started is dropped, one being built is waited for
                pending.cancel()


def stop_reading(batches: Iterable) -> None:
    """End a read that was left early (an interrupt, a stop): its read-ahead thread ends now, not when the batches are
    garbage-collected."""
    if isinstance(batches, Generator):
        batches.close()
