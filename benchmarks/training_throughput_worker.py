"""Training on N CPU processes, timed per epoch: ``worker.py fabric`` (``FabricTrainer(devices=N)`` in strategy
variants; Fabric relaunches this script, rank 0 writes) and ``worker.py native`` (flair's own ``multi_gpu=True`` in N
processes started by torch.multiprocessing). Sections 2, 3 and 9 of ``run.py``."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import EpochTimer, Workload, build_model, free_port, run_flair_style, train_only_corpus
from ddp_on_cpu import cpu_ddp, cpu_ddp_without_communication, cpu_process_group, no_communication
from flair.trainers import ModelTrainer
from worker_shared import header, timings, warmup_of, workload_of, write

from flair_fabric import FabricTrainer, FlairDDPStrategy

VARIANTS = (
    "auto",
    "true",
    "false",
    "no-comm",
    "bf16",
    "fp16",
    "powersgd",
    "copy-grads",
    "static",
    "one-by-one",
    "fused",
    "strided",
)
"""FabricTrainer strategies: 'auto'; find_unused_parameters forced 'true'/'false'; 'no-comm' (gradients are not
exchanged: a DDP communication hook that returns them as they are, to time everything but the communication);
gradient compression 'bf16'/'fp16'/'powersgd'; 'copy-grads' (gradient_as_bucket_view=False); 'static'
(static_graph=True); 'bucketN' (bucket_cap_mb=N); 'one-by-one'/'fused'/'strided' (OPTION_VARIANTS)."""
OPTION_VARIANTS = {"one-by-one": {"foreach": False}, "fused": {"fused": True}, "strided": {"balance_batches": False}}
"""Variants that change one training argument: the optimizer step as flair builds it (one parameter at a time) or
PyTorch's fused one; strided shards instead of each step's data points dealt to the ranks by length."""


class NoCommunicationDDP(FlairDDPStrategy):
    """FlairDDPStrategy with :func:`no_communication` registered: DDP's whole machinery except the all-reduce."""

    def setup_module(self, module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        wrapped = super().setup_module(module)
        wrapped.register_comm_hook(None, no_communication)
        return wrapped


def strategy_for(variant: str) -> Any:
    if variant == "auto" or variant in OPTION_VARIANTS:
        return "auto"
    if variant in ("true", "false"):
        return FlairDDPStrategy(find_unused_parameters=variant == "true")
    if variant == "no-comm":
        return NoCommunicationDDP()
    if variant in ("bf16", "fp16", "powersgd"):
        return FlairDDPStrategy(gradient_compression=variant)
    if variant == "copy-grads":
        return FlairDDPStrategy(gradient_as_bucket_view=False)
    if variant == "static":
        return FlairDDPStrategy(static_graph=True)
    return FlairDDPStrategy(bucket_cap_mb=int(variant.removeprefix("bucket")))


def fabric_run(
    variant: str, workload: Workload, devices: int, base_path: str
) -> tuple[FabricTrainer, dict[str, list[float]]]:
    corpus = train_only_corpus(workload.train_size)
    model = build_model(workload.model, corpus)
    timer = EpochTimer()
    trainer = FabricTrainer(model, corpus)
    options = OPTION_VARIANTS.get(variant, {})
    run_flair_style(
        trainer,
        workload,
        timer,
        base_path,
        accelerator="cpu",
        devices=devices,
        strategy=strategy_for(variant),
        **options,
    )
    return trainer, timings(timer)


def fabric(args: argparse.Namespace) -> None:
    """Runs on every rank (Fabric relaunches this script); only global rank 0 writes."""
    workload = workload_of(args)
    variants = args.variants.split(",")
    if any(v not in VARIANTS and not v.removeprefix("bucket").isdigit() for v in variants):
        raise SystemExit(f"--variants takes a comma-separated subset of {VARIANTS} and bucketN")
    result = None
    base_path = str(args.base_path or Path(tempfile.gettempdir()) / "flair-fabric-bench")
    trainer, _ = fabric_run(variants[0], warmup_of(workload, args.devices), args.devices, base_path)
    if trainer.is_global_zero:
        result = header("fabric", workload, trainer.world_size)
    for rep in range(args.reps):
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:  # rotate the order from one rep to the next
            trainer, times = fabric_run(variant, workload, args.devices, base_path)
            strategy = trainer.fabric.strategy if trainer.fabric is not None else None
            if result is not None:
                result["runs"].append(
                    {
                        "trainer": "fabric",
                        "variant": variant,
                        "find_unused_parameters": getattr(strategy, "find_unused_parameters", None),
                        "rep": rep,
                        **times,
                    }
                )
                print(f"[fabric {workload.model} {variant}] rep {rep}: {sum(times['epoch_seconds']):.3f} s", flush=True)
    if result is not None:
        write(args.out, result)


def native_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import flair.trainers.trainer

    with cpu_process_group(rank, args.devices, port):
        shim = cpu_ddp_without_communication if args.native_variant == "no-comm" else cpu_ddp
        flair.trainers.trainer.DistributedDataParallel = shim  # type: ignore[attr-defined]
        workload = workload_of(args)
        result = header("native", workload, args.devices)
        with tempfile.TemporaryDirectory() as base_path:
            single = warmup_of(workload, args.devices)
            _native_run(single, base_path)
            for rep in range(args.reps):
                times = _native_run(workload, base_path)
                result["runs"].append(
                    {
                        "trainer": "flair-native",
                        "variant": args.native_variant,
                        "find_unused_parameters": True,
                        "rep": rep,
                        **times,
                    }
                )
                if rank == 0:
                    print(f"[native {workload.model}] rep {rep}: {sum(times['epoch_seconds']):.3f} s", flush=True)
        if rank == 0:
            write(args.out, result)


def _native_run(workload: Workload, base_path: str) -> dict[str, list[float]]:
    corpus = train_only_corpus(workload.train_size)
    model = build_model(workload.model, corpus)
    timer = EpochTimer()
    run_flair_style(ModelTrainer(model, corpus), workload, timer, base_path, multi_gpu=True)
    return timings(timer)


def native(args: argparse.Namespace) -> None:
    torch.multiprocessing.spawn(native_rank, args=(args, free_port()), nprocs=args.devices, join=True)
