"""flair-fabric benchmarks: ``make bench`` (about 11 minutes on 2 CPU cores) or ``--quick`` (about 3 minutes).

1. overhead_one_device: FabricTrainer(devices=1) vs flair's ModelTrainer, training time per epoch.
2. ddp_vs_flair_native: FabricTrainer(devices=2) vs flair's own multi_gpu=True on 2 CPU processes, samples/s.
3. find_unused_parameters: FabricTrainer(devices=2) with DDP's unused-parameter search forced on vs off.
4. sharded_evaluation: evaluating a dev split with flair_fabric.evaluate on 2 processes vs flair's evaluate in one.
5. ddp_vs_fsdp: memory and time of strategy="fsdp" vs "ddp".
6. checkpoint_cost, 7. resume_latency: preemption-proof training (``preemption.py``).
8. end_to_end_fine_tune: a whole fine_tune (dev every epoch, final test) vs flair's multi_gpu=True (``end_to_end.py``).
9. ddp_communication: where a 2-rank step's time goes; exact defaults, compression (``ddp_communication.py``).

Every measurement runs in fresh worker processes (``worker.py``); results go to ``<out-dir>/<name>.json`` and a
table to ``<out-dir>/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ddp_communication
import end_to_end
import preemption

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"

NATIVE_SHIM = (
    "flair's multi_gpu=True calls DistributedDataParallel(model, device_ids=[flair.device.index], "
    "find_unused_parameters=True); on CPU that is device_ids=[None], which torch rejects. Inside the benchmark's "
    "flair-native worker only, flair.trainers.trainer.DistributedDataParallel is replaced by a function that drops "
    "device_ids=[None] (device_ids=None) and passes everything else unchanged. The benchmark starts the processes "
    "itself (torch.multiprocessing.spawn, init_process_group('gloo') on a free port, flair.device=cpu): flair's own "
    "launch_distributed() does the same but supports only CUDA/NCCL."
)


@dataclass(frozen=True)
class Job:
    """One model's sizes for one section."""

    model: str
    train_size: int
    batch_size: int
    epochs: int
    learning_rate: float
    reps: int

    def worker_args(self) -> list[str]:
        return [
            f"--model={self.model}",
            f"--train-size={self.train_size}",
            f"--batch-size={self.batch_size}",
            f"--epochs={self.epochs}",
            f"--learning-rate={self.learning_rate}",
            f"--reps={self.reps}",
        ]


RNN_LR = 0.1
MINILM_LR = 5e-5

# (overhead jobs, ddp jobs with their number of launches per trainer, find_unused job and its launches)
PLANS: dict[str, dict[str, Any]] = {
    "full": {
        "overhead": [Job("rnn", 2048, 16, 1, RNN_LR, 8), Job("minilm", 192, 16, 1, MINILM_LR, 4)],
        "ddp": [(Job("rnn", 2048, 16, 2, RNN_LR, 3), 2), (Job("minilm", 256, 16, 1, MINILM_LR, 3), 2)],
        "find_unused": (Job("rnn", 2048, 16, 2, RNN_LR, 4), 2),
        "evaluation": (Job("minilm", 500, 32, 1, 0.0, 3), 2),
        "sharding": (Job("minilm", 256, 16, 1, MINILM_LR, 2), 2),
        "checkpointing": (Job("minilm", 1920, 8, 1, MINILM_LR, 2), 50),
        "resume": (Job("minilm", 800, 8, 1, MINILM_LR, 1), 5, 2),
        "end_to_end": (Job("minilm", 256, 16, 2, MINILM_LR, 2), 2, 500),
        "communication": [(Job("minilm", 512, 16, 1, MINILM_LR, 2), 3), (Job("rnn", 2048, 16, 2, RNN_LR, 3), 2)],
    },
    "quick": {
        "overhead": [Job("rnn", 512, 16, 1, RNN_LR, 2), Job("minilm", 64, 16, 1, MINILM_LR, 2)],
        "ddp": [(Job("rnn", 512, 16, 1, RNN_LR, 1), 1), (Job("minilm", 128, 16, 1, MINILM_LR, 1), 1)],
        "find_unused": (Job("rnn", 512, 16, 1, RNN_LR, 2), 1),
        "evaluation": (Job("minilm", 96, 16, 1, 0.0, 1), 1),
        "sharding": (Job("minilm", 64, 16, 1, MINILM_LR, 1), 1),
        "checkpointing": (Job("minilm", 192, 8, 1, MINILM_LR, 1), 4),
        "resume": (Job("minilm", 160, 8, 1, MINILM_LR, 1), 1, 1),
        "end_to_end": (Job("minilm", 64, 16, 1, MINILM_LR, 1), 1, 64),
        "communication": [(Job("minilm", 64, 16, 1, MINILM_LR, 1), 1), (Job("rnn", 512, 16, 1, RNN_LR, 1), 1)],
    },
}

MODEL_DESCRIPTIONS = {
    "rnn": "TextClassifier(DocumentRNNEmbeddings([OneHotEmbeddings.from_corpus(min_freq=1, 64 dims)], GRU 64)), "
    "trainer.train (SGD)",
    "minilm": "TextClassifier(TransformerDocumentEmbeddings(all-MiniLM-L6-v2, fine_tune=True)), "
    "trainer.fine_tune (AdamW, linear schedule)",
}


# --- running workers --------------------------------------------------------------------------------------------


class Runner:
    """Starts worker processes with one environment and collects their JSON output."""

    def __init__(self, threads: int, timeout: float, work_dir: Path, verbose: bool) -> None:
        self.threads = threads
        self.timeout = timeout
        self.work_dir = work_dir
        self.verbose = verbose
        self.count = 0

    def run(self, mode: str, job: Job, extra: list[str] | None = None, threads: int | None = None) -> dict[str, Any]:
        self.count += 1
        threads = threads or self.threads
        out = self.work_dir / f"{self.count:02d}-{mode}-{job.model}.json"
        log_path = out.with_suffix(".log")
        command = [sys.executable, str(WORKER), mode, *job.worker_args(), f"--out={out}", *(extra or [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        env.pop("LOCAL_RANK", None)  # a worker that sees LOCAL_RANK would not start its own processes
        started, started_at = time.perf_counter(), time.time()
        with log_path.open("w", encoding="utf-8") as log_file:
            process = subprocess.Popen(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the worker and the ranks it started, nothing else
                process.wait()
        wall = time.perf_counter() - started
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        progress = [
            line
            for line in log_text.splitlines()
            if line.startswith(
                (
                    "[overhead ",
                    "[fabric ",
                    "[native ",
                    "[evaluate ",
                    "[sharding ",
                    "[checkpointing ",
                    "[whole-",
                    "[bare",
                )
            )
        ]
        for line in progress if self.verbose else progress[-1:]:
            print(f"    {line}", flush=True)
        if process.returncode != 0 or not out.exists():
            tail = "\n".join(log_text.splitlines()[-40:])
            raise RuntimeError(f"worker failed (exit {process.returncode}): {' '.join(command)}\n{tail}")
        result = json.loads(out.read_text(encoding="utf-8"))
        result["process_wall_seconds"] = round(wall, 1)
        result["process_started_at"] = started_at
        return result


# --- statistics ---------------------------------------------------------------------------------------------------


def rep_seconds(run: dict[str, Any], key: str = "epoch_seconds") -> float:
    return float(sum(run[key]))


def epoch_samples_per_second(runs: list[dict[str, Any]], train_size: int) -> list[float]:
    """Global training data points of one epoch / that epoch's training time on rank 0, for every epoch."""
    return [train_size / seconds for run in runs for seconds in run["epoch_seconds"]]


def r(value: float, digits: int = 4) -> float:
    return round(value, digits)


# --- sections -----------------------------------------------------------------------------------------------------


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
        "sizes": {
            "train_size": job.train_size,
            "mini_batch_size_per_process": job.batch_size,
            "epochs_per_run": job.epochs,
            "learning_rate": job.learning_rate,
            "launches": launches,
            "runs_per_setting_per_launch": job.reps,
        },
        "summary": summary,
        "runs": runs,
    }


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
        "sizes": {
            "train_size": job.train_size,
            "mini_batch_size_per_process": job.batch_size,
            "epochs_per_run": job.epochs,
            "learning_rate": job.learning_rate,
            "launches_per_strategy": launches,
            "runs_per_launch": job.reps,
        },
        "summary": summary,
        "runs": runs,
    }


# --- report -------------------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Machine and versions, read in a child process so that this one never imports torch."""
    code = "import json, common; print(json.dumps(common.machine()))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    output = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def shown(values: list[Any]) -> str:
    return str(values[0]) if len(values) == 1 else "/".join(str(v) for v in values)


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The README table, from the results as written to the JSON files."""
    first = next(iter(results.values()))
    machine, mode = first["machine"], first["mode"]
    lines = [
        "# flair-fabric benchmarks",
        "",
        f"`benchmarks/run.py{' --quick' if mode == 'quick' else ''}`, finished {first['finished_utc']},"
        f" {first['bench_wall_seconds'] / 60:.1f} min. Machine: {machine['cpu_count']} CPUs ({machine['processor']}),"
        f" no GPU; torch {machine['torch']}, flair {machine['flair']}, lightning {machine['lightning']},"
        f" transformers {machine['transformers']}, Python {machine['python']};"
        f" {first['torch_threads_per_process']} torch thread(s) per process (OMP_NUM_THREADS);"
        f" load average (1/5/15 min) {machine['load_average_1_5_15']} at start,"
        f" {first['load_average_1_5_15_at_end']} at end.",
        "",
        *(
            ["**Quick mode: a smoke run with one or two repetitions of tiny workloads; the numbers mean little.**", ""]
            if mode == "quick"
            else []
        ),
        "Sections 1-3: only the training part of each epoch is timed (one TrainerPlugin, before_training_epoch to"
        " after_training_epoch, in both trainers); no dev/test evaluation, no model files; same seeded model and"
        " same batches (shuffle=False) for both sides. Raw timings and the exact method: the JSON files next to this"
        " one.",
        "",
    ]
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
    lines += preemption.markdown_lines(results)
    lines += end_to_end.markdown_lines(results)
    lines += ddp_communication.markdown_lines(results)
    lines += [
        "Timings on a shared or busy machine are noisy: rerun `make bench` on a quiet one before quoting them.",
        "",
    ]
    return "\n".join(lines)


SECTION_NAMES = (
    "overhead_one_device",
    "ddp_vs_flair_native",
    "find_unused_parameters",
    "sharded_evaluation",
    "ddp_vs_fsdp",
    "checkpoint_cost",
    "resume_latency",
    "end_to_end_fine_tune",
    "ddp_communication",
)


SECTIONS = (
    "overhead",
    "ddp",
    "find_unused",
    "evaluation",
    "sharding",
    "checkpointing",
    "resume",
    "end_to_end",
    "communication",
)


def write_readme(out_dir: Path) -> None:
    """README.md from every section's JSON file in ``out_dir`` (so ``--only`` keeps the other sections)."""
    found = [out_dir / f"{name}.json" for name in SECTION_NAMES if (out_dir / f"{name}.json").exists()]
    if not found:
        raise SystemExit(f"no results in {out_dir}: run the benchmarks first")
    saved = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in found}
    (out_dir / "README.md").write_text(markdown(saved), encoding="utf-8")
    print(f"wrote {out_dir / 'README.md'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition: a smoke run (~2 min)")
    parser.add_argument(
        "--out-dir", type=Path, help="default: benchmarks/results (benchmarks/results/quick with --quick)"
    )
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="run only these sections (README.md is rebuilt from all JSON files in the folder)",
    )
    parser.add_argument("--devices", type=int, default=2, help="processes for sections 2 and 3 (default: 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads per process (default: CPUs / 2)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per worker process (default: 900)")
    parser.add_argument("--verbose", action="store_true", help="print every timed run")
    parser.add_argument("--readme-only", action="store_true", help="rewrite README.md from the JSON files, run nothing")
    args = parser.parse_args()

    mode = "quick" if args.quick else "full"
    plan = PLANS[mode]
    out_dir = args.out_dir or (HERE / "results" / "quick" if args.quick else HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.readme_only:
        write_readme(out_dir)
        return
    sections = args.only or list(SECTIONS)
    started = time.perf_counter()
    machine = machine_info()
    print(
        f"flair-fabric benchmarks ({mode}): {machine['cpu_count']} CPUs, torch {machine['torch']}, flair"
        f" {machine['flair']}, lightning {machine['lightning']}; {args.threads} thread(s) per process",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="flair-fabric-bench-") as work_dir:
        runner = Runner(args.threads, args.timeout, Path(work_dir), args.verbose)
        if "overhead" in sections:
            results["overhead_one_device"] = overhead_section(runner, plan["overhead"])
        if "ddp" in sections:
            results["ddp_vs_flair_native"] = ddp_section(runner, plan["ddp"], args.devices)
        if "find_unused" in sections:
            job, launches = plan["find_unused"]
            results["find_unused_parameters"] = find_unused_section(runner, job, launches, args.devices)
        if "evaluation" in sections:
            job, launches = plan["evaluation"]
            results["sharded_evaluation"] = evaluation_section(runner, job, launches, args.devices)
        if "sharding" in sections:
            job, launches = plan["sharding"]
            results["ddp_vs_fsdp"] = sharding_section(runner, job, launches, args.devices)
        if "checkpointing" in sections:
            job, every = plan["checkpointing"]
            results["checkpoint_cost"] = preemption.checkpoint_cost_section(runner, job, args.devices, every)
        if "resume" in sections:
            job, every, launches = plan["resume"]
            results["resume_latency"] = preemption.resume_latency_section(runner, job, args.devices, every, launches)
        if "end_to_end" in sections:
            job, launches, dev_size = plan["end_to_end"]
            results["end_to_end_fine_tune"] = end_to_end.end_to_end_section(
                runner, job, args.devices, launches, dev_size
            )
        if "communication" in sections:
            results["ddp_communication"] = ddp_communication.communication_section(
                runner, plan["communication"], args.devices
            )
    wall = time.perf_counter() - started
    common = {
        "mode": mode,
        "machine": machine,
        "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        "torch_threads_per_process": args.threads,
        "bench_wall_seconds": r(wall, 1),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results = {name: {"name": name, **common, **section} for name, section in results.items()}
    for name, result in results.items():
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    write_readme(out_dir)
    print(f"benchmarks done in {wall / 60:.1f} min")


if __name__ == "__main__":
    main()
