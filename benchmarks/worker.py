"""One benchmark measurement in its own process(es); ``run.py`` starts it and reads the JSON it writes.

    worker.py overhead ...   FabricTrainer(devices=1) and flair's ModelTrainer, interleaved in this one process
    worker.py fabric ...     FabricTrainer(devices=N): Fabric relaunches this script, rank 0 writes the JSON
    worker.py native ...     flair's own multi_gpu=True on N CPU processes (torch.multiprocessing + gloo)
    worker.py evaluate ...   flair_fabric.evaluate(devices=N) of a dev split (and, for N=1, flair's model.evaluate)
    worker.py evaluate-native ...  what flair's multi_gpu=True does: N processes each evaluate the whole dev split
    worker.py sharding ...   FabricTrainer(devices=N, strategy=ddp|fsdp): epoch time and memory of every rank
    worker.py checkpointing|resume-prepare|resume ...   the preemption benchmarks (preemption_worker.py)
    worker.py bare ...       compute only: forward_loss, backward, step on N concurrent processes (no DDP, no trainer)
    worker.py whole-fabric|whole-native ...   a whole fine_tune (dev every epoch, final test, model files), timed

Every timed run is preceded (once per process and trainer) by an untimed one-epoch warm-up on a few batches.

The modes live in modules by what they measure: ``overhead_worker.py`` (overhead), ``training_throughput_worker.py``
(fabric, native), ``evaluation_worker.py`` (evaluate, evaluate-native), ``sharding_worker.py`` (sharding),
``preemption_worker.py`` (checkpointing, resume-prepare, resume), ``bare_loop_worker.py`` (bare) and
``whole_fine_tune_worker.py`` (whole-fabric, whole-native); ``worker_shared.py`` holds what every mode uses and
``ddp_on_cpu.py`` the DDP helpers on CPU. This script reads the command line and runs one mode (Fabric relaunches it
with the same command line on every rank).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import common
import preemption_worker
from bare_loop_worker import bare
from common import quiet_flair
from evaluation_worker import evaluate_native, evaluate_split
from overhead_worker import overhead
from sharding_worker import sharding
from training_throughput_worker import fabric, native
from whole_fine_tune_worker import whole_fabric, whole_native
from worker_shared import warmup_of, workload_of


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=[
            "overhead",
            "fabric",
            "native",
            "evaluate",
            "evaluate-native",
            "sharding",
            "checkpointing",
            "resume-prepare",
            "resume",
            "whole-fabric",
            "whole-native",
            "bare",
        ],
    )
    parser.add_argument("--model", choices=common.MODELS, required=True)
    parser.add_argument("--train-size", type=int, required=True, help="evaluate: the size of the dev split")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=0.0)
    parser.add_argument("--reps", type=int, default=1, help="timed runs per trainer/variant in this process")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--variants", default="auto", help="fabric: comma-separated strategy variants (VARIANTS)")
    parser.add_argument("--native-variant", choices=["exact", "no-comm"], default="exact", help="native: DDP as is")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="sharding: the strategy")
    parser.add_argument("--every", type=int, default=50, help="checkpointing, resume-prepare: checkpoint every n steps")
    parser.add_argument("--resume-from", type=Path, help="resume: the checkpoint folder")
    parser.add_argument("--dev-size", type=int, default=500, help="whole-*: questions in the dev and in the test split")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--base-path", type=Path, help="fabric: training folder, the same on every rank (nothing is saved)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet_flair()
    started = time.perf_counter()
    modes = {
        "overhead": overhead,
        "fabric": fabric,
        "native": native,
        "evaluate": evaluate_split,
        "evaluate-native": evaluate_native,
        "sharding": sharding,
        "checkpointing": lambda a: preemption_worker.checkpointing(
            a, workload_of(a), warmup_of(workload_of(a), a.devices)
        ),
        "resume-prepare": lambda a: preemption_worker.resume_prepare(a, workload_of(a)),
        "resume": lambda a: preemption_worker.resume(a, workload_of(a)),
        "whole-fabric": whole_fabric,
        "whole-native": whole_native,
        "bare": bare,
    }
    modes[args.mode](args)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"[{args.mode} {args.model}] worker done in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
