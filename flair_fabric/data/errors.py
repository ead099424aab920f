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
