"""``worker.py sharding``: ``FabricTrainer(devices=N, strategy=ddp|fsdp)``, the epoch time and the memory of every
rank (section 5 of ``run.py``)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import EpochTimer, build_model, run_flair_style, train_only_corpus
from flair.trainers.plugins import TrainerPlugin
from worker_shared import header, timings, warmup_of, workload_of, write

from flair_fabric import FabricTrainer
from flair_fabric.strategies.sharded_state import held_bytes


class MemoryProbe(TrainerPlugin):
    """Per epoch on this rank: peak resident memory during the epoch's training part (Linux: freed heap is returned
    with malloc_trim, then the high-water mark is reset through /proc/self/clear_refs at ``before_training_epoch``),
    and the bytes of parameters and optimizer state this rank holds."""

    def __init__(self) -> None:
        super().__init__()
        self.start_rss_mib: list[float] = []
        self.peak_rss_mib: list[float] = []
        self.held_mib: list[float] = []

    @staticmethod
    def _status_mib(field: str) -> float:
        status = Path("/proc/self/status").read_text().splitlines()
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024

    @TrainerPlugin.hook
    def before_training_epoch(self, **kwargs: Any) -> None:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so resident memory is what is alive
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        self.start_rss_mib.append(self._status_mib("VmRSS"))

    @TrainerPlugin.hook
    def after_training_epoch(self, **kwargs: Any) -> None:
        self.peak_rss_mib.append(self._status_mib("VmHWM"))
        self.held_mib.append(held_bytes(self.trainer.model, self.trainer.optimizer) / 2**20)


def sharding(args: argparse.Namespace) -> None:
    """Runs on every rank (Fabric relaunches this script); global rank 0 gathers every rank's numbers and writes."""
    workload = workload_of(args)
    base_path = str(args.base_path or Path(tempfile.gettempdir()) / "flair-fabric-bench")
    result = None
    for rep in range(-1, args.reps):  # rep -1: the untimed warm-up on a few batches
        run = warmup_of(workload, args.devices) if rep < 0 else workload
        corpus = train_only_corpus(run.train_size)
        model = build_model(workload.model, corpus)
        timer, probe = EpochTimer(), MemoryProbe()
        trainer = FabricTrainer(model, corpus)
        run_flair_style(
            trainer,
            run,
            timer,
            base_path,
            accelerator="cpu",
            devices=args.devices,
            strategy=args.strategy,
            plugins=[timer, probe],
        )
        measured = {"rank": trainer.global_rank, **timings(timer), "start_rss_mib": probe.start_rss_mib}
        measured.update(peak_rss_mib=probe.peak_rss_mib, held_mib=probe.held_mib)
        del trainer, model
        every_rank: list[Any] = [None] * args.devices
        torch.distributed.all_gather_object(every_rank, measured)
        if rep < 0 or os.environ.get("LOCAL_RANK", "0") != "0":
            continue
        result = result or header("sharding", workload, args.devices)
        result["runs"].append({"trainer": "fabric", "strategy": args.strategy, "rep": rep, "ranks": every_rank})
        seconds = max(sum(rank["epoch_seconds"]) for rank in every_rank)
        peak = max(max(rank["peak_rss_mib"]) for rank in every_rank)
        print(
            f"[sharding {workload.model} {args.strategy}] rep {rep}: {seconds:.3f} s, peak {peak:.0f} MiB", flush=True
        )
    if result is not None:
        write(args.out, result)
