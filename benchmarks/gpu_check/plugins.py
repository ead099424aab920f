"""The TrainerPlugin classes of the checks (flair is imported only inside the check processes: the classes are built
on first use, as attributes of this module, so that spawned processes can unpickle them)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .training import synchronize

SYNC_WARNING = "synchroniz"  # torch: "called a synchronizing CUDA operation"
_LAZY_CLASSES = ("EpochTimer", "RunRecorder", "StepSyncCounter", "OverflowProbe")


def flair_classes() -> dict[str, type]:
    """The TrainerPlugin classes of the checks, built once per process.

    They are module attributes (see ``__getattr__``), so that spawned processes can unpickle them."""
    cached = globals().get("_FLAIR_CLASSES")
    if cached is not None:
        return cached
    import flair
    import torch
    from flair.trainers.plugins import LinearSchedulerPlugin, TrainerPlugin

    class EpochTimer(TrainerPlugin):
        """Seconds of the training part of each epoch, with the device's work finished at both ends."""

        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0

        @TrainerPlugin.hook
        def before_training_epoch(self, **kwargs: Any) -> None:
            synchronize()
            self._start = time.perf_counter()

        @TrainerPlugin.hook
        def after_training_epoch(self, **kwargs: Any) -> None:
            synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    class RunRecorder(TrainerPlugin):
        """Global rank 0 writes the run's world size, strategy, backend and peak GPU memory to ``path``."""

        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

        @TrainerPlugin.hook
        def after_training_loop(self, **kwargs: Any) -> None:
            trainer = self.trainer
            if getattr(trainer, "global_rank", 0) != 0:
                return
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            fabric = getattr(trainer, "fabric", None)
            device = flair.device
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            info = {
                "world_size": getattr(trainer, "world_size", 1),
                "device": str(device),
                "strategy": type(fabric.strategy).__name__ if fabric is not None else None,
                "backend": torch.distributed.get_backend() if distributed else None,
                "peak_gpu_memory_mib": round(peak, 1) if peak is not None else None,
            }
            Path(self.path).write_text(json.dumps(info), encoding="utf-8")

    class StepSyncCounter(TrainerPlugin):
        """Device synchronisations of each training step: the warnings ``torch.cuda.set_sync_debug_mode("warn")``
        gives between ``before_training_batch`` and ``after_training_batch`` (forward, backward, step, logging)."""

        def __init__(self, caught: list) -> None:
            super().__init__()
            self.caught = caught
            self.per_step: list[int] = []
            self._seen = 0

        def _new_syncs(self) -> int:
            fresh = self.caught[self._seen :]
            self._seen = len(self.caught)
            return sum(SYNC_WARNING in str(w.message) for w in fresh)

        @TrainerPlugin.hook
        def before_training_batch(self, **kwargs: Any) -> None:
            self._new_syncs()

        @TrainerPlugin.hook
        def after_training_batch(self, **kwargs: Any) -> None:
            self.per_step.append(self._new_syncs())

    class OverflowProbe(TrainerPlugin):
        """Sets a gradient to inf before optimizer step ``at_step``; records for every step the loss scale before
        and after it, the trainer's ``optimizer_was_run`` and the position of flair's LinearSchedulerPlugin."""

        def __init__(self, at_step: int) -> None:
            super().__init__()
            self.at_step = at_step
            self.optimizer_was_run: dict[int, Any] = {}
            self.scale_before: dict[int, float | None] = {}
            self.scale_after: dict[int, float | None] = {}
            self.scheduler_position: dict[int, int | None] = {}  # scheduler.last_epoch before each step
            self.final_position: int | None = None
            self.finite_after_skip: bool | None = None
            self.poisoned: str | None = None

        def _scheduler_position(self) -> int | None:
            for plugin in self.trainer.plugins:
                if isinstance(plugin, LinearSchedulerPlugin):
                    return int(plugin.scheduler.last_epoch)
            return None

        def _scale(self) -> float | None:
            fabric = getattr(self.trainer, "fabric", None)
            scaler = getattr(fabric.strategy.precision, "scaler", None) if fabric is not None else None
            return float(scaler.get_scale()) if scaler is not None else None

        @TrainerPlugin.hook
        def before_training_batch(self, batch_count: int, **kwargs: Any) -> None:
            self.scheduler_position[batch_count] = self._scheduler_position()
            self.scale_before[batch_count] = self._scale()

        @TrainerPlugin.hook
        def before_training_optimizer_step(self, batch_count: int, **kwargs: Any) -> None:
            if batch_count != self.at_step:
                return
            name, parameter = next((n, p) for n, p in self.model.named_parameters() if p.grad is not None)
            with torch.no_grad():
                parameter.grad.fill_(float("inf"))
            self.poisoned = name

        @TrainerPlugin.hook
        def after_training_batch(self, batch_count: int, optimizer_was_run: Any = None, **kwargs: Any) -> None:
            self.optimizer_was_run[batch_count] = optimizer_was_run
            self.scale_after[batch_count] = self._scale()
            if batch_count == self.at_step:
                self.finite_after_skip = all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

        @TrainerPlugin.hook
        def after_training_loop(self, **kwargs: Any) -> None:
            self.final_position = self._scheduler_position()

    classes: dict[str, type] = {}
    for cls in (EpochTimer, RunRecorder, StepSyncCounter, OverflowProbe):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        classes[cls.__name__] = cls
    globals().update(classes)
    globals()["_FLAIR_CLASSES"] = classes
    return classes


def __getattr__(name: str) -> Any:
    """The plugin classes, for pickle (spawned processes look them up here)."""
    if name in _LAZY_CLASSES:
        return flair_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plugin(name: str, *args: Any) -> Any:
    """An instance of one of this module's plugin classes."""
    return flair_classes()[name](*args)
