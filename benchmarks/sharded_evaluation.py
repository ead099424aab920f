"""Section 4 of ``benchmarks/run.py``: evaluating a dev split with ``flair_fabric.evaluate`` on 2 processes against
flair's ``evaluate`` in one and in every rank of ``multi_gpu=True`` (``worker.py evaluate`` and ``evaluate-native``)."""

from __future__ import annotations

import os
import statistics
from typing import Any

from plans import Job
from section_statistics import r
from worker_runner import Runner


def evaluation_section(runner: Runner, job: Job, launches: int, devices: int) -> dict[str, Any]:
    cpus = os.cpu_count() or devices
    threads_each = max(1, cpus // devices)
    print(
        f"  evaluation of a dev split: flair in 1 process ({cpus} threads), flair multi_gpu-style and fabric on"
        f" {devices} processes ({threads_each} thread(s) each): {job.model}, {job.train_size} questions,"
        f" {launches} launch(es) x {job.reps} run(s)",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    configurations = [
        ("evaluate", 1, cpus),
        ("evaluate", devices, threads_each),
        ("evaluate-native", devices, threads_each),
    ]
    for launch in range(launches):
        shift = launch % len(configurations)
        for mode, count, threads in configurations[shift:] + configurations[:shift]:
            result = runner.run(mode, job, [f"--devices={count}"], threads=threads)
            for run in result["runs"]:
                run.update(launch=launch, processes=count, threads_per_process=result["torch_threads_per_process"])
            runs += result["runs"]

    def median_seconds(trainer: str, processes: int) -> float:
        return statistics.median(x["seconds"] for x in runs if x["trainer"] == trainer and x["processes"] == processes)

    flair_one = median_seconds("flair", 1)
    fabric_one = median_seconds("fabric", 1)
    fabric_many = median_seconds("fabric", devices)
    native_many = median_seconds("flair-native", devices)
    scores = sorted({round(x["main_score"], 6) for x in runs})
    summary = {
        "processes": devices,
        "flair_evaluate_one_process_median_seconds": r(flair_one),
        "fabric_evaluate_one_process_median_seconds": r(fabric_one),
        "flair_native_every_rank_whole_split_median_seconds": r(native_many),
        "fabric_sharded_median_seconds": r(fabric_many),
        "ratio_time_sharded_over_flair_native_ranks": r(fabric_many / native_many),
        "ratio_time_sharded_over_flair_one_process": r(fabric_many / flair_one),
        "ratio_time_fabric_one_process_over_flair": r(fabric_one / flair_one),
        "main_scores_seen": scores,
        "same_score_everywhere": len(scores) == 1,
    }
    print(
        f"    -> seconds: flair 1 process {flair_one:.2f}, fabric 1 process {fabric_one:.2f}, flair multi_gpu-style"
        f" {native_many:.2f}, fabric sharded {fabric_many:.2f}; scores {scores}",
        flush=True,
    )
    return {
        "what": "Wall time of one evaluation of a TREC dev split on CPU, four ways: (a) flair's model.evaluate in one"
        f" process with all {cpus} CPU threads; (b) flair_fabric.evaluate(devices=1) in the same process;"
        f" (c) what flair's multi_gpu=True does inside training: {devices} processes ({threads_each} thread(s) each)"
        " each evaluate the whole split (time of the slowest rank); (d) flair_fabric.evaluate(accelerator='cpu',"
        f" devices={devices}) with the script relaunch, {threads_each} thread(s) per process: each rank predicts whole"
        " batches dealt round robin, rank 0 scores with flair's evaluate; timed on rank 0 from the call to the"
        " returned Result (prediction, gathering, scoring, broadcast). Processes are started by an untimed warm-up"
        " call. The model is not fine-tuned (evaluation cost does not depend on it).",
        "model": "TextClassifier(TransformerDocumentEmbeddings(all-MiniLM-L6-v2))",
        "sizes": {
            "dev_size": job.train_size,
            "eval_mini_batch_size": job.batch_size,
            "launches": launches,
            "runs_per_launch": job.reps,
        },
        "summary": summary,
        "runs": runs,
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 4 of the README table, if it was measured."""
    lines: list[str] = []
    if "sharded_evaluation" in results:
        section = results["sharded_evaluation"]
        s, z = section["summary"], section["sizes"]
        n = s["processes"]
        lines += [
            f"## 4. Evaluating a dev split (MiniLM-L6, {z['dev_size']} questions, eval batch"
            f" {z['eval_mini_batch_size']}, {z['launches'] * z['runs_per_launch']} runs each)",
            "",
            "| how | processes | median s | sharded time / this |",
            "|---|---|---|---|",
            "| flair `model.evaluate`, one process, all threads | 1 |"
            f" {s['flair_evaluate_one_process_median_seconds']:.2f} |"
            f" **{s['ratio_time_sharded_over_flair_one_process']:.3f}** |",
            f"| `flair_fabric.evaluate(devices=1)` | 1 | {s['fabric_evaluate_one_process_median_seconds']:.2f} | |",
            f"| flair `multi_gpu=True` style: every rank evaluates the whole split | {n} |"
            f" {s['flair_native_every_rank_whole_split_median_seconds']:.2f}"
            f" | **{s['ratio_time_sharded_over_flair_native_ranks']:.3f}** |",
            f"| `flair_fabric.evaluate(devices={n})`, sharded | {n} | {s['fabric_sharded_median_seconds']:.2f} | 1 |",
            "",
            f"Same main score in every run: {s['same_score_everywhere']} ({s['main_scores_seen']}).",
            "",
        ]
    return lines
