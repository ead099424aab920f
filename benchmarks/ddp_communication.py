"""Section 9 of ``benchmarks/run.py``: where the time of a 2-rank training step goes, FabricTrainer against flair's
own ``multi_gpu=True``, with exact DDP and with gradient compression.

Per model, in alternating launches: FabricTrainer with its exact defaults, with DDP's all-reduce replaced by a hook
that exchanges nothing (``no-comm``) and with ``bf16``/``powersgd`` compression; flair's native DDP exact and
``no-comm`` (the same hook, registered by the benchmark's shim); the bare loop (forward_loss, backward, optimizer
step, nothing else) on the same batches in 2 concurrent processes; and FabricTrainer on one process with one thread.

Per step of a rank: compute = bare loop (each rank on its own); waiting for the slowest rank = the bare loop with a
barrier after every step - compute (the ranks' batches differ in length: a synchronous step lasts as long as the
slowest rank's); communication not hidden by compute = exact - no-comm; the trainer's own overhead = no-comm - the
bare loop with barriers (data loading, plugins, loss bookkeeping, clipping, DDP's hooks; everything else).
"""

from __future__ import annotations

import statistics
from typing import Any

from preemption import Runs
from section_statistics import training_sizes

FABRIC_VARIANTS = ("auto", "no-comm", "strided", "one-by-one", "fused", "bf16", "powersgd")
EXACT_SAVINGS_VARIANTS = ("auto", "copy-grads", "static", "bucket5", "bucket100")


def _per_step(exact: float, no_comm: float, bare: float, synced: float, steps: int) -> dict[str, float]:
    """Milliseconds per step of a rank: the whole step, and its four parts."""
    return {
        "step_ms": round(1000 * exact / steps, 1),
        "compute_ms": round(1000 * bare / steps, 1),
        "waiting_for_the_slowest_rank_ms": round(1000 * (synced - bare) / steps, 1),
        "communication_not_hidden_ms": round(1000 * (exact - no_comm) / steps, 1),
        "own_overhead_ms": round(1000 * (no_comm - synced) / steps, 1),
    }


def _median_epoch(runs: list[dict[str, Any]], **match: Any) -> float:
    chosen = [run for run in runs if all(run.get(key) == value for key, value in match.items())]
    if not chosen:
        raise ValueError(f"no runs with {match}")
    return statistics.median(seconds for run in chosen for seconds in run["epoch_seconds"])


def communication_section(
    runner: Runs, jobs: list[tuple[Any, int]], devices: int, exact_savings: bool = True
) -> dict[str, Any]:
    """``jobs``: (job, launches) per model."""
    models = {}
    for job, launches in jobs:
        steps = -(-job.train_size // (job.batch_size * devices))
        # PowerSGD is refused where DDP searches for unused parameters (MiniLM's pooler gets no gradient)
        fabric_variants = tuple(v for v in FABRIC_VARIANTS if not (v == "powersgd" and job.model == "minilm"))
        variants = fabric_variants + (EXACT_SAVINGS_VARIANTS[1:] if exact_savings and job.model == "minilm" else ())
        print(
            f"  where a step's time goes, {devices} ranks: {job.model}, {job.train_size} questions, {steps} steps per"
            f" rank, {launches} launch(es); fabric variants {','.join(variants)}",
            flush=True,
        )
        runs: list[dict[str, Any]] = []
        bare_results: list[dict[str, Any]] = []
        plan: list[tuple[str, list[str], int | None]] = [
            ("fabric", [f"--devices={devices}", f"--variants={','.join(variants)}"], None),
            ("native", [f"--devices={devices}", "--native-variant=exact"], None),
            ("native", [f"--devices={devices}", "--native-variant=no-comm"], None),
            ("bare", [f"--devices={devices}"], None),
            ("overhead", [], 1),  # FabricTrainer(devices=1) and flair's ModelTrainer, one process, one thread
        ]
        for launch in range(launches):
            for mode, extra, threads in plan if launch % 2 == 0 else plan[::-1]:
                if mode == "fabric":
                    extra = [*extra, f"--base-path={runner.work_dir / 'communication-base'}"]
                result = runner.run(mode, job, extra, threads=threads)
                runs += [{**run, "mode": mode, "launch": launch} for run in result["runs"]]
                if mode == "bare":
                    bare_results.append(result)

        fabric = {v: _median_epoch(runs, mode="fabric", variant=v) for v in variants}
        native = {v: _median_epoch(runs, mode="native", variant=v) for v in ("exact", "no-comm")}
        bare = _median_epoch(runs, mode="bare", trainer="bare")  # the optimizer as flair builds it
        synced = _median_epoch(runs, mode="bare", trainer="bare-synced")
        bare_grouped = _median_epoch(runs, mode="bare", trainer="bare-grouped")  # FabricTrainer's step, strided
        synced_grouped = _median_epoch(runs, mode="bare", trainer="bare-grouped-synced")
        bare_balanced = _median_epoch(runs, mode="bare", trainer="bare-grouped-balanced")  # as FabricTrainer trains
        synced_balanced = _median_epoch(runs, mode="bare", trainer="bare-grouped-balanced-synced")
        one_process = _median_epoch(runs, mode="overhead", trainer="fabric")
        all_reduce_ms = 1000 * statistics.median(result["all_reduce_seconds_per_step"] for result in bare_results)

        fabric_split = _per_step(fabric["auto"], fabric["no-comm"], bare_balanced, synced_balanced, steps)
        native_split = _per_step(native["exact"], native["no-comm"], bare, synced, steps)
        summary = {
            "steps_per_epoch_per_rank": steps,
            "epoch_seconds": {
                **{f"fabric {v}": round(t, 3) for v, t in fabric.items()},
                **{f"native {v}": round(t, 3) for v, t in native.items()},
                "bare loop": round(bare, 3),
                "bare loop, ranks waiting for each other after every step": round(synced, 3),
                "bare loop, grouped optimizer step (foreach)": round(bare_grouped, 3),
                "bare loop, grouped step, ranks waiting for each other": round(synced_grouped, 3),
                "bare loop, grouped step, steps dealt by length": round(bare_balanced, 3),
                "bare loop, grouped step, dealt by length, ranks waiting for each other": round(synced_balanced, 3),
                "fabric, one process, one thread": round(one_process, 3),
            },
            "per_step": {"fabric": fabric_split, "native": native_split},
            "all_reduce_alone_ms_per_step": round(all_reduce_ms, 1),
            "share_of_communication_hidden": {
                trainer: round(1 - split["communication_not_hidden_ms"] / all_reduce_ms, 3)
                for trainer, split in (("fabric", fabric_split), ("native", native_split))
            },
            "throughput_fabric_over_native": {
                v: round(native["exact"] / fabric[v], 4) for v in variants if v != "no-comm"
            },
            "scaling_efficiency": {
                v: round(one_process / (devices * fabric[v]), 4) for v in variants if v != "no-comm"
            },
            "scaling_efficiency_native": round(one_process / (devices * native["exact"]), 4),
        }
        print(
            f"    -> fabric/native {summary['throughput_fabric_over_native']['auto']:.3f}, efficiency"
            f" {summary['scaling_efficiency']['auto']:.3f}; per step {summary['per_step']}",
            flush=True,
        )
        models[job.model] = {
            "sizes": training_sizes(job, launches=launches, runs_per_launch=job.reps),
            "summary": summary,
            "runs": runs,
        }
    return {"what": __doc__, "models": models}


def _shown_share(share: float) -> str:
    """A share of the all-reduce hidden behind backward; above 1 the exposed part was below the timing noise."""
    return f"{share:.2f}" if share <= 1 else "all (within noise)"


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 9 of the README table, if it was measured."""
    section = results.get("ddp_communication")
    if section is None:
        return []
    lines = [
        "## 9. Where a 2-rank training step goes: FabricTrainer vs flair's own multi_gpu=True (goals: throughput"
        " >= 1.10 x native, scaling efficiency >= 0.85)",
        "",
        "| model | trainer | ms per step | compute | waiting for the slowest rank | communication not hidden |"
        " own overhead | all-reduce alone | share hidden |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, values in section["models"].items():
        summary = values["summary"]
        for trainer, split in summary["per_step"].items():
            lines.append(
                f"| {model} | {trainer} | {split['step_ms']} | {split['compute_ms']} |"
                f" {split['waiting_for_the_slowest_rank_ms']} | {split['communication_not_hidden_ms']} |"
                f" {split['own_overhead_ms']} |"
                f" {summary['all_reduce_alone_ms_per_step']} |"
                f" {_shown_share(summary['share_of_communication_hidden'][trainer])} |"
            )
    lines += [
        "",
        "| model | FabricTrainer variant | epoch s | throughput / flair native | scaling efficiency |",
        "|---|---|---|---|---|",
    ]
    for model, values in section["models"].items():
        summary = values["summary"]
        for variant, ratio in summary["throughput_fabric_over_native"].items():
            lines.append(
                f"| {model} | {variant} | {summary['epoch_seconds'][f'fabric {variant}']} | **{ratio:.3f}** |"
                f" **{summary['scaling_efficiency'][variant]:.3f}** |"
            )
        lines.append(
            f"| {model} | flair native (exact) | {summary['epoch_seconds']['native exact']} | 1 |"
            f" {summary['scaling_efficiency_native']:.3f} |"
        )
    lines += [
        "",
        "Compute = the bare loop (forward_loss, backward, optimizer step) on the same batches in 2 concurrent "
        "processes, each on its own, with the optimizer each trainer builds (flair: one parameter at a time; "
        "FabricTrainer: foreach=True, bit-equal); waiting for the slowest rank = the same with a barrier after "
        "every step - compute; communication not hidden = exact - a DDP hook that exchanges nothing; own overhead "
        "= that hook run - the bare loop with barriers; all-reduce alone = the same bytes all-reduced in 25 MiB "
        "buckets with nothing else running, and share hidden = 1 - not hidden / alone (the overlap of "
        "communication with backward). Scaling efficiency: FabricTrainer on one process with one thread, epoch "
        "time / (2 x the 2-rank epoch time). 'auto' is the default (exact); 'one-by-one' steps the optimizer as "
        "flair does (foreach=False, the default before the grouped step); 'fused' is PyTorch's fused step (opt-in: "
        "fused=True; not bit-equal); 'copy-grads' is gradient_as_bucket_view=False (the old default), 'static' "
        "static_graph=True, 'bucketN' bucket_cap_mb=N (default 25).",
        "",
        "A MiniLM 'powersgd' row, where present, is not a PowerSGD measurement: its 8 steps per epoch end before"
        " PowerSGD starts (step 10), so it all-reduced exact gradients; PowerSGD is now refused for MiniLM (its pooler"
        " gets no gradient, and PowerSGD with find_unused_parameters=True puts the ranks' collectives out of step).",
        "",
    ]
    return lines
