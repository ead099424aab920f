"""``worker.py bare``: compute only, the same batches on N concurrent processes without a trainer or DDP
(forward_loss, backward, optimizer step), and one step's all-reduce alone (section 9 of ``run.py``)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from common import EpochTimer, Workload, build_model, free_port, train_only_corpus
from ddp_on_cpu import cpu_process_group
from worker_shared import header, timings, warmup_of, workload_of, write

BARE_VARIANTS = [  # (grouped optimizer step, each step dealt by length): as flair builds it, as FabricTrainer does
    (False, False),
    (True, True),
    (True, False),
]


def bare_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    """This rank's share of the batches (shuffle=False): forward_loss, backward, optimizer step; 'bare' runs the ranks
    independently (each rank's own compute), '-synced' waits for every rank after each step as a synchronous step
    does (compute plus waiting for the slowest rank). The optimizer steps as flair builds it ('bare') or as
    FabricTrainer builds it ('-grouped': foreach=True); the batches are strided shards (DistributedSampler's, flair's)
    or each step dealt to the ranks by length ('-balanced', FabricTrainer's default). A process group only for
    barriers."""
    with cpu_process_group(rank, args.devices, port):
        workload = workload_of(args)
        result = header("bare", workload, args.devices)
        variants = [(*variant, synced) for variant in BARE_VARIANTS for synced in (False, True)]
        for rep in range(-1, args.reps):
            for grouped, balanced, synced in variants if rep % 2 == 0 else variants[::-1]:
                run = warmup_of(workload, args.devices) if rep < 0 else workload
                model, seconds = _bare_epochs(run, rank, args.devices, synced, grouped, balanced)
                if rep >= 0:
                    name = "bare" + "-grouped" * grouped + "-balanced" * balanced + "-synced" * synced
                    result["runs"].append({"trainer": name, "rep": rep, **seconds})
        result["all_reduce_seconds_per_step"] = gradient_all_reduce_seconds(model)
        if rank == 0:
            write(args.out, result)


def _bare_epochs(
    run: Workload, rank: int, devices: int, synced: bool, grouped: bool, balanced: bool
) -> tuple[Any, dict[str, list[float]]]:
    from flair.training_utils import store_embeddings

    from flair_fabric.training.lengths import data_point_lengths
    from flair_fabric.training.optimizer_implementation import build_optimizer
    from flair_fabric.training.sampling import ShardedBatchSampler

    corpus = train_only_corpus(run.train_size)
    model = build_model(run.model, corpus)
    model.train()
    optimizer_class = torch.optim.AdamW if run.model == "minilm" else torch.optim.SGD
    options = {"lr": run.learning_rate}
    optimizer = (
        build_optimizer(optimizer_class, model.parameters(), options)
        if grouped
        else optimizer_class(model.parameters(), **options)
    )
    lengths = data_point_lengths(corpus.train) if balanced else None
    order = list(range(len(corpus.train)))
    sampler = ShardedBatchSampler(
        order, rank=rank, world_size=devices, global_batch_size=run.batch_size * devices, lengths=lengths
    )
    batches = [[corpus.train[i] for i in indices] for indices in sampler]
    timer = EpochTimer()
    for _ in range(run.epochs):
        torch.distributed.barrier()
        timer.before_training_epoch()
        for batch in batches:
            loss, _ = model.forward_loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            store_embeddings(batch, "none")
            if synced:
                torch.distributed.barrier()
        timer.after_training_epoch()
    return model, timings(timer)


def gradient_all_reduce_seconds(model: torch.nn.Module, bucket_mib: int = 25, reps: int = 7) -> float:
    """Median seconds to all-reduce tensors the size of the model's trainable parameters, in buckets of DDP's default
    size, one after the other: the communication of one step with nothing to hide it behind."""
    sizes: list[int] = []  # elements per bucket, filled in DDP's order (last layers first)
    for parameter in reversed([p for p in model.parameters() if p.requires_grad]):
        if not sizes or (sizes[-1] + parameter.numel()) * 4 > bucket_mib * 2**20:
            sizes.append(0)
        sizes[-1] += parameter.numel()
    buckets = [torch.ones(size) for size in sizes]
    seconds = []
    for _ in range(reps):
        torch.distributed.barrier()
        started = time.perf_counter()
        works = [torch.distributed.all_reduce(bucket, async_op=True) for bucket in buckets]
        for work in works:
            work.wait()
        seconds.append(time.perf_counter() - started)
    return sorted(seconds)[reps // 2]


def bare(args: argparse.Namespace) -> None:
    torch.multiprocessing.spawn(bare_rank, args=(args, free_port()), nprocs=args.devices, join=True)
