"""``worker.py overhead``: ``FabricTrainer(devices=1)`` and flair's ``ModelTrainer`` in this one process, interleaved
(ABBA), training time of every epoch (section 1 of ``run.py``)."""

from __future__ import annotations

import argparse
import tempfile

import flair
import torch
from common import EpochTimer, Workload, build_model, run_flair_style, train_only_corpus
from flair.trainers import ModelTrainer
from worker_shared import header, timings, warmup_of, workload_of, write

from flair_fabric import FabricTrainer


def single_run(trainer_name: str, workload: Workload, base_path: str) -> dict[str, list[float]]:
    corpus = train_only_corpus(workload.train_size)
    model = build_model(workload.model, corpus)
    timer = EpochTimer()
    if trainer_name == "fabric":
        run_flair_style(FabricTrainer(model, corpus), workload, timer, base_path, accelerator="cpu", devices=1)
    else:
        flair.device = torch.device("cpu")
        run_flair_style(ModelTrainer(model, corpus), workload, timer, base_path)
    return timings(timer)


def overhead(args: argparse.Namespace) -> None:
    workload = workload_of(args)
    result = header("overhead", workload, 1)
    with tempfile.TemporaryDirectory() as base_path:
        for name in ("fabric", "flair"):
            single_run(name, warmup_of(workload, 1), base_path)
        for rep in range(args.reps):
            order = ("fabric", "flair") if rep % 2 == 0 else ("flair", "fabric")  # ABBA: no side always goes first
            for name in order:
                times = single_run(name, workload, base_path)
                result["runs"].append({"trainer": name, "rep": rep, **times})
                print(f"[overhead {workload.model}] rep {rep} {name}: {sum(times['epoch_seconds']):.3f} s", flush=True)
    write(args.out, result)
