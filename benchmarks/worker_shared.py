"""What every mode of ``worker.py`` uses: the workload and its warm-up from the command line, the JSON header and
the epoch timings of a result, and writing it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from common import EpochTimer, Workload


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(args.model, args.train_size, args.batch_size, args.epochs, args.learning_rate)


def warmup_of(workload: Workload, world_size: int) -> Workload:
    """One epoch of at most four batches per process: pays first-call costs outside the timed runs."""
    size = min(workload.train_size, 4 * workload.batch_size * world_size)
    return Workload(workload.model, size, workload.batch_size, 1, workload.learning_rate)


def write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def header(mode: str, workload: Workload, world_size: int) -> dict[str, Any]:
    return {
        "mode": mode,
        "workload": workload.to_dict(),
        "world_size": world_size,
        "torch_threads_per_process": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "runs": [],
    }


def timings(timer: EpochTimer) -> dict[str, list[float]]:
    return {"epoch_seconds": timer.epoch_seconds, "epoch_cpu_seconds": timer.epoch_cpu_seconds}
