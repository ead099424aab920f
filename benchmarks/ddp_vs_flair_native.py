"""Section 2 of ``benchmarks/run.py``: ``FabricTrainer(devices=2)`` against flair's own ``multi_gpu=True`` on 2 CPU
processes, samples per second (``worker.py fabric`` and ``worker.py native``)."""

from __future__ import annotations

import statistics
from typing import Any

from plans import MODEL_DESCRIPTIONS, Job
from section_statistics import epoch_samples_per_second, r, shown
from worker_runner import Runner

NATIVE_SHIM = (
    "flair's multi_gpu=True calls DistributedDataParallel(model, device_ids=[flair.device.index], "
    "find_unused_parameters=True); on CPU that is device_ids=[None], which torch rejects. Inside the benchmark's "
    "flair-native worker only, flair.trainers.trainer.DistributedDataParallel is replaced by a function that drops "
    "device_ids=[None] (device_ids=None) and passes everything else unchanged. The benchmark starts the processes "
    "itself (torch.multiprocessing.spawn, init_process_group('gloo') on a free port, flair.device=cpu): flair's own "
    "launch_distributed() does the same but supports only CUDA/NCCL."
)


def ddp_section(runner: Runner, jobs: list[tuple[Job, int]], devices: int) -> dict[str, Any]:
    models = {}
    for job, launches in jobs:
        print(
            f"  {devices} ranks, FabricTrainer vs flair multi_gpu: {job.model}, {job.train_size} questions,"
            f" {launches} launch(es) x {job.reps} run(s) each",
            flush=True,
        )
        fabric_variants = "auto,true" if job.model == "rnn" else "auto"
        fabric_runs: list[dict[str, Any]] = []
        native_runs: list[dict[str, Any]] = []
        launch_ratios = []
        for launch in range(launches):
            order = ("fabric", "native") if launch % 2 == 0 else ("native", "fabric")
            launch_sps = {}
            for which in order:
                if which == "fabric":
                    extra = [
                        f"--devices={devices}",
                        f"--variants={fabric_variants}",
                        f"--base-path={runner.work_dir / 'fabric-base'}",
                    ]
                    runs = runner.run("fabric", job, extra)["runs"]
                    for run in runs:
                        run["launch"] = launch
                    fabric_runs += runs
                    auto = [run for run in runs if run["variant"] == "auto"]
                    launch_sps[which] = statistics.median(epoch_samples_per_second(auto, job.train_size))
                else:
                    runs = runner.run("native", job, [f"--devices={devices}"])["runs"]
                    for run in runs:
                        run["launch"] = launch
                    native_runs += runs
                    launch_sps[which] = statistics.median(epoch_samples_per_second(runs, job.train_size))
            launch_ratios.append(launch_sps["fabric"] / launch_sps["native"])

        native_sps = statistics.median(epoch_samples_per_second(native_runs, job.train_size))
        variants: dict[str, Any] = {}
        for variant in fabric_variants.split(","):
            runs = [run for run in fabric_runs if run["variant"] == variant]
            sps = statistics.median(epoch_samples_per_second(runs, job.train_size))
            variants[variant] = {
                "strategy": "'auto' (default)"
                if variant == "auto"
                else "FlairDDPStrategy(find_unused_parameters=True)",
                "find_unused_parameters_used": sorted({run["find_unused_parameters"] for run in runs}),
                "median_samples_per_second": r(sps, 2),
                "ratio_over_flair_native": r(sps / native_sps),
            }
        models[job.model] = {
            "model": MODEL_DESCRIPTIONS[job.model],
            "sizes": {
                "train_size": job.train_size,
                "mini_batch_size_per_process": job.batch_size,
                "global_batch_size": job.batch_size * devices,
                "epochs_per_run": job.epochs,
                "steps_per_epoch_per_rank": -(-job.train_size // (job.batch_size * devices)),
                "learning_rate": job.learning_rate,
                "launches_per_trainer": launches,
                "runs_per_launch": job.reps,
            },
            "summary": {
                "flair_native_median_samples_per_second": r(native_sps, 2),
                "fabric": variants,
                "median_ratio_fabric_auto_over_native": variants["auto"]["ratio_over_flair_native"],
                "launch_ratios_fabric_auto_over_native": [r(x) for x in launch_ratios],
                "goal": "ratio >= 1.0 (FabricTrainer at least as fast)",
                "meets_goal": variants["auto"]["ratio_over_flair_native"] >= 1.0,
            },
            "fabric_runs": fabric_runs,
            "native_runs": native_runs,
        }
        print(
            f"    -> samples/s: fabric {variants['auto']['median_samples_per_second']:.1f}"
            f" (find_unused={variants['auto']['find_unused_parameters_used']}),"
            f" flair native {native_sps:.1f}, ratio {variants['auto']['ratio_over_flair_native']:.3f}",
            flush=True,
        )
    return {
        "what": f"Global training throughput on {devices} CPU processes (gloo): training data points of an epoch / "
        "that epoch's training time on rank 0 (same TrainerPlugin in both), median over all timed epochs. "
        "FabricTrainer(accelerator='cpu', devices=2) is started as a script that Fabric relaunches; flair's "
        "ModelTrainer.train/fine_tune(multi_gpu=True) runs in 2 processes started by the benchmark. Same seeded "
        "model, same mini_batch_size per process (same global batch), shuffle=False (both trainers then give each "
        "rank the same batches), no dev/test split. Launches alternate fabric/native; each launch does one untimed "
        "warm-up run, then the timed runs. flair native always uses find_unused_parameters=True; for the RNN, "
        "FabricTrainer is also measured with find_unused_parameters=True forced, the like-for-like comparison.",
        "shim": NATIVE_SHIM,
        "models": models,
    }


def markdown_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Section 2 of the README table, if it was measured."""
    lines: list[str] = []
    if "ddp_vs_flair_native" in results:
        section = results["ddp_vs_flair_native"]
        lines += [
            "## 2. Two CPU processes: FabricTrainer(devices=2) vs flair's own multi_gpu=True (goal: ratio >= 1.0)",
            "",
            "| model | train size / batch per process | runs each | flair native samples/s | FabricTrainer strategy"
            " | find_unused_parameters | fabric samples/s | ratio fabric/native |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, m in section["models"].items():
            s, z = m["summary"], m["sizes"]
            runs = z["launches_per_trainer"] * z["runs_per_launch"]
            for v in s["fabric"].values():
                lines.append(
                    f"| {name} | {z['train_size']} / {z['mini_batch_size_per_process']} | {runs} |"
                    f" {s['flair_native_median_samples_per_second']:.1f} | {v['strategy']} |"
                    f" {shown(v['find_unused_parameters_used'])} | {v['median_samples_per_second']:.1f} |"
                    f" **{v['ratio_over_flair_native']:.3f}** |"
                )
        lines += [
            "",
            "flair native always runs DDP with find_unused_parameters=True."
            " Per-launch ratios (fabric 'auto' / native): "
            + "; ".join(
                f"{name} {m['summary']['launch_ratios_fabric_auto_over_native']}"
                for name, m in section["models"].items()
            )
            + ".",
            "",
            f"Shim (benchmark only): {section['shim']}",
            "",
        ]
    return lines
