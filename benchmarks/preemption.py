"""Sections 6 and 7 of ``benchmarks/run.py``: what preemption-proof training costs.

6. checkpoint_cost: training time of an epoch with a checkpoint every n steps vs none (ddp and fsdp, 2 CPU ranks).
7. resume_latency: time from process start to the first trained step when resuming late in an epoch vs early.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Protocol


class Runs(Protocol):
    """``worker_runner.Runner``: starts one worker and returns its JSON."""

    work_dir: Path

    def run(self, mode: str, job: Any, extra: list[str] | None = None, threads: int | None = None) -> dict[str, Any]:
        """Run ``worker.py mode`` for ``job``; the result has ``process_started_at`` (``time.time()``)."""


MINILM = (
    "TextClassifier(TransformerDocumentEmbeddings(all-MiniLM-L6-v2, fine_tune=True)), trainer.fine_tune (AdamW,"
    " linear schedule)"
)


def _steps_per_epoch(job: Any, devices: int) -> int:
    return job.train_size // (job.batch_size * devices)


def _epoch_seconds(runs: list[dict[str, Any]], variant: str) -> list[float]:
    """Per run of ``variant`` in run order: the training seconds of the epoch on the slowest rank."""
    return [max(sum(rank["epoch_seconds"]) for rank in run["ranks"]) for run in runs if run["variant"] == variant]


def checkpoint_cost_section(runner: Runs, job: Any, devices: int, every: int) -> dict[str, Any]:
    """Per strategy, one launch: a warm-up, then ``job.reps`` epochs with and without checkpoints in ABBA order."""
    steps = _steps_per_epoch(job, devices)
    print(
        f"  checkpoint every {every} steps vs none: {job.model}, {steps} steps per epoch, {devices} ranks", flush=True
    )
    per_strategy: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for strategy in ("ddp", "fsdp"):
        base = runner.work_dir / f"checkpointing-{strategy}"
        extra = [f"--devices={devices}", f"--strategy={strategy}", f"--every={every}", f"--base-path={base}"]
        result = runner.run("checkpointing", job, extra)
        runs += result["runs"]
        with_checkpoints, without = _epoch_seconds(result["runs"], "every"), _epoch_seconds(result["runs"], "none")
        ratios = [a / b for a, b in zip(with_checkpoints, without, strict=True)]
        per_strategy[strategy] = {
            "epoch_seconds_without": [round(x, 3) for x in without],
            "epoch_seconds_with": [round(x, 3) for x in with_checkpoints],
            "median_ratio_with_over_without": round(statistics.median(ratios), 4),
            "checkpoints_per_epoch": steps // every,
        }
        print(f"    -> {strategy}: ratio with/without {statistics.median(ratios):.3f} ({ratios})", flush=True)
    return {
        "what": f"FabricTrainer(accelerator='cpu', devices={devices}, strategy=ddp|fsdp).fine_tune(...): the training"
        f" part of one epoch ({steps} steps per rank) with checkpoint_every_n_steps={every} and with no checkpoint,"
        " alternating (ABBA) in one launch per strategy after an untimed warm-up that writes a checkpoint too. A"
        " checkpoint holds model, AdamW state, schedule and every rank's generators (fsdp: sharded, one file per"
        " rank); keep_checkpoints=1 deletes the previous one. The slowest rank counts.",
        "model": MINILM,
        "sizes": {
            "train_size": job.train_size,
            "mini_batch_size_per_process": job.batch_size,
            "steps_per_epoch_per_rank": steps,
            "checkpoint_every_n_steps": every,
            "pairs": job.reps,
        },
        "summary": per_strategy,
        "runs": runs,
    }


def resume_latency_section(runner: Runs, job: Any, devices: int, every: int, launches: int) -> dict[str, Any]:
    """Checkpoints every ``every`` steps of one epoch, then fresh launches resume at ~10% and ~90% of it."""
    steps = _steps_per_epoch(job, devices)
    early, late = every * max(1, round(0.1 * steps / every)), every * round(0.9 * steps / every)
    print(f"  resume at step {early} vs {late} of {steps}: {job.model}, {devices} ranks", flush=True)
    prepared = runner.work_dir / "resume-prepared"
    common = [f"--devices={devices}", f"--every={every}"]
    kept = runner.run("resume-prepare", job, [*common, f"--base-path={prepared}"])["checkpoints"]
    folders = {step: prepared / "checkpoints" / f"step-{step:09d}" for step in (early, late)}
    missing = [folder.name for folder in folders.values() if folder.name not in kept]
    if missing:
        raise RuntimeError(f"the prepared run kept {kept}, not {missing}")
    latencies: dict[int, list[float]] = {early: [], late: []}
    for launch in range(launches):
        for step in (early, late) if launch % 2 == 0 else (late, early):
            base = runner.work_dir / f"resume-run-{launch}-{step}"
            result = runner.run("resume", job, [*common, f"--base-path={base}", f"--resume-from={folders[step]}"])
            latencies[step].append(result["first_step_at"] - result["process_started_at"])
            print(f"    resume at step {step}: first step after {latencies[step][-1]:.2f} s", flush=True)
    ratio = statistics.median(latencies[late]) / statistics.median(latencies[early])
    print(f"    -> late / early: {ratio:.3f}", flush=True)
    return {
        "what": f"One epoch of FabricTrainer(accelerator='cpu', devices={devices}).fine_tune(...) keeps a checkpoint"
        f" every {every} steps; then fresh launches (new processes, ABBA order) resume from the checkpoint at step"
        f" {early} and at step {late} of {steps}. Measured: wall-clock time from starting the worker process to the"
        " end of the first optimizer step on global rank 0 (imports, relaunch, corpus, model, checkpoint load, the"
        " skip to the resume point, one step).",
        "model": MINILM,
        "sizes": {
            "train_size": job.train_size,
            "mini_batch_size_per_process": job.batch_size,
            "steps_per_epoch_per_rank": steps,
            "early_step": early,
            "late_step": late,
            "launches": launches,
        },
        "summary": {
            "early_seconds": [round(x, 3) for x in latencies[early]],
            "late_seconds": [round(x, 3) for x in latencies[late]],
            "median_ratio_late_over_early": round(ratio, 4),
        },
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README sections 6 and 7, for the results present."""
    lines: list[str] = []
    if "checkpoint_cost" in results:
        section = results["checkpoint_cost"]
        z = section["sizes"]
        lines += [
            f"## 6. Checkpoint every {z['checkpoint_every_n_steps']} steps vs none (MiniLM-L6 fine-tuning, 2 CPU"
            f" processes, {z['steps_per_epoch_per_rank']} steps per epoch, batch {z['mini_batch_size_per_process']}"
            " per process; goal: ratio <= 1.05)",
            "",
            "| strategy | checkpoints per epoch | s/epoch without | s/epoch with | median ratio with/without |",
            "|---|---|---|---|---|",
        ]
        for strategy, s in section["summary"].items():
            lines.append(
                f"| {strategy} | {s['checkpoints_per_epoch']} | {statistics.median(s['epoch_seconds_without']):.2f}"
                f" | {statistics.median(s['epoch_seconds_with']):.2f} | **{s['median_ratio_with_over_without']:.3f}** |"
            )
        lines.append("")
    if "resume_latency" in results:
        section = results["resume_latency"]
        z, s = section["sizes"], section["summary"]
        lines += [
            f"## 7. Resume latency: process start to the first trained step (MiniLM-L6, 2 CPU processes,"
            f" {z['launches']} launches each; goal: ratio <= 1.1)",
            "",
            "| resume point | median s | runs (s) |",
            "|---|---|---|",
            f"| step {z['early_step']} of {z['steps_per_epoch_per_rank']} | {statistics.median(s['early_seconds']):.2f}"
            f" | {s['early_seconds']} |",
            f"| step {z['late_step']} of {z['steps_per_epoch_per_rank']} | {statistics.median(s['late_seconds']):.2f}"
            f" | {s['late_seconds']} |",
            "",
            f"Late / early: **{s['median_ratio_late_over_early']:.3f}**. The batches before the resume point are"
            " skipped by index: neither read nor embedded.",
            "",
        ]
    return lines
