"""Ray Train as an engine (docs/elastic.md): the restart after a lost worker, part by part, and the steady-state step
time under Ray against the same run under torchrun.

The run: 2 CPU processes, the one-hot + GRU TREC classifier of ``common.build_model("rnn")`` on ``--train-size``
questions, ``global_batch_size=16``, step checkpoints every 10 steps, 2 epochs. Each process records the wall clock
(``time.time()``, one machine) at the end of every optimizer step.

- **restart**: under Ray (a local cluster, 2 CPUs, no dashboard; ``FailureConfig(max_failures=1)``) global rank 1
  ends its process after step ``--lose-after`` on the first attempt. Parts, on global rank 0 of the second attempt:
  the failure (rank 1's clock just before it exits) to the training function's start (Ray notices, tears down and
  starts a new group and its process group); then to ``fine_tune`` being called (imports, corpus and model); then to
  the end of the first step after it (checks, set-up, loading the checkpoint, the step).
- **steady state**: the median time between consecutive steps of an epoch (its first step left out), global rank 0,
  without a failure, under Ray and under ``torchrun --nproc_per_node=2``, in alternating order.

    python benchmarks/ray_train.py [--quick]

Results: ``benchmarks/results/ray_train.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from common import free_port, machine  # noqa: E402


def _plugin(times_file: Path, lose_after: int | None, marker: Path | None) -> Any:
    """A flair plugin: each step's end on the wall clock (global rank 0 writes them at the end); global rank 1 of the
    first attempt ends its process after step ``lose_after``, writing the moment to ``marker`` first."""
    from flair.trainers.plugins import TrainerPlugin

    class StepClock(TrainerPlugin):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[tuple[int, int, float]] = []
            self.epoch = 0

        @TrainerPlugin.hook
        def before_training_epoch(self, epoch: int, **kw: Any) -> None:
            self.epoch = epoch

        @TrainerPlugin.hook
        def after_training_batch(self, **kw: Any) -> None:
            trainer: Any = self.trainer
            self.steps.append((trainer.optimizer_steps, self.epoch, time.time()))
            lost = lose_after is not None and marker is not None and trainer.optimizer_steps == lose_after
            if lost and trainer.global_rank == 1 and not marker.exists():  # type: ignore[union-attr]
                marker.write_text(str(time.time()))
                os._exit(1)
            if trainer.global_rank == 0 and len(self.steps) == 1:  # the first step of this attempt, at once
                times_file.with_suffix(".first").write_text(json.dumps(self.steps[0]))

        @TrainerPlugin.hook
        def after_training(self, **kw: Any) -> None:
            if self.trainer.global_rank == 0:  # type: ignore[union-attr]
                times_file.write_text(json.dumps(self.steps))

    return StepClock()


def run_once(base_path: str, times_file: Path, train_size: int, lose_after: int | None, marker: Path | None) -> None:
    """The benchmark's run in this process (a Ray worker or a torchrun rank)."""
    started = time.time()
    from common import build_model, quiet_flair, train_only_corpus

    from flair_fabric import FabricTrainer

    quiet_flair()
    corpus = train_only_corpus(train_size)
    model = build_model("rnn", corpus)
    called = time.time()
    if os.environ.get("RANK", "0") == "0":
        import torch

        record = {"function": started, "fine_tune": called, "torch_threads": torch.get_num_threads()}
        times_file.with_suffix(".start").write_text(json.dumps(record))
    FabricTrainer(model, corpus).train(
        base_path,
        max_epochs=2,
        global_batch_size=16,
        learning_rate=0.1,
        checkpoint_every_n_steps=10,
        accelerator="cpu",
        devices="auto",
        progress_bar=False,
        create_file_logs=False,
        plugins=[_plugin(times_file, lose_after, marker)],
    )


def _ray_function(config: dict) -> None:
    marker = Path(config["marker"]) if config.get("marker") else None
    run_once(config["base_path"], Path(config["times"]), config["train_size"], config.get("lose_after"), marker)


def under_ray(work: Path, train_size: int, lose_after: int | None) -> dict[str, Any]:
    """One run in 2 Ray Train workers (a worker lost after ``lose_after`` steps on the first attempt, if given)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    times = work / "times.json"
    config = {"base_path": str(work / "run"), "times": str(times), "train_size": train_size}
    if lose_after is not None:
        config |= {"lose_after": lose_after, "marker": str(work / "lost")}
    TorchTrainer(
        _ray_function,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo", timeout_s=120),
        run_config=RunConfig(
            storage_path=str(work / "ray"), name="bench", failure_config=FailureConfig(max_failures=1)
        ),
    ).fit()
    return _read(times, work / "lost")


def under_torchrun(work: Path, train_size: int) -> dict[str, Any]:
    """The same run under ``torchrun --nproc_per_node=2`` (this file as the script)."""
    times = work / "times.json"
    port = f"--master_port={free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", port, __file__]
    command += ["--worker", str(work / "run"), str(times), str(train_size)]
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return _read(times, None)


def _read(times: Path, marker: Path | None) -> dict[str, Any]:
    steps = json.loads(times.read_text())
    read: dict[str, Any] = {"steps": steps, "start": json.loads(times.with_suffix(".start").read_text())}
    read["first"] = json.loads(times.with_suffix(".first").read_text())
    if marker is not None and marker.exists():
        read["lost_at"] = float(marker.read_text())
    return read


def steady_step_seconds(steps: list[list[float]]) -> float:
    """The median seconds between consecutive steps of the same epoch, each epoch's first step left out."""
    gaps = [b[2] - a[2] for a, b in itertools.pairwise(steps) if a[1] == b[1] and b[0] == a[0] + 1]
    return statistics.median(gaps[1:] if len(gaps) > 2 else gaps)


def restart_parts(run: dict[str, Any]) -> dict[str, float]:
    """The restart after the lost worker, part by part (seconds)."""
    lost, start, first = run["lost_at"], run["start"], run["first"]
    return {
        "failure_to_training_function": round(start["function"] - lost, 2),
        "training_function_to_fine_tune": round(start["fine_tune"] - start["function"], 2),
        "fine_tune_to_first_step_done": round(first[2] - start["fine_tune"], 2),
        "failure_to_first_step_done": round(first[2] - lost, 2),
        "first_step_after_restart": first[0],
    }


def markdown(results: dict[str, Any]) -> str:
    restart, steady = results["restart"], results["steady_state"]
    lines = [
        "# Ray Train: restart after a lost worker, steady-state steps against torchrun",
        "",
        f"`benchmarks/ray_train.py{' --quick' if results['quick'] else ''}`, {results['finished_utc']}; ray"
        f" {results['ray']}; {results['machine']['cpu_count']} CPUs, no GPU; load average (1/5/15 min)"
        f" {results['load_average_start']} at start, {results['load_average_end']} at end"
        + (
            ": nothing else ran on the machine."
            if results["load_average_start"][0] < 1.0
            else ". The machine was shared with other work: the figures are of a loaded machine."
        ),
        "",
        f"2 CPU processes, one-hot + GRU TREC classifier, {results['train_size']} questions, global batch 16,"
        " checkpoints every 10 steps, 2 epochs.",
        "",
        f"## Restart (global rank 1 lost after step {results['lose_after']}, Ray restarts the group)",
        "",
        "| part | seconds |",
        "|---|---|",
        *(f"| {name.replace('_', ' ')} | {value} |" for name, value in restart.items()),
        "",
        "## Steady-state step time (median seconds between steps, global rank 0)",
        "",
        "| round | Ray Train | torchrun | Ray / torchrun |",
        "|---|---|---|---|",
        *(
            f"| {n + 1} | {r:.4f} | {t:.4f} | {r / t:.3f} |"
            for n, (r, t) in enumerate(zip(steady["ray"], steady["torchrun"], strict=True))
        ),
        f"| median | {statistics.median(steady['ray']):.4f} | {statistics.median(steady['torchrun']):.4f} |"
        f" {steady['ratio_of_medians']:.3f} |",
        "",
        f"torch threads per process: {steady['torch_threads_per_process']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of each, fewer questions")
    parser.add_argument("--worker", nargs=3, metavar=("BASE", "TIMES", "TRAIN_SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # a torchrun rank
        run_once(args.worker[0], Path(args.worker[1]), int(args.worker[2]), None, None)
        return 0
    import ray

    train_size, rounds, lose_after = (320, 1, 25) if args.quick else (800, 3, 60)
    load_start = [round(value, 2) for value in os.getloadavg()]
    environment = {"PYTHONPATH": f"{REPO}:{HERE}", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": environment}, log_to_driver=False)
    steady: dict[str, list[float]] = {"ray": [], "torchrun": []}
    threads: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as folder:
        work = Path(folder)
        for number in range(rounds):
            for engine in ("ray", "torchrun"):
                (work / f"{engine}-{number}").mkdir()
                run = (
                    under_ray(work / f"ray-{number}", train_size, None)
                    if engine == "ray"
                    else under_torchrun(work / f"torchrun-{number}", train_size)
                )
                steady[engine].append(steady_step_seconds(run["steps"]))
                threads[engine] = run["start"]["torch_threads"]
        (work / "restart").mkdir()
        restart = restart_parts(under_ray(work / "restart", train_size, lose_after))
    ray.shutdown()
    import ray as ray_module

    results = {
        "quick": args.quick,
        "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ray": ray_module.__version__,
        "machine": machine(),
        "load_average_start": load_start,
        "load_average_end": [round(value, 2) for value in os.getloadavg()],
        "train_size": train_size,
        "lose_after": lose_after,
        "restart": restart,
        "steady_state": {
            **steady,
            "ratio_of_medians": statistics.median(steady["ray"]) / statistics.median(steady["torchrun"]),
            "torch_threads_per_process": threads,
        },
    }
    out = HERE / "results"
    (out / "ray_train.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "ray_train.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
