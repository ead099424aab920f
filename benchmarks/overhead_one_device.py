"""Section 1 of ``benchmarks/run.py``: ``FabricTrainer(devices=1)`` against flair's ``ModelTrainer``, training time
per epoch, both in one process (``worker.py overhead``)."""

from __future__ import annotations

import statistics
from typing import Any

from plans import MODEL_DESCRIPTIONS, Job
from section_statistics import r, rep_seconds
from worker_runner import Runner


def overhead_section(runner: Runner, jobs: list[Job]) -> dict[str, Any]:
    models = {}
    for job in jobs:
        print(f"  overhead, one device: {job.model}, {job.train_size} questions, {job.reps} pairs", flush=True)
        result = runner.run("overhead", job)
        fabric = [run for run in result["runs"] if run["trainer"] == "fabric"]
        flair = [run for run in result["runs"] if run["trainer"] == "flair"]
        ratios = [rep_seconds(a) / rep_seconds(b) for a, b in zip(fabric, flair, strict=True)]
        cpu_ratios = [
            rep_seconds(a, "epoch_cpu_seconds") / rep_seconds(b, "epoch_cpu_seconds")
            for a, b in zip(fabric, flair, strict=True)
        ]
        fabric_s = [rep_seconds(run) for run in fabric]
        flair_s = [rep_seconds(run) for run in flair]
        models[job.model] = {
            "model": MODEL_DESCRIPTIONS[job.model],
            "sizes": {
                "train_size": job.train_size,
                "mini_batch_size": job.batch_size,
                "epochs_per_run": job.epochs,
                "steps_per_epoch": -(-job.train_size // job.batch_size),
                "learning_rate": job.learning_rate,
                "pairs": job.reps,
            },
            "torch_threads": result["torch_threads_per_process"],
            "summary": {
                "median_ratio_fabric_over_flair": r(statistics.median(ratios)),
                "ratio_of_fastest_runs": r(min(fabric_s) / min(flair_s)),
                "median_cpu_time_ratio": r(statistics.median(cpu_ratios)),
                "fabric_median_seconds": r(statistics.median(fabric_s)),
                "flair_median_seconds": r(statistics.median(flair_s)),
                "goal": "median ratio <= 1.02",
                "meets_goal": statistics.median(ratios) <= 1.02,
            },
            "pair_ratios": [r(x) for x in ratios],
            "runs": result["runs"],
            "process_wall_seconds": result["process_wall_seconds"],
        }
        summary = models[job.model]["summary"]
        print(
            f"    -> fabric/flair median ratio {summary['median_ratio_fabric_over_flair']:.3f}"
            f" (fastest runs {summary['ratio_of_fastest_runs']:.3f}, CPU time {summary['median_cpu_time_ratio']:.3f})",
            flush=True,
        )
    return {
        "what": "Training time of an epoch (before_training_epoch to after_training_epoch, wall clock, measured by "
        "the same TrainerPlugin in both trainers) with FabricTrainer(accelerator='cpu', devices=1) and with flair's "
        "own flair.trainers.ModelTrainer, same seeded model, same data in the same order (shuffle=False), no dev/test "
        "split, no model files. Both trainers run in one process, interleaved A,B,B,A,... after one untimed warm-up "
        "run each; ratio = FabricTrainer seconds / ModelTrainer seconds of the two runs of a pair; the median over "
        "pairs is reported. CPU time (time.process_time) ratio is a cross-check less sensitive to other load.",
        "models": models,
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 1 of the README table, if it was measured."""
    lines: list[str] = []
    if "overhead_one_device" in results:
        lines += [
            "## 1. One device: FabricTrainer(devices=1) vs flair's ModelTrainer (goal: ratio <= 1.02)",
            "",
            "| model | train size / batch | pairs (ABBA) | flair s/epoch | fabric s/epoch | median ratio fabric/flair"
            " | fastest-run ratio | CPU-time ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, m in results["overhead_one_device"]["models"].items():
            s, z = m["summary"], m["sizes"]
            epochs = z["epochs_per_run"]
            lines.append(
                f"| {name} | {z['train_size']} / {z['mini_batch_size']} | {z['pairs']} |"
                f" {s['flair_median_seconds'] / epochs:.3f} | {s['fabric_median_seconds'] / epochs:.3f} |"
                f" **{s['median_ratio_fabric_over_flair']:.3f}** | {s['ratio_of_fastest_runs']:.3f} |"
                f" {s['median_cpu_time_ratio']:.3f} |"
            )
        lines.append("")
    return lines
