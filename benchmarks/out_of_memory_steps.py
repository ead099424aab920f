"""What ``mini_batch_chunk_size="auto"`` costs when no step runs out of memory (issue 32).

all-MiniLM-L6-v2 fine-tuned on TREC questions by ``FabricTrainer`` on 2 CPU processes (DDP, forked workers), the
same run with flair's default ``mini_batch_chunk_size=None`` (DDP synchronises in the backward pass) and with
``"auto"`` (no DDP collective in a pass, flair-fabric's gradient sum during the last backward pass, one
agreement on the host per step).
The runs alternate (plain, auto, plain, auto, ...) so that the machine's drift falls on both; a plugin on global
rank 0 notes when each step ends, and the median step time of each mode (first steps of each run left out) is
reported with their ratio. Then one run with an injected out-of-memory error on rank 1 in the first step shows what
a retried step costs.

    python benchmarks/out_of_memory_steps.py   # results in benchmarks/results/out_of_memory_steps.{json,md}
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
from common import build_model, machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TRAIN, BATCH, REPEATS, WARM_UP = 640, 16, 8, 3  # 320 per rank in batches of 16: 20 steps per run


def main() -> None:
    import flair
    from flair.trainers.plugins import TrainerPlugin

    from flair_fabric import FabricTrainer
    from flair_fabric.datasets import trec_corpus

    class Clock(TrainerPlugin):
        """When each step ended, on global rank 0 (written to a file: the workers are forked)."""

        def __init__(self, path: Path) -> None:
            super().__init__()
            self.path = path

        @TrainerPlugin.hook
        def before_training_epoch(self, **kw: Any) -> None:
            self._note(0)

        @TrainerPlugin.hook
        def after_training_batch(self, batch_count: int, **kw: Any) -> None:
            self._note(batch_count)

        def _note(self, step: int) -> None:
            if self.trainer.is_global_zero:  # type: ignore[attr-defined]
                with self.path.open("a") as file:
                    file.write(f"{step} {time.perf_counter()}\n")

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/out-of-memory-steps")
    corpus = trec_corpus(train_size=TRAIN, dev_size=16, test_size=0, seed=42)

    def run(mode: str, number: int, fail_first_step: bool = False) -> list[float]:
        folder = out / f"{mode}-{number}"
        clock_file = folder / "clock.txt"
        folder.mkdir(parents=True, exist_ok=True)
        clock_file.unlink(missing_ok=True)
        flair.set_seed(1)
        model = build_model("minilm", corpus)
        if fail_first_step:
            train_on, failed = type(model).forward_loss, []

            def forward_loss(self: Any, points: list) -> Any:
                if torch.distributed.get_rank() == 1 and not failed and len(points) > BATCH // 2:
                    failed.append(len(points))
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                return train_on(self, points)

            model.forward_loss = types.MethodType(forward_loss, model)  # type: ignore[method-assign]
        FabricTrainer(model, corpus).fine_tune(
            folder,
            max_epochs=1,
            mini_batch_size=BATCH,
            mini_batch_chunk_size="auto" if mode == "auto" else None,
            learning_rate=5e-5,
            accelerator="cpu",
            devices=2,
            strategy="ddp_fork",
            plugins=[Clock(clock_file)],
            create_file_logs=False,
            save_final_model=False,
            shuffle=False,
        )
        ends = [float(line.split()[1]) for line in clock_file.read_text().splitlines()]
        return [later - earlier for earlier, later in itertools.pairwise(ends)]

    steps: dict[str, list[float]] = {"plain": [], "auto": []}
    first_steps: dict[str, list[float]] = {"plain": [], "auto": []}
    run_medians: dict[str, list[float]] = {"plain": [], "auto": []}
    for number in range(REPEATS):
        for mode in ("plain", "auto"):
            seconds = run(mode, number)
            first_steps[mode].append(seconds[0])
            steps[mode] += seconds[WARM_UP:]
            run_medians[mode].append(statistics.median(seconds[WARM_UP:]))
    plain, auto = statistics.median(steps["plain"]), statistics.median(steps["auto"])
    # each auto run against the plain run just before it (the same batches): how much the ratio moves run to run
    pair_ratios = [a / p for p, a in zip(run_medians["plain"], run_medians["auto"], strict=True)]
    retried = run("auto", REPEATS, fail_first_step=True)
    result = {
        "model": "minilm",
        "processes": 2,
        "strategy": "ddp_fork",
        "mini_batch_size_per_rank": BATCH,
        "steps_per_mode": len(steps["plain"]),
        "median_step_seconds_plain": plain,
        "median_step_seconds_auto": auto,
        "auto_over_plain": auto / plain,
        "auto_over_plain_per_pair_of_runs": pair_ratios,
        "step_seconds_plain": steps["plain"],
        "step_seconds_auto": steps["auto"],
        "first_step_seconds": first_steps,
        "retried_run_step_seconds": retried,
        "machine": machine(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "out_of_memory_steps.json").write_text(json.dumps(result, indent=2) + "\n")
    spread = statistics.quantiles(steps["plain"], n=4)
    table = [
        "# mini_batch_chunk_size='auto' without out-of-memory errors: MiniLM on TREC, 2 CPU processes (DDP)",
        "",
        f"{REPEATS} runs per mode, alternating; {len(steps['plain'])} steps per mode after {WARM_UP} warm-up steps"
        " per run.",
        "",
        "| mode | median step (s) | x plain |",
        "|---|---|---|",
        f"| `None` (DDP synchronises in the backward pass) | {plain:.4f} | 1.000 |",
        f"| `'auto'` (flair-fabric's overlapped gradient sum, agreement on the host) | {auto:.4f}"
        f" | {auto / plain:.3f} |",
        "",
        f"Spread of the plain steps (quartiles): {spread[0]:.4f} to {spread[2]:.4f} s. Per pair of runs (an auto run"
        f" against the plain run before it), the ratio of their median steps: median"
        f" {statistics.median(pair_ratios):.3f}, from {min(pair_ratios):.3f} to {max(pair_ratios):.3f}.",
        "",
        "A run whose first step ran out of memory on rank 1 in its first pass (redone in chunks of half rank 1's"
        f" batch, kept for the epoch): first step {retried[0]:.3f} s (without the error: median"
        f" {statistics.median(first_steps['auto']):.3f} s), later steps median"
        f" {statistics.median(retried[WARM_UP:]):.4f} s (in chunks).",
    ]
    (RESULTS / "out_of_memory_steps.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
