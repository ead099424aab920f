"""Section 8 of ``benchmarks/run.py``: the wall time users feel, a whole 2-rank ``fine_tune`` with dev evaluation
every epoch, the final test and the model files, flair's own ``multi_gpu=True`` against ``FabricTrainer``."""

from __future__ import annotations

import statistics
from typing import Any

from preemption import MINILM, Runs


def end_to_end_section(runner: Runs, job: Any, devices: int, launches: int, dev_size: int) -> dict[str, Any]:
    """``launches`` launches per side in ABBA order, each an untimed warm-up and ``job.reps`` timed runs."""
    print(
        f"  whole fine_tune, {devices} ranks: {job.model}, {job.train_size} training questions, dev and test"
        f" {dev_size} each, {job.epochs} epochs, {launches} launch(es) x {job.reps} run(s) per side",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    order = ["whole-native", "whole-fabric"]
    for launch in range(launches):
        for mode in order if launch % 2 == 0 else order[::-1]:
            base = runner.work_dir / f"{mode}-{launch}"
            extra = [f"--devices={devices}", f"--dev-size={dev_size}", f"--base-path={base}"]
            result = runner.run(mode, job, extra)
            runs += [{**run, "launch": launch} for run in result["runs"]]

    def seconds(mode: str) -> list[float]:
        return [run["seconds"] for run in runs if run["trainer"] == mode]

    native, fabric = statistics.median(seconds("whole-native")), statistics.median(seconds("whole-fabric"))
    scores = sorted({round(run["test_score"], 6) for run in runs})
    print(
        f"    -> native {native:.2f} s, fabric {fabric:.2f} s: {native / fabric:.3f}x; test scores {scores}", flush=True
    )
    return {
        "what": f"Wall time of one whole fine_tune call on {devices} CPU processes, timed on rank 0 from the call to"
        " its return: training, dev evaluation after every epoch, final-model.pt, the final test. flair's"
        " ModelTrainer(multi_gpu=True) in processes started by torch.multiprocessing (benchmark shim: device_ids=None"
        f" on CPU) against FabricTrainer(accelerator='cpu', devices={devices}) under its script relaunch. Processes"
        " are started by an untimed warm-up run on a small corpus. flair evaluates the whole dev and test split on"
        " every rank; FabricTrainer shards them.",
        "model": MINILM,
        "sizes": {
            "train_size": job.train_size,
            "dev_size": dev_size,
            "test_size": dev_size,
            "mini_batch_size_per_process": job.batch_size,
            "eval_batch_size": 32,
            "epochs": job.epochs,
            "launches_per_side": launches,
            "runs_per_launch": job.reps,
        },
        "summary": {
            "native_median_seconds": round(native, 3),
            "fabric_median_seconds": round(fabric, 3),
            "speedup_fabric_over_native": round(native / fabric, 4),
            "test_scores_seen": scores,
        },
        "runs": runs,
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 8 of the README table, if it was measured."""
    section = results.get("end_to_end_fine_tune")
    if section is None:
        return []
    sizes, summary = section["sizes"], section["summary"]
    runs = section["runs"]

    def shown(mode: str) -> str:
        return ", ".join(f"{run['seconds']:.1f}" for run in runs if run["trainer"] == mode)

    def scores(mode: str) -> str:
        return ", ".join(
            str(score) for score in sorted({round(r["test_score"], 4) for r in runs if r["trainer"] == mode})
        )

    return [
        f"## 8. A whole fine_tune, 2 CPU processes: FabricTrainer vs flair's own multi_gpu=True (MiniLM-L6,"
        f" {sizes['train_size']} training questions, dev and test {sizes['dev_size']} each, {sizes['epochs']} epochs;"
        " goal: >= 1.15)",
        "",
        "| trainer | median s | runs (s) | test accuracy of the runs |",
        "|---|---|---|---|",
        f"| flair `multi_gpu=True` (every rank evaluates whole splits) | {summary['native_median_seconds']:.2f} |"
        f" {shown('whole-native')} | {scores('whole-native')} |",
        f"| `FabricTrainer(devices=2)` (sharded evaluation) | {summary['fabric_median_seconds']:.2f} |"
        f" {shown('whole-fabric')} | {scores('whole-fabric')} |",
        "",
        f"Speed-up: **{summary['speedup_fabric_over_native']:.3f}x**. The call includes training, dev evaluation after"
        " every epoch, writing final-model.pt and the final test. Both trainers see the same batches, but MiniLM's"
        " dropout is on and its random draws are not matched between the two trainers, so the test scores"
        " differ a little. With dropout off, FabricTrainer's 2-rank weights equal flair's one-process training"
        " on the same batches (tests/training).",
        "",
    ]
