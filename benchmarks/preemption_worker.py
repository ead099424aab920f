"""Worker modes of the preemption benchmarks (``worker.py checkpointing|resume-prepare|resume``).

checkpointing    every rank: one epoch with a checkpoint every n steps and one without, alternating, timed
resume-prepare   every rank: one epoch that writes a checkpoint every n steps and keeps them all
resume           every rank: resume from one checkpoint folder; rank 0 writes the wall-clock time of the first
                 trained step (``time.time()``, comparable with the caller's clock: same machine)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from common import EpochTimer, Workload, build_model, run_flair_style, train_only_corpus
from flair.trainers.plugins import TrainerPlugin, TrainingInterrupt

from flair_fabric import FabricTrainer


class FirstStepClock(TrainerPlugin):
    """The wall-clock time at which this rank finished its first optimizer step of the run."""

    def __init__(self) -> None:
        super().__init__()
        self.first_step_at: float | None = None
        self.steps = 0

    @TrainerPlugin.hook
    def after_training_batch(self, **kwargs: Any) -> None:
        self.steps += 1
        if self.first_step_at is None:
            self.first_step_at = time.time()


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def _train(
    workload: Workload, args: argparse.Namespace, base_path: Path, timer: EpochTimer, **extra: Any
) -> FabricTrainer:
    corpus = train_only_corpus(workload.train_size)
    model = build_model(workload.model, corpus)
    trainer = FabricTrainer(model, corpus)
    plugins = [timer, *extra.pop("plugins", [])]
    run_flair_style(
        trainer,
        workload,
        timer,
        str(base_path),
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        requeue_signal=None,
        plugins=plugins,
        **extra,
    )
    return trainer


def _gather(value: Any, world_size: int) -> list[Any]:
    every_rank: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(every_rank, value)
    return every_rank


def checkpointing(args: argparse.Namespace, workload: Workload, warmup: Workload) -> None:
    """Epoch time with ``checkpoint_every_n_steps=args.every`` and without, alternating (ABBA) inside one launch."""
    base = args.base_path
    result: dict[str, Any] | None = None
    for rep in range(-1, args.reps):  # rep -1: the untimed warm-up (a checkpoint too, so both paths are warm)
        order = ("none", "every") if rep % 2 == 0 else ("every", "none")
        for variant in order:
            run = warmup if rep < 0 else workload
            every = (args.every if rep >= 0 else 2) if variant == "every" else None
            folder = base / f"{variant}-{rep}"
            timer = EpochTimer()
            trainer = _train(run, args, folder, timer, checkpoint_every_n_steps=every, keep_checkpoints=1)
            written = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.exists() else []
            every_rank = _gather({"rank": trainer.global_rank, "epoch_seconds": timer.epoch_seconds}, args.devices)
            if trainer.is_global_zero:
                shutil.rmtree(folder, ignore_errors=True)
                if rep >= 0:
                    result = result or {"mode": "checkpointing", "workload": workload.to_dict(), "runs": []}
                    seconds = max(sum(rank["epoch_seconds"]) for rank in every_rank)
                    result["runs"].append(
                        {
                            "variant": variant,
                            "checkpoint_every_n_steps": every,
                            "strategy": args.strategy,
                            "rep": rep,
                            "kept_checkpoint": written,
                            "ranks": every_rank,
                        }
                    )
                    print(f"[checkpointing {args.strategy} {variant}] rep {rep}: {seconds:.2f} s", flush=True)
            torch.distributed.barrier()
    if result is not None:
        _write(args.out, result)


def resume_prepare(args: argparse.Namespace, workload: Workload) -> None:
    """One epoch that keeps a checkpoint every ``args.every`` steps (the resume points of ``resume``)."""
    _train(workload, args, args.base_path, EpochTimer(), checkpoint_every_n_steps=args.every, keep_checkpoints=1000)
    if os.environ.get("LOCAL_RANK", "0") == "0" and torch.distributed.get_rank() == 0:
        kept = sorted(p.name for p in (args.base_path / "checkpoints").glob("step-*"))
        _write(args.out, {"mode": "resume-prepare", "workload": workload.to_dict(), "checkpoints": kept})


def resume(args: argparse.Namespace, workload: Workload) -> None:
    """Resume from ``args.resume_from`` and stop after the first optimizer step; rank 0 writes when that was."""
    clock = FirstStepClock()
    timer = EpochTimer()

    class StopAfterFirstStep(TrainerPlugin):
        @TrainerPlugin.hook
        def after_training_batch(self, **kwargs: Any) -> None:
            raise TrainingInterrupt("the first step after the resume is done")  # flair's way; agreed by all ranks

    with_stop = [clock, StopAfterFirstStep()]
    trainer = _train(
        workload, args, args.base_path, timer, resume_from=str(args.resume_from), plugins=with_stop, keep_checkpoints=1
    )
    if trainer.is_global_zero:
        _write(
            args.out,
            {"mode": "resume", "resume_from": args.resume_from.name, "first_step_at": clock.first_step_at},
        )
