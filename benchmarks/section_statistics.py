"""What the result sections of ``benchmarks/run.py`` share: seconds and samples per second of the workers' runs,
rounding, the training sizes of a results file, and how a list of values is shown in the README table."""

from __future__ import annotations

from typing import Any

from plans import Job


def rep_seconds(run: dict[str, Any], key: str = "epoch_seconds") -> float:
    return float(sum(run[key]))


def epoch_samples_per_second(runs: list[dict[str, Any]], train_size: int) -> list[float]:
    """Global training data points of one epoch / that epoch's training time on rank 0, for every epoch."""
    return [train_size / seconds for run in runs for seconds in run["epoch_seconds"]]


def r(value: float, digits: int = 4) -> float:
    return round(value, digits)


def shown(values: list[Any]) -> str:
    return str(values[0]) if len(values) == 1 else "/".join(str(v) for v in values)


def training_sizes(job: Job, **counts: int) -> dict[str, Any]:
    """A section's ``sizes`` for training on several processes: the job's sizes, then ``counts`` (launches, runs)."""
    return {
        "train_size": job.train_size,
        "mini_batch_size_per_process": job.batch_size,
        "epochs_per_run": job.epochs,
        "learning_rate": job.learning_rate,
        **counts,
    }
