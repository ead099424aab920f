"""``worker.py whole-fabric|whole-native``: a whole ``fine_tune`` as users run it (dev evaluation every epoch, the
final test, model files), timed, with ``FabricTrainer`` and with flair's own ``multi_gpu=True`` (section 8 of
``run.py``)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import common
import torch
from common import Workload, build_model, free_port
from ddp_on_cpu import cpu_ddp, cpu_process_group
from flair.trainers import ModelTrainer
from worker_shared import header, warmup_of, workload_of, write

from flair_fabric import FabricTrainer
from flair_fabric.datasets import trec_corpus


def whole_fine_tune(trainer: Any, workload: Workload, base_path: Path, **extra: Any) -> dict[str, float]:
    """Seconds of one ``fine_tune`` call, from the call to its return, and the test score it returned."""
    started = time.perf_counter()
    returned = trainer.fine_tune(
        base_path,
        learning_rate=workload.learning_rate,
        mini_batch_size=workload.batch_size,
        eval_batch_size=32,
        max_epochs=workload.epochs,
        shuffle=False,
        **extra,
    )
    return {"seconds": time.perf_counter() - started, "test_score": float(returned["test_score"])}


def whole_runs(args: argparse.Namespace, mode: str, run: Any, is_zero: bool) -> None:
    """An untimed warm-up on a small corpus, then ``--reps`` timed runs; rank 0 prints and writes."""
    workload = workload_of(args)
    result = header(mode, workload, args.devices)
    result["dev_size"] = result["test_size"] = args.dev_size
    for rep in range(-1, args.reps):
        small = rep < 0
        corpus = trec_corpus(
            train_size=warmup_of(workload, args.devices).train_size if small else workload.train_size,
            dev_size=2 * 32 * args.devices if small else args.dev_size,
            test_size=2 * 32 * args.devices if small else args.dev_size,
            seed=common.SPLIT_SEED,
        )
        measured = run(corpus, build_model(args.model, corpus), args.base_path / f"{mode}-{rep + 1}")
        if not small and is_zero:
            result["runs"].append({"trainer": mode, "rep": rep, **measured})
            print(f"[{mode} {args.model}] rep {rep}: {measured['seconds']:.3f} s", flush=True)
    if is_zero:
        write(args.out, result)


def whole_fabric(args: argparse.Namespace) -> None:
    """Runs on every rank (Fabric relaunches the script); the folder is the same on every rank."""

    def run(corpus: Any, model: Any, base_path: Path) -> dict[str, float]:
        return whole_fine_tune(
            FabricTrainer(model, corpus), workload_of(args), base_path, accelerator="cpu", devices=args.devices
        )

    whole_runs(args, "whole-fabric", run, os.environ.get("LOCAL_RANK", "0") == "0")


def whole_native_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import flair.trainers.trainer

    with cpu_process_group(rank, args.devices, port):
        flair.trainers.trainer.DistributedDataParallel = cpu_ddp  # type: ignore[attr-defined]

        def run(corpus: Any, model: Any, base_path: Path) -> dict[str, float]:
            torch.distributed.barrier()
            return whole_fine_tune(ModelTrainer(model, corpus), workload_of(args), base_path, multi_gpu=True)

        whole_runs(args, "whole-native", run, rank == 0)


def whole_native(args: argparse.Namespace) -> None:
    torch.multiprocessing.spawn(whole_native_rank, args=(args, free_port()), nprocs=args.devices, join=True)
