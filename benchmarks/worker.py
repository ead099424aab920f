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
"""

# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as objects.

import argparse
import contextlib
import ctypes
import gc
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import flair
import preemption_worker
import torch
from common import EpochTimer, Workload, build_model, free_port, quiet_flair, run_flair_style, train_only_corpus
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin

import flair_fabric
from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.datasets import TREC_LABEL_TYPE, trec_corpus
from flair_fabric.strategies.sharded_state import held_bytes

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


def no_communication(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that exchanges nothing (timing only: the ranks' gradients then differ)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class NoCommunicationDDP(FlairDDPStrategy):
    """FlairDDPStrategy with :func:`no_communication` registered: DDP's whole machinery except the all-reduce."""

    def setup_module(self, module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        wrapped = super().setup_module(module)
        wrapped.register_comm_hook(None, no_communication)
        return wrapped


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


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(args.model, args.train_size, args.batch_size, args.epochs, args.learning_rate)


def warmup_of(workload: Workload, world_size: int) -> Workload:
    """One epoch of at most four batches per process: pays first-call costs outside the timed runs."""
    size = min(workload.train_size, 4 * workload.batch_size * world_size)
    return Workload(workload.model, size, workload.batch_size, 1, workload.learning_rate)


def write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def header(mode: str, workload: Workload, world_size: int) -> dict[str, Any]:
    return {
        "mode": mode,
        "workload": workload.to_dict(),
        "world_size": world_size,
        "torch_threads_per_process": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "runs": [],
    }


# --- one device: FabricTrainer vs ModelTrainer, interleaved --------------------------------------------------------


def timings(timer: EpochTimer) -> dict[str, list[float]]:
    return {"epoch_seconds": timer.epoch_seconds, "epoch_cpu_seconds": timer.epoch_cpu_seconds}


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


# --- N processes: FabricTrainer -------------------------------------------------------------------------------------


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


# --- N processes: flair's own multi_gpu=True ------------------------------------------------------------------------


def cpu_ddp(
    module: torch.nn.Module, device_ids: Any = None, **kwargs: Any
) -> torch.nn.parallel.DistributedDataParallel:
    """The benchmark's only change to flair: ``device_ids=[None]`` (flair passes ``[flair.device.index]``, which is
    ``[None]`` on CPU and rejected by torch) becomes ``device_ids=None``. Every other argument is flair's own
    (``find_unused_parameters=True``)."""
    if device_ids is not None and all(d is None for d in device_ids):
        device_ids = None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **kwargs)


def cpu_ddp_without_communication(module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """:func:`cpu_ddp` with :func:`no_communication` registered (timing only)."""
    wrapped = cpu_ddp(module, **kwargs)
    wrapped.register_comm_hook(None, no_communication)
    return wrapped


@contextlib.contextmanager
def cpu_process_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """A gloo process group for a rank started by torch.multiprocessing, with flair on the CPU and quiet."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        quiet_flair()
        flair.device = torch.device("cpu")
        yield
    finally:
        torch.distributed.destroy_process_group()


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


# --- compute only: the same batches on N concurrent processes, no trainer, no DDP ---------------------------------


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

    from flair_fabric.training.optimizer_implementation import build_optimizer
    from flair_fabric.training.sampling import ShardedBatchSampler, data_point_lengths

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
    sampler = ShardedBatchSampler(order, rank=rank, world_size=devices, batch_size=run.batch_size, lengths=lengths)
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


# --- evaluation of a dev split: flair_fabric.evaluate on N processes, flair's evaluate in one -------------------


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


# --- ddp vs fsdp: time and memory per rank -----------------------------------------------------------------------


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


# --- a whole fine_tune as users run it: dev evaluation every epoch, the final test, model files --------------------


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
