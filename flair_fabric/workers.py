"""Run one function on every rank through Fabric's launcher and hand global rank 0's result back to the caller.

With the script relaunch (``strategy="ddp"``) or under torchrun/SLURM the caller is itself a rank, so the function
simply runs in it. Spawned and forked workers (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) are separate
processes: spawned ones receive the job through :mod:`flair_fabric.transport` (flair models by their flair state),
forked ones inherit it, and rank 0's result comes back through a temporary file. (Not through Fabric's return
queue: the launcher joins the workers before it reads the queue, so a result larger than a pipe buffer would block
rank 0 forever.)
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import flair
import torch
from lightning.fabric import Fabric

from flair_fabric import transport
from flair_fabric.environment import environment_restored
from flair_fabric.failures import exit_with_parent, graceful_interrupts
from flair_fabric.launch import LAUNCHING_STRATEGIES

log = logging.getLogger("flair")

Job = TypeVar("Job")
Result = TypeVar("Result")


def starts_workers(fabric: Fabric) -> bool:
    """Whether ``fabric.launch`` starts spawned or forked workers instead of running in the calling process."""
    strategy = fabric.strategy
    return isinstance(strategy, LAUNCHING_STRATEGIES) and strategy.starts_workers_in_train


def run_on_every_rank(fabric: Fabric, function: Callable[[Fabric, Job], Result], job: Job) -> Result:
    """``function(fabric, job)`` on every rank; the caller gets its own rank's result, or rank 0's from workers."""
    if not starts_workers(fabric):
        return fabric.launch(lambda rank_fabric: function(rank_fabric, job))
    assert isinstance(fabric.strategy, LAUNCHING_STRATEGIES)
    payload = transport.dumps(job) if fabric.strategy.start_method == "spawn" else job
    with tempfile.TemporaryDirectory(prefix="flair-fabric-") as handoff_dir:
        handoff = Path(handoff_dir) / "rank0-result.pickle"
        # Ctrl-C reaches the workers too: they stop together and save; this process waits for them (twice: at once)
        with environment_restored("MASTER_PORT"), graceful_interrupts(_workers_stop):
            fabric.launch(functools.partial(_run_in_worker, function=function, job=payload, handoff=handoff))
        return transport.loads(handoff.read_bytes())


def _workers_stop(signal_name: str) -> None:
    log.warning(f"{signal_name} received: the workers stop at their next agreement point (send it again to stop now)")


def _run_in_worker(fabric: Fabric, function: Callable[[Fabric, Any], Any], job: Any, handoff: Path) -> None:
    """One spawned or forked rank: unpack the job, run it; global rank 0 writes its result to ``handoff``."""
    flair.device = fabric.device
    exit_with_parent()  # a worker must not outlive the process that started it
    if isinstance(job, bytes):
        cuda_devices = [fabric.device.index] if fabric.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices):  # rebuilding a model draws random initial weights
            job = transport.loads(job)
    result = function(fabric, job)
    if fabric.is_global_zero:
        handoff.write_bytes(transport.dumps(result))
