"""What evaluating inside epochs costs (``val_check_interval``), and the learning curve it gives (issue 31).

all-MiniLM-L6-v2 fine-tuned on TREC questions by ``FabricTrainer`` on 2 CPU processes, with
``val_check_interval=0.1`` (an evaluation every tenth of an epoch). A plugin on global rank 0 notes when each step and
each evaluation ends; reported:

- the seconds of each evaluation inside an epoch, against the training seconds since the evaluation before;
- the seconds of the evaluation at the epoch's end (flair's own: one dev pass, the best-model choice);
- the learning curve: the dev score after each evaluation, by optimizer step.

    python benchmarks/evaluation_intervals.py   # results in benchmarks/results/evaluation_intervals.{json,md}
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import build_model, machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TRAIN, DEV, BATCH, INTERVAL = 600, 150, 8, 0.1  # 300 per rank in batches of 8: 38 steps, an evaluation every 3


def main() -> None:
    from flair.trainers.plugins import TrainerPlugin

    from flair_fabric import FabricTrainer
    from flair_fabric.datasets import trec_corpus

    class Clock(TrainerPlugin):
        """When each step and each evaluation ended (every rank keeps it; global rank 0 writes it)."""

        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple[str, int, float]] = []
            self.step = 0

        @TrainerPlugin.hook
        def after_training_batch(self, batch_count: int, **kw: Any) -> None:
            self.step = batch_count
            self.events.append(("step", batch_count, time.perf_counter()))

        @TrainerPlugin.hook
        def after_evaluation(self, validation_scores: tuple, **kw: Any) -> None:
            self.events.append(("evaluation", self.step, time.perf_counter(), validation_scores[0]))  # type: ignore[arg-type]

    corpus = trec_corpus(train_size=TRAIN, dev_size=DEV, test_size=0, seed=42)
    clock = Clock()
    trainer = FabricTrainer(build_model("minilm", corpus), corpus)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/evaluation-intervals")
    trainer.fine_tune(
        out,
        max_epochs=1,
        mini_batch_size=BATCH,
        learning_rate=5e-5,
        accelerator="cpu",
        devices=2,
        val_check_interval=INTERVAL,
        plugins=[clock],
        create_file_logs=False,
        save_final_model=False,
        use_final_model_for_eval=False,
    )
    if not trainer.is_global_zero:
        return
    rows, last_evaluation_end, last_step_end = [], None, None
    for event in clock.events:
        if event[0] == "step":
            last_step_end = event[2]
            continue
        training = event[2] - (last_evaluation_end or clock.events[0][2])
        rows.append(
            {
                "step": event[1],
                "evaluation_seconds": event[2] - last_step_end,
                "training_seconds_since_the_last_evaluation": training - (event[2] - last_step_end),
                "dev_score": event[3],
            }
        )
        last_evaluation_end = event[2]
    inside, at_end = rows[:-1], rows[-1]
    ratio = statistics.median(r["evaluation_seconds"] / r["training_seconds_since_the_last_evaluation"] for r in inside)
    result = {
        "model": "minilm",
        "train": TRAIN,
        "dev": DEV,
        "mini_batch_size_per_rank": BATCH,
        "processes": 2,
        "val_check_interval": INTERVAL,
        "median_evaluation_seconds_inside": statistics.median(r["evaluation_seconds"] for r in inside),
        "evaluation_seconds_at_epoch_end": at_end["evaluation_seconds"],
        "median_evaluation_over_training_between": ratio,
        "evaluations": rows,
        "machine": machine(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "evaluation_intervals.json").write_text(json.dumps(result, indent=2) + "\n")
    table = [
        f"# Evaluations inside epochs: MiniLM on TREC, 2 CPU processes, val_check_interval={INTERVAL}",
        "",
        f"One evaluation inside the epoch: median {result['median_evaluation_seconds_inside']:.2f} s, against"
        f" {at_end['evaluation_seconds']:.2f} s for flair's evaluation at the epoch's end (one dev pass of {DEV}"
        f" questions); median ratio to the training time between two evaluations: {ratio:.2f}.",
        "",
        "| after step | evaluation (s) | training since the last (s) | dev score |",
        "|---|---|---|---|",
        *(
            f"| {r['step']} | {r['evaluation_seconds']:.2f} | {r['training_seconds_since_the_last_evaluation']:.2f}"
            f" | {r['dev_score']:.4f} |"
            for r in rows
        ),
    ]
    (RESULTS / "evaluation_intervals.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
