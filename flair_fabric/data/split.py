"""A split of a mapped corpus: a torch ``Dataset`` of flair data points built on demand from memory-mapped columns."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from flair.data import DataPair, Sentence
from torch.utils.data import Dataset

from flair_fabric.data.cache import Stat, check_sources, checked_file
from flair_fabric.data.columns import SENTENCE, decode, parts
from flair_fabric.data.storage import open_split

SOURCE_CHECK_INTERVAL = 1.0
"""Seconds between two checks of the source files while items are read (a check is one ``stat`` per file)."""


class MappedSplit(Dataset):
    """The data points of one stored split (or of a selection of its rows, ``indices``), each built when asked for.

    Light and picklable: a pickle holds the file's path, the sources' sizes and times and the selected rows, never
    the data; the memory map is opened again on first use after unpickling. Item ``i`` is the flair ``Sentence`` (or
    ``DataPair``) flair's reader gave at build time, with its tokens, whitespace, token, span and sentence labels.
    Split built from column files link each sentence to its neighbours in the file, as flair's reader does
    (``previous_sentence()``/``next_sentence()``, for ``use_context``), by position in the whole stored split.
    Reading items checks at most every ``SOURCE_CHECK_INTERVAL`` seconds that no source file changed since the
    corpus opened (:class:`~flair_fabric.data.errors.SourceChangedError`). Before the file is mapped, its cache entry
    is checked (:func:`~flair_fabric.data.cache.checked_file`): a damaged one raises
    :class:`~flair_fabric.data.errors.DamagedCacheError`."""

    def __init__(
        self,
        path: str | Path,
        size: int,
        sources: dict[str, Stat] | None = None,
        linked: bool = False,
        indices: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        self.path, self.size, self.linked = str(path), size, linked
        self.sources: dict[str, Stat] = dict(sources or {})
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self._table: pa.Table | None = None
        self._kind = ""
        self._checked_at = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "sources": self.sources,
            "linked": self.linked,
            "indices": None
            if self.indices is None
            else self.indices.astype(np.int32 if self.size < 2**31 else np.int64),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def select(self, indices: Sequence[int]) -> MappedSplit:
        """The rows ``indices`` of this split (positions in this split), as a split of the same file."""
        rows = np.asarray(indices, dtype=np.int64)
        if self.indices is not None:
            rows = self.indices[rows]
        return MappedSplit(self.path, self.size, self.sources, self.linked, rows)

    @property
    def table(self) -> pa.Table:
        """The memory-mapped table of the whole stored split."""
        if self._table is None:
            checked_file(Path(self.path))
            check_sources(self.sources)
            self._checked_at = time.monotonic()
            self._table, self._kind = open_split(Path(self.path))
        return self._table

    @property
    def kind(self) -> str:
        """``"sentence"`` or ``"pair"``."""
        self.table  # noqa: B018
        return self._kind

    def check_sources(self) -> None:
        """Refuse (``SourceChangedError``, naming the file) when a source changed since the corpus opened."""
        check_sources(self.sources)
        self._checked_at = time.monotonic()

    def __len__(self) -> int:
        return self.size if self.indices is None else len(self.indices)

    def _row(self, index: int) -> int:
        length = len(self)
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError(f"index {index} out of range for a split of {length}")
        return index if self.indices is None else int(self.indices[index])

    def __getitem__(self, index: int) -> Sentence | DataPair:
        row = self._row(int(index))
        table = self.table
        if self.sources and time.monotonic() - self._checked_at > SOURCE_CHECK_INTERVAL:
            self.check_sources()
        data_point = decode(table.slice(row, 1).to_pylist()[0], self._kind)
        if self.linked and isinstance(data_point, Sentence):
            whole = self if self.indices is None else MappedSplit(self.path, self.size, self.sources, self.linked)
            data_point._has_context = True
            data_point._position_in_dataset = (whole, row)
        return data_point

    def token_counts(self) -> np.ndarray:
        """The number of tokens of each data point (of each part of a pair: one column per part)."""
        table = self.table
        counts = np.stack([table.column(prefix + "n_tokens").to_numpy() for prefix in parts(self._kind)], axis=1)
        return counts if self.indices is None else counts[self.indices]

    def lengths(self) -> np.ndarray:
        """Each data point's length as flair-fabric's balancing counts it (``data_point_length``): a sentence's tokens
        (at least 1), summed over the two sentences of a pair; read from the stored column, nothing is built."""
        return np.maximum(self.token_counts(), 1).sum(axis=1).astype(np.int64)

    def columns(self, names: list[str], rows_per_chunk: int = 4096) -> Iterator[dict[str, list]]:
        """The columns ``names`` as Python lists, a chunk of rows at a time, in the split's order."""
        table = self.table.select(names)
        if self.indices is None:
            for batch in table.to_batches(max_chunksize=rows_per_chunk):
                yield {name: batch.column(name).to_pylist() for name in names}
            return
        for start in range(0, len(self.indices), rows_per_chunk):
            chunk = table.take(pa.array(self.indices[start : start + rows_per_chunk]))
            yield {name: chunk.column(name).to_pylist() for name in names}

    @property
    def is_pair(self) -> bool:
        """Whether the data points are ``DataPair``s."""
        return self.kind != SENTENCE
