"""Several processes on one GPU: what FabricTrainer, Lightning and torch allow (gloo or NCCL, a device index given
twice, a strategy object with its own ``parallel_devices``, forked workers); every attempt runs in its own
interpreter with a timeout (``processes.run_probe``), so a combination that hangs is reported as a hang."""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import free_port

from .context import Context, guarded, result
from .plugins import plugin
from .processes import probe_failure, run_probe
from .settings import FAILED, PASSED, PROBE_TIMEOUT_S
from .training import build_tiny_onehot_classifier


def expect_refusal(attempt: Callable[[], Any]) -> dict:
    """Run ``attempt``; a refusal is an exception raised by it."""
    started = time.perf_counter()
    try:
        attempt()
    except Exception as error:
        return {"works": False, "refused": True, "error": f"{type(error).__name__}: {error}"[:800]}
    return {"works": True, "refused": False, "seconds": round(time.perf_counter() - started, 2)}


def probe_fabric_trainer_duplicate_devices(ctx: Context) -> dict:
    """FabricTrainer with devices=[0, 0]."""
    from flair_fabric import FabricTrainer, FlairDDPStrategy

    model, corpus = build_tiny_onehot_classifier()
    strategy = FlairDDPStrategy(process_group_backend="gloo")
    kwargs = {"max_epochs": 1, "accelerator": "cuda", "devices": [0, 0], "strategy": strategy, "progress_bar": False}
    return expect_refusal(lambda: FabricTrainer(model, corpus).train(ctx.work / "duplicate", **kwargs))


def probe_fabric_trainer_more_devices(ctx: Context) -> dict:
    """FabricTrainer with more devices than visible GPUs."""
    from flair_fabric import FabricTrainer

    model, corpus = build_tiny_onehot_classifier()
    kwargs = {"max_epochs": 1, "accelerator": "cuda", "devices": ctx.gpus + 1, "progress_bar": False}
    return expect_refusal(lambda: FabricTrainer(model, corpus).train(ctx.work / "more", **kwargs))


def probe_lightning_duplicate_devices(ctx: Context) -> dict:
    """Lightning's Fabric with devices=[0, 0]."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    return expect_refusal(
        lambda: Fabric(accelerator="cuda", devices=[0, 0], strategy=DDPStrategy(process_group_backend="gloo"))
    )


def _torch_rank(rank: int, backend: str, port: int, out: str, device_name: str) -> None:
    """One of two raw-torch ranks, both on ``device_name`` (cuda:0): an all-reduce and one DDP step (spawned by
    ``probe_torch``)."""
    import torch
    import torch.distributed as dist

    record: dict[str, Any] = {"rank": rank, "backend": backend, "device": device_name, "ok": False}
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=30)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout
        )
        value = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(value)
        record["all_reduce"] = value.tolist()  # 1 + 2 on every rank
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 2).to(device)
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(layer, device_ids=device_ids)
        model(torch.randn(8, 4, device=device) * (rank + 1)).sum().backward()
        gradient = layer.weight.grad
        assert gradient is not None
        gathered = [torch.zeros_like(gradient) for _ in range(2)]
        dist.all_gather(gathered, gradient.contiguous())
        record["gradients_agree"] = bool(torch.equal(gathered[0], gathered[1]))
        record["ok"] = record["all_reduce"] == [3.0] * 4 and record["gradients_agree"]
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"[:800]
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if record["ok"]:  # tearing down a communicator that failed can hang: then the probe just ends the process
        dist.destroy_process_group()


def probe_torch(ctx: Context, backend: str, timeout: float = 60.0) -> dict:
    """Two spawned ranks (``_torch_rank``); each writes what happened to it. Ranks still alive ``timeout`` seconds
    after the start, or a few seconds after both reported, are killed (a failed NCCL communicator may not exit)."""
    import torch.multiprocessing as mp

    out = ctx.work / f"torch-{backend}"
    out.mkdir(parents=True, exist_ok=True)
    args = (backend, free_port(), str(out), str(ctx.device))
    processes = mp.start_processes(_torch_rank, args=args, nprocs=2, join=False, start_method="spawn")
    error, finished, deadline = None, False, time.time() + timeout
    while not finished and time.time() < deadline:
        try:
            finished = processes.join(timeout=1)
        except Exception as failure:  # a rank died without reporting
            error, finished = f"{type(failure).__name__}: {failure}"[:800], True
        if len(list(out.glob("rank*.json"))) == 2:
            deadline = min(deadline, time.time() + 5)
    hung = [p.pid for p in processes.processes if p.is_alive()]
    for process in processes.processes:
        if process.is_alive():
            process.kill()
    ranks = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(out.glob("rank*.json"))]
    works = error is None and len(ranks) == 2 and all(rank.get("ok") for rank in ranks)
    rank_errors = [rank["error"] for rank in ranks if rank.get("error")]
    if not ranks and hung:
        error = f"no rank reported within {timeout:.0f} s (a hang)"
    return {"works": works, "error": rank_errors[0] if rank_errors else error, "ranks": ranks, "killed": len(hung)}


def probe_parallel_devices(ctx: Context, backend: str) -> dict:
    """FabricTrainer with devices=1 and a FlairDDPStrategy that brings its own parallel_devices=[cuda:0, cuda:0]."""
    from flair.models import TextClassifier

    from flair_fabric import FabricTrainer, FlairDDPStrategy

    model, corpus = build_tiny_onehot_classifier()
    strategy = FlairDDPStrategy(
        parallel_devices=[ctx.device] * 2,
        process_group_backend=backend,
        start_method="spawn",
        timeout=datetime.timedelta(seconds=45),
    )
    base, run_file = ctx.work / f"parallel-{backend}", ctx.work / f"parallel-{backend}.json"
    recorder = plugin("RunRecorder", str(run_file))
    kwargs = {"max_epochs": 1, "mini_batch_size": 8, "learning_rate": 0.1, "create_file_logs": False}
    try:
        FabricTrainer(model, corpus).train(
            base,
            accelerator=ctx.accelerator,
            devices=1,
            strategy=strategy,
            plugins=[recorder],
            progress_bar=False,
            **kwargs,
        )
    except Exception as error:
        return {"works": False, "error": f"{type(error).__name__}: {error}"[:800]}
    run = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    TextClassifier.load(base / "final-model.pt")
    return {"works": run.get("world_size") == 2, "error": None, "run": run}


def probe_fork_after_import_flair(ctx: Context) -> dict:
    """A notebook's order: ``import flair`` first (its import asks ``torch.cuda.is_available()``, which initialises
    the CUDA driver; this probe's environment lacks PYTORCH_NVML_BASED_CUDA_CHECK, which the parent's Lightning
    import set), the model built on the CPU, then strategy="ddp_fork" on the GPU. Forked workers cannot use a driver
    the parent initialised (the first GPU run: CUDA initialization error in the workers), so FabricTrainer must refuse
    at once with an error that names the fix."""
    import flair  # before anything else of flair-fabric or Lightning
    import torch

    flair.device = torch.device("cpu")
    model, corpus = build_tiny_onehot_classifier()
    from flair_fabric import FabricTrainer

    answer = expect_refusal(lambda: fork_one_epoch(ctx, FabricTrainer(model, corpus), "fork-after-flair"))
    if answer["refused"] and "import flair_fabric before flair" not in answer["error"]:
        return {"works": False, "refused": False, "error": answer["error"]}  # failed, but not with the clear error
    return answer


def probe_fork_after_import_flair_fabric(ctx: Context) -> dict:
    """The order the refusal above asks for: ``import flair_fabric`` first (it sets PYTORCH_NVML_BASED_CUDA_CHECK
    before flair is imported), then flair, the model built on the CPU, strategy="ddp_fork" on the GPU: it trains."""
    flair_fabric = importlib.import_module("flair_fabric")  # first: before flair
    import flair
    import torch

    flair.device = torch.device("cpu")
    model, corpus = build_tiny_onehot_classifier()
    try:
        fork_one_epoch(ctx, flair_fabric.FabricTrainer(model, corpus), "fork-after-flair-fabric")
    except Exception as error:
        return {"works": False, "error": f"{type(error).__name__}: {error}"[:800]}
    return {"works": True, "error": None}


def fork_one_epoch(ctx: Context, trainer: Any, folder: str) -> None:
    """One epoch with strategy="ddp_fork" on this machine's accelerator."""
    kwargs = {"max_epochs": 1, "mini_batch_size": 8, "learning_rate": 0.1, "create_file_logs": False}
    trainer.train(
        ctx.work / folder, accelerator=ctx.accelerator, devices=1, strategy="ddp_fork", progress_bar=False, **kwargs
    )


PROBES: dict[str, Callable[[Context], dict]] = {  # and strategies.probe_deepspeed_train (units.PROBES)
    "fabric_trainer_duplicate_devices": probe_fabric_trainer_duplicate_devices,
    "fabric_trainer_more_devices": probe_fabric_trainer_more_devices,
    "lightning_duplicate_devices": probe_lightning_duplicate_devices,
    "torch_gloo": lambda ctx: probe_torch(ctx, "gloo"),
    "torch_nccl": lambda ctx: probe_torch(ctx, "nccl"),
    "parallel_devices_gloo": lambda ctx: probe_parallel_devices(ctx, "gloo"),
    "parallel_devices_nccl": lambda ctx: probe_parallel_devices(ctx, "nccl"),
    "fork_after_import_flair": probe_fork_after_import_flair,
    "fork_after_import_flair_fabric": probe_fork_after_import_flair_fabric,
}
PROBE_ENV_DROPPED = {
    "fork_after_import_flair": ("PYTORCH_NVML_BASED_CUDA_CHECK",),
    "fork_after_import_flair_fabric": ("PYTORCH_NVML_BASED_CUDA_CHECK",),
}

ONE_GPU_PROBES = (  # check name, probe, expected: "refused", "works", or "answers" (works, or a clear error)
    ("one_gpu_fabric_trainer_duplicate_devices", "fabric_trainer_duplicate_devices", "refused"),
    ("one_gpu_fabric_trainer_more_devices_than_gpus", "fabric_trainer_more_devices", "refused"),
    ("one_gpu_lightning_duplicate_devices", "lightning_duplicate_devices", "refused"),
    ("one_gpu_torch_gloo_two_ranks", "torch_gloo", "answers"),
    ("one_gpu_torch_nccl_two_ranks", "torch_nccl", "answers"),
    ("one_gpu_fabric_trainer_parallel_devices_gloo", "parallel_devices_gloo", "answers"),
    ("one_gpu_fabric_trainer_parallel_devices_nccl", "parallel_devices_nccl", "answers"),
    ("one_gpu_ddp_fork_after_import_flair", "fork_after_import_flair", "refused"),
    ("one_gpu_ddp_fork_after_import_flair_fabric", "fork_after_import_flair_fabric", "works"),
)


ONE_GPU_TITLES = {
    "fabric_trainer_duplicate_devices": "FabricTrainer, devices=[0, 0], FlairDDPStrategy(process_group_backend='gloo')",
    "fabric_trainer_more_devices": "FabricTrainer, devices=<visible GPUs + 1>",
    "lightning_duplicate_devices": "Lightning Fabric, devices=[0, 0], DDPStrategy(process_group_backend='gloo')",
    "torch_gloo": "torch: 2 ranks on cuda:0, gloo (all-reduce, DDP step)",
    "torch_nccl": "torch: 2 ranks on cuda:0, NCCL (all-reduce, DDP step)",
    "parallel_devices_gloo": "FabricTrainer, devices=1, FlairDDPStrategy(parallel_devices=[cuda:0, cuda:0], gloo)",
    "parallel_devices_nccl": "FabricTrainer, devices=1, FlairDDPStrategy(parallel_devices=[cuda:0, cuda:0], nccl)",
    "fork_after_import_flair": "strategy='ddp_fork' on the GPU after `import flair` (model built on the CPU)",
    "fork_after_import_flair_fabric": "strategy='ddp_fork' on the GPU, `import flair_fabric` before flair",
}


ONE_GPU_CUDA_REASONS = {
    "fabric_trainer_more_devices": "counts CUDA devices (on CPU, devices= counts processes)",
    "fork_after_import_flair": "CUDA in forked workers after the parent asked torch.cuda.is_available()",
    "fork_after_import_flair_fabric": "CUDA in forked workers after the parent imported flair",
}


def one_gpu_row(name: str, expected: str, outcome: dict) -> dict:
    """The row of one probe: its outcome judged against what is ``expected`` (refused, works, answers)."""
    payload = outcome.get("payload") or {}
    base = {"probe": outcome, "works": payload.get("works")}
    if outcome["outcome"] != "finished":
        return result(name, FAILED, probe_failure(outcome), **base)
    error = payload.get("error")
    if expected == "refused":
        if payload.get("refused"):
            return result(name, PASSED, f"refused at once ({outcome['seconds']:.0f} s): {error}", **base)
        return result(name, FAILED, "accepted; expected a clear refusal", **base)
    if expected == "works" and not payload.get("works"):
        return result(name, FAILED, f"does not work ({outcome['seconds']:.0f} s): {error}", **base)
    if payload.get("works"):
        return result(
            name, PASSED, f"works ({outcome['seconds']:.0f} s): {json.dumps(payload, default=str)[:300]}", **base
        )
    if error:
        return result(name, PASSED, f"does not work; clear error in {outcome['seconds']:.0f} s: {error}", **base)
    return result(name, FAILED, f"neither worked nor gave an error: {json.dumps(payload)[:300]}", **base)


def _one_gpu_answer(name: str, expected: str, future: Future) -> dict:
    """The row of a probe that ran in a thread of ``unit_one_gpu``."""
    return one_gpu_row(name, expected, future.result())


def unit_one_gpu(ctx: Context) -> Iterator[dict]:
    """Each attempt in its own interpreter, all at once (they are independent), each with a timeout."""
    timeout = min(PROBE_TIMEOUT_S, ctx.seconds_left() - 10)
    with ThreadPoolExecutor(max_workers=len(ONE_GPU_PROBES)) as pool:
        futures = {
            name: pool.submit(run_probe, ctx, probe, timeout, PROBE_ENV_DROPPED.get(probe, ()))
            for name, probe, _ in ONE_GPU_PROBES
        }
        for name, _, expected in ONE_GPU_PROBES:
            yield guarded(name, functools.partial(_one_gpu_answer, name, expected, futures[name]))
