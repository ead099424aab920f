"""Section 5 of ``benchmarks/run.py``: memory and time per rank of ``strategy="fsdp"`` against ``"ddp"``
(``worker.py sharding``)."""

from __future__ import annotations

import statistics
from typing import Any

from plans import MODEL_DESCRIPTIONS, Job
from section_statistics import r, training_sizes
from worker_runner import Runner


def sharding_section(runner: Runner, job: Job, launches: int, devices: int) -> dict[str, Any]:
    print(
        f"  ddp vs fsdp, {devices} ranks: {job.model}, {job.train_size} questions, {launches} launch(es) per"
        f" strategy x {job.reps} run(s)",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for launch in range(launches):
        order = ("ddp", "fsdp") if launch % 2 == 0 else ("fsdp", "ddp")
        for strategy in order:
            extra = [f"--devices={devices}", f"--strategy={strategy}", f"--base-path={runner.work_dir / 'shard-base'}"]
            for run in runner.run("sharding", job, extra)["runs"]:
                run["launch"] = launch
                runs.append(run)

    def median_over_runs(strategy: str, measure: Any) -> float:
        return statistics.median(measure(run["ranks"]) for run in runs if run["strategy"] == strategy)

    def epoch_seconds(ranks: list[dict]) -> float:  # the slowest rank: the others wait for it at every step
        return max(statistics.median(rank["epoch_seconds"]) for rank in ranks)

    def peak_rss(ranks: list[dict]) -> float:
        return max(max(rank["peak_rss_mib"]) for rank in ranks)

    def start_rss(ranks: list[dict]) -> float:
        return max(min(rank["start_rss_mib"]) for rank in ranks)

    def held(ranks: list[dict]) -> float:
        return max(max(rank["held_mib"]) for rank in ranks)

    measures = {"epoch_seconds": epoch_seconds, "peak_rss_mib": peak_rss, "start_rss_mib": start_rss, "held_mib": held}
    values = {
        strategy: {name: median_over_runs(strategy, measure) for name, measure in measures.items()}
        for strategy in ("ddp", "fsdp")
    }
    ddp, fsdp = values["ddp"], values["fsdp"]
    summary = {
        **{f"{strategy}_{name}": r(value, 3) for strategy, named in values.items() for name, value in named.items()},
        "ratio_epoch_seconds_fsdp_over_ddp": r(fsdp["epoch_seconds"] / ddp["epoch_seconds"]),
        "ratio_peak_rss_fsdp_over_ddp": r(fsdp["peak_rss_mib"] / ddp["peak_rss_mib"]),
        "ratio_peak_growth_fsdp_over_ddp": r(
            (fsdp["peak_rss_mib"] - fsdp["start_rss_mib"]) / (ddp["peak_rss_mib"] - ddp["start_rss_mib"])
        ),
        "ratio_held_fsdp_over_ddp": r(fsdp["held_mib"] / ddp["held_mib"]),
    }
    print(
        f"    -> epoch s: ddp {ddp['epoch_seconds']:.2f}, fsdp {fsdp['epoch_seconds']:.2f}; peak RSS MiB: ddp"
        f" {ddp['peak_rss_mib']:.0f}, fsdp {fsdp['peak_rss_mib']:.0f}; parameters + optimizer state MiB: ddp"
        f" {ddp['held_mib']:.1f}, fsdp {fsdp['held_mib']:.1f}",
        flush=True,
    )
    return {
        "what": f"FabricTrainer(accelerator='cpu', devices={devices}).fine_tune(...) with strategy='ddp' and with"
        " strategy='fsdp' (FlairFSDPStrategy defaults: one shard unit per transformer layer and one for the embeddings,"
        " the rest in the root unit). Each launch runs one strategy (the order alternates), with an untimed warm-up run"
        " first. Per run and rank: the training part of the epoch (seconds; the slowest rank counts), the peak resident"
        " memory of the process during it (VmHWM, reset through /proc/self/clear_refs at before_training_epoch after"
        " gc.collect() and malloc_trim(0) return freed memory to the system; the"
        " largest rank counts), the resident memory at the epoch start, and the bytes of parameters plus AdamW state"
        " the rank holds after the epoch (local shards only). Medians over the runs.",
        "model": MODEL_DESCRIPTIONS[job.model],
        "sizes": training_sizes(job, launches_per_strategy=launches, runs_per_launch=job.reps),
        "summary": summary,
        "runs": runs,
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 5 of the README table, if it was measured."""
    lines: list[str] = []
    if "ddp_vs_fsdp" in results:
        section = results["ddp_vs_fsdp"]
        s, z = section["summary"], section["sizes"]
        runs_each = z["launches_per_strategy"] * z["runs_per_launch"]
        lines += [
            "## 5. Sharded training: strategy='fsdp' vs 'ddp' (MiniLM-L6 fine-tuning, 2 CPU processes,"
            f" {z['train_size']} questions, batch {z['mini_batch_size_per_process']} per process,"
            f" {runs_each} runs each)",
            "",
            "| per rank | ddp | fsdp | fsdp / ddp |",
            "|---|---|---|---|",
            f"| parameters + optimizer state held (MiB) | {s['ddp_held_mib']:.1f} | {s['fsdp_held_mib']:.1f} |"
            f" **{s['ratio_held_fsdp_over_ddp']:.3f}** |",
            f"| peak resident memory during the epoch (MiB) | {s['ddp_peak_rss_mib']:.0f} |"
            f" {s['fsdp_peak_rss_mib']:.0f} | **{s['ratio_peak_rss_fsdp_over_ddp']:.3f}** |",
            "| growth of resident memory during the epoch (MiB) |"
            f" {s['ddp_peak_rss_mib'] - s['ddp_start_rss_mib']:.0f} |"
            f" {s['fsdp_peak_rss_mib'] - s['fsdp_start_rss_mib']:.0f} | {s['ratio_peak_growth_fsdp_over_ddp']:.3f} |",
            f"| training time per epoch (s) | {s['ddp_epoch_seconds']:.2f} | {s['fsdp_epoch_seconds']:.2f} |"
            f" **{s['ratio_epoch_seconds_fsdp_over_ddp']:.3f}** |",
            "",
            f"Resident memory at the epoch start: ddp {s['ddp_start_rss_mib']:.0f} MiB, fsdp"
            f" {s['fsdp_start_rss_mib']:.0f} MiB (Python, torch, flair, transformers, the data and the model). fsdp"
            " halves what each rank keeps between steps (first row). The peak also holds what a step needs for a"
            " while: activations, and under fsdp the gathered parameters and unsharded gradients of the units being"
            " computed, plus gloo's communication buffers. With 2 ranks and this small model the peak fell by"
            f" {100 * (1 - s['ratio_peak_rss_fsdp_over_ddp']):.0f}% only; held memory is 1/N of ddp's with N ranks,"
            " so larger models and more ranks should gain more (not measured here). On CPU the collectives go"
            " through gloo and are not overlapped with compute, so"
            " fsdp trades time for memory: use it when a model does not fit with ddp.",
            "",
        ]
    return lines
