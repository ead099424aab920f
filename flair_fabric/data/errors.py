"""The errors of the memory-mapped corpus: each names what went wrong and where."""

from __future__ import annotations

from pathlib import Path


class MalformedLineError(ValueError):
    """A line of a source file that cannot be read: names the file, the line number and what was expected."""

    def __init__(self, path: str | Path, line_number: int, expected: str) -> None:
        self.path, self.line_number, self.expected = Path(path), line_number, expected
        super().__init__(f"{path}, line {line_number}: expected {expected}")


class UnsupportedDataPointError(ValueError):
    """A data point (or a label's target) that the mapped corpus cannot store."""


class SourceChangedError(RuntimeError):
    """A source file of a mapped corpus changed while the corpus was in use."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = Path(path)
        super().__init__(
            f"the source file {path} changed while its mapped corpus was in use ({detail}); "
            "open the corpus again to rebuild its cache"
        )


class DamagedCacheError(RuntimeError):
    """A file of a cache entry whose size or checksum is not what the entry recorded, where nothing is at hand to
    rebuild it from: names the file and the fix."""

    def __init__(self, path: str | Path, problem: str, fix: str) -> None:
        self.path = Path(path)
        super().__init__(f"the cache file {path} is damaged ({problem}); it is never read. {fix}")


class CacheFolderError(OSError):
    """A cache folder that cannot be written (to build an entry): names it, ``cache_folder`` and
    ``FLAIR_FABRIC_CACHE``."""

    def __init__(self, root: str | Path, reason: str) -> None:
        self.root = Path(root)
        super().__init__(
            f"the cache folder {root} cannot be written ({reason}): pass a writable folder as cache_folder=, or set "
            "FLAIR_FABRIC_CACHE to one"
        )
