"""Evaluating a dev split: ``worker.py evaluate`` (``flair_fabric.evaluate(devices=N)``, and for N=1 flair's
``model.evaluate`` too) and ``worker.py evaluate-native`` (what flair's ``multi_gpu=True`` does: N processes each
evaluate the whole split). Section 4 of ``run.py``."""

from __future__ import annotations

import argparse
import os
import time

import common
import flair
import torch
from common import build_model, free_port
from ddp_on_cpu import cpu_process_group
from worker_shared import header, workload_of, write

import flair_fabric
from flair_fabric.datasets import TREC_LABEL_TYPE


def evaluate_split(args: argparse.Namespace) -> None:
    """Every rank runs this (Fabric relaunches the script for N > 1); global rank 0 times and writes."""
    corpus, dev = common.evaluation_corpus(args.train_size)
    model = build_model(args.model, corpus)
    model.eval()

    def sharded(sentences: list) -> tuple[float, float]:
        started = time.perf_counter()
        result = flair_fabric.evaluate(
            model, sentences, TREC_LABEL_TYPE, mini_batch_size=args.batch_size, accelerator="cpu", devices=args.devices
        )
        return time.perf_counter() - started, result.main_score

    def single(sentences: list) -> tuple[float, float]:
        flair.device = torch.device("cpu")
        started = time.perf_counter()
        result = model.evaluate(sentences, TREC_LABEL_TYPE, mini_batch_size=args.batch_size)
        return time.perf_counter() - started, result.main_score

    sides = {"fabric": sharded, "flair": single} if args.devices == 1 else {"fabric": sharded}
    for side in sides.values():  # untimed warm-up (the first call also starts the processes)
        side(dev[: 2 * args.batch_size * args.devices])
    result = header("evaluate", workload_of(args), args.devices)
    for rep in range(args.reps):
        names = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in names:
            seconds, score = sides[name](dev)
            result["runs"].append({"trainer": name, "rep": rep, "seconds": seconds, "main_score": score})
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"[evaluate {args.model} {name} x{args.devices}] rep {rep}: {seconds:.3f} s", flush=True)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        write(args.out, result)


def evaluate_native_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    """One of N processes of flair's multi_gpu=True evaluation: model.evaluate of the whole split on every rank."""
    with cpu_process_group(rank, args.devices, port):
        corpus, dev = common.evaluation_corpus(args.train_size)
        model = build_model(args.model, corpus)
        model.eval()
        model.evaluate(dev[: 2 * args.batch_size], TREC_LABEL_TYPE, mini_batch_size=args.batch_size)  # warm-up
        result = header("evaluate-native", workload_of(args), args.devices)
        for rep in range(args.reps):
            torch.distributed.barrier()
            started = time.perf_counter()
            score = model.evaluate(dev, TREC_LABEL_TYPE, mini_batch_size=args.batch_size).main_score
            slowest = torch.tensor(time.perf_counter() - started)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)  # the run waits for the last
            result["runs"].append(
                {"trainer": "flair-native", "rep": rep, "seconds": float(slowest), "main_score": score}
            )
            if rank == 0:
                print(
                    f"[evaluate {args.model} flair-native x{args.devices}] rep {rep}: {float(slowest):.3f} s",
                    flush=True,
                )
        if rank == 0:
            write(args.out, result)


def evaluate_native(args: argparse.Namespace) -> None:
    torch.multiprocessing.spawn(evaluate_native_rank, args=(args, free_port()), nprocs=args.devices, join=True)
