"""Section 3 of ``benchmarks/run.py``: ``FabricTrainer(devices=2)`` with DDP's unused-parameter search forced on
against off and the default ``'auto'``, on a model in which every parameter gets a gradient (``worker.py fabric``)."""

from __future__ import annotations

import statistics
from typing import Any

from plans import MODEL_DESCRIPTIONS, Job
from section_statistics import epoch_samples_per_second, r, rep_seconds, shown, training_sizes
from worker_runner import Runner


def find_unused_section(runner: Runner, job: Job, launches: int, devices: int) -> dict[str, Any]:
    print(
        f"  find_unused_parameters True vs False, {devices} ranks: {job.model}, {job.train_size} questions,"
        f" {launches} launch(es) x {job.reps} run(s) per setting",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for launch in range(launches):
        variants = "true,false,auto" if launch % 2 == 0 else "false,true,auto"
        extra = [f"--devices={devices}", f"--variants={variants}", f"--base-path={runner.work_dir / 'fabric-base'}"]
        launch_runs = runner.run("fabric", job, extra)["runs"]
        for run in launch_runs:
            run["launch"] = launch
        runs += launch_runs
    sps = {
        variant: statistics.median(
            epoch_samples_per_second([x for x in runs if x["variant"] == variant], job.train_size)
        )
        for variant in ("true", "false", "auto")
    }
    auto_choice = sorted({run["find_unused_parameters"] for run in runs if run["variant"] == "auto"})
    paired = []
    for launch in range(launches):
        for rep in range(job.reps):
            pair = {x["variant"]: x for x in runs if x["launch"] == launch and x["rep"] == rep}
            paired.append(rep_seconds(pair["true"]) / rep_seconds(pair["false"]))
    summary = {
        "median_samples_per_second_find_unused_true": r(sps["true"], 2),
        "median_samples_per_second_find_unused_false": r(sps["false"], 2),
        "median_samples_per_second_auto": r(sps["auto"], 2),
        "ratio_false_over_true": r(sps["false"] / sps["true"]),
        "median_paired_time_ratio_true_over_false": r(statistics.median(paired)),
        "auto_resolved_find_unused_parameters_to": auto_choice,
    }
    print(
        f"    -> samples/s: find_unused=False {sps['false']:.1f}, True {sps['true']:.1f}"
        f" (False/True {summary['ratio_false_over_true']:.3f}); 'auto' chose {auto_choice}",
        flush=True,
    )
    return {
        "what": f"FabricTrainer(accelerator='cpu', devices={devices}) with strategy=FlairDDPStrategy("
        "find_unused_parameters=True) vs FlairDDPStrategy(find_unused_parameters=False) and the default 'auto', on a "
        "model in which every parameter gets a gradient. Throughput as in ddp_vs_flair_native (rank 0, median over "
        "timed epochs). The settings alternate inside each launch (order rotated from run to run) after one untimed "
        "warm-up run; 'auto' probes the model once and should choose False here.",
        "model": MODEL_DESCRIPTIONS[job.model],
        "sizes": training_sizes(job, launches=launches, runs_per_setting_per_launch=job.reps),
        "summary": summary,
        "runs": runs,
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 3 of the README table, if it was measured."""
    lines: list[str] = []
    if "find_unused_parameters" in results:
        s = results["find_unused_parameters"]["summary"]
        z = results["find_unused_parameters"]["sizes"]
        lines += [
            "## 3. DDP find_unused_parameters on a model without unused parameters (RNN, 2 CPU processes)",
            "",
            "| train size / batch per process | runs each | True samples/s | False samples/s | False/True"
            " | default 'auto' chose |",
            "|---|---|---|---|---|---|",
            f"| {z['train_size']} / {z['mini_batch_size_per_process']} |"
            f" {z['launches'] * z['runs_per_setting_per_launch']} |"
            f" {s['median_samples_per_second_find_unused_true']:.1f} |"
            f" {s['median_samples_per_second_find_unused_false']:.1f} | **{s['ratio_false_over_true']:.3f}** |"
            f" {shown(s['auto_resolved_find_unused_parameters_to'])} |",
            "",
        ]
    return lines
