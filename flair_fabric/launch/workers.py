"""The one launch path: run a function on every rank through Fabric's launcher; the caller gets rank 0's result.

Used by training and by ``flair_fabric.evaluate`` alike. On every rank it sets ``flair.device`` from Fabric (the
local rank's device), keeps the ``flair`` logger quiet on all ranks but global rank 0, and makes a copy of the
script that rank 0 relaunched exit when rank 0 is gone; when this process starts every other one, they meet at a
store it hosts on loopback (:mod:`flair_fabric.launch.rendezvous`), and copies it relaunched are killed if it raises.

With the script relaunch (``strategy="ddp"``) or under torchrun/SLURM the caller is itself a rank, so the function
simply runs in it. Spawned and forked workers (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) are separate
processes: spawned ones receive the job through :mod:`~flair_fabric.launch.transport` (flair models by their flair
state), forked ones inherit it, and rank 0's result comes back as plain data through a private temporary file. (Not
through Fabric's return queue: the launcher joins the workers before it reads the queue, so a result larger than a
pipe buffer would block rank 0 forever.)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import flair
import torch
from lightning.fabric import Fabric

from flair_fabric.distributed.stalls import DEFAULT_COLLECTIVE_TIMEOUT
from flair_fabric.launch import transport
from flair_fabric.launch.environment import environment_restored, external_launch
from flair_fabric.launch.failures import (
    FORWARDED_SIGNAL,
    exit_with_parent,
    forget_inherited_interrupts,
    graceful_interrupts,
    stop_started_processes,
)
from flair_fabric.launch.rendezvous import loopback_interface_only, loopback_rendezvous, torchrun_rendezvous
from flair_fabric.state.safe_loading import load_data, save_private
from flair_fabric.strategies import LAUNCHING_STRATEGIES

log = logging.getLogger("flair")

Job = TypeVar("Job")
Result = TypeVar("Result")


def starts_workers(fabric: Fabric) -> bool:
    """Whether ``fabric.launch`` starts spawned or forked workers instead of running in the calling process."""
    strategy = fabric.strategy
    return isinstance(strategy, LAUNCHING_STRATEGIES) and strategy.starts_workers_in_train


def starts_every_process_here(fabric: Fabric) -> bool:
    """Whether this process starts all other processes of the run, on this machine (relaunch, spawn, fork)."""
    strategy = fabric.strategy
    return (
        isinstance(strategy, LAUNCHING_STRATEGIES)
        and fabric.world_size > 1
        and strategy.num_nodes == 1
        and external_launch() is None
        and "LOCAL_RANK" not in os.environ  # not a copy the script relaunch started
    )


def _rendezvous(fabric: Fabric, timeout: timedelta) -> contextlib.AbstractContextManager[Any]:
    """Where the processes of a one-machine run meet: on loopback (see :mod:`flair_fabric.launch.rendezvous`)."""
    if starts_every_process_here(fabric):
        return loopback_rendezvous(timeout, keep=not starts_workers(fabric))
    launched = external_launch()
    if launched is None or fabric.world_size == 1:
        return contextlib.nullcontext()
    if launched.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return torchrun_rendezvous(timeout, single_node=launched.num_nodes == 1)
    if launched.num_nodes != 1:
        return contextlib.nullcontext()  # several machines: the addresses the user gave
    if launched.launcher == "SLURM":  # task 0 hosts the store on the port SLURM's environment names
        port = fabric.strategy.cluster_environment.main_port  # type: ignore[attr-defined]
        return loopback_rendezvous(timeout, keep=True, port=port, host=os.environ.get("SLURM_PROCID") == "0")
    return loopback_interface_only()  # torchrun without its agent's store: its store is rank 0's own


def run_on_every_rank(
    fabric: Fabric,
    function: Callable[[Fabric, Job], Result],
    job: Job,
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    preemption_signal: signal.Signals | None = None,
    result_types: Iterable[type] = (),
) -> Result:
    """``function(fabric, job)`` on every rank; the caller gets its own rank's result, or rank 0's from workers.

    The one launch path of flair-fabric. When this process starts every other one, they meet at a store it hosts on
    loopback (:mod:`flair_fabric.launch.rendezvous`). Relaunched copies of the script are killed when this rank raises.
    With workers, a Ctrl-C (or SIGTERM) that reaches this process is passed on to them (they stop together at their
    next agreement point and save, and this process waits for them); a second one ends them at once, reaps them and
    raises ``KeyboardInterrupt``. Workers never outlive this call. ``timeout``: of the rendezvous.

    Rank 0's result comes back from workers as plain data through a private file (``result_types``: the classes
    besides tensors and plain Python values it may hold), loaded with ``weights_only=True``."""
    with _rendezvous(fabric, timeout):
        if not starts_workers(fabric):
            if fabric.world_size > 1:
                atexit.unregister(destroy_process_group_at_exit)  # registered once, however many runs
                atexit.register(destroy_process_group_at_exit)
            try:
                return fabric.launch(lambda rank_fabric: _on_rank(rank_fabric, function, job))
            except BaseException:
                stop_started_processes(fabric)  # the relaunched ranks would wait for this one until their timeout
                raise
        return _run_in_workers(fabric, function, job, result_types, preemption_signal)


def destroy_process_group_at_exit() -> None:
    """A rank that is the script's own process ends its process group while Python is still whole: gloo's threads
    can otherwise abort the interpreter's finalization ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#190489), once seen here at the exit of a resumed run under the script relaunch."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _run_in_workers(
    fabric: Fabric,
    function: Callable[[Fabric, Job], Result],
    job: Job,
    result_types: Iterable[type],
    preemption_signal: signal.Signals | None,
) -> Result:
    assert isinstance(fabric.strategy, LAUNCHING_STRATEGIES)
    payload = transport.dumps(job) if fabric.strategy.start_method == "spawn" else job
    existing = set(multiprocessing.active_children())
    interrupted: list[str] = []

    def send(number: int) -> None:
        for worker in set(multiprocessing.active_children()) - existing:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, number)  # type: ignore[arg-type]

    def pass_on(signal_name: str) -> None:
        interrupted.append(signal_name)
        send(FORWARDED_SIGNAL)

    def pass_on_preemption(signal_name: str) -> None:  # the workers take it once, however often it comes
        assert preemption_signal is not None
        send(preemption_signal)

    with tempfile.TemporaryDirectory(prefix="flair-fabric-") as handoff_dir:  # 0o700: the user's alone
        handoff = Path(handoff_dir) / "rank0-result.pt"
        try:
            held = graceful_interrupts(pass_on, pass_on_preemption, preemption_signal)
            with environment_restored("MASTER_PORT"), held:
                run = functools.partial(
                    _run_in_worker, function=function, job=payload, handoff=handoff, preemption=preemption_signal
                )
                fabric.launch(run)
        except BaseException as error:
            stopped = _stop_and_reap(set(multiprocessing.active_children()) - existing)
            if interrupted or isinstance(error, KeyboardInterrupt):
                log.warning(f"interrupted: {stopped} worker process(es) stopped")
                raise KeyboardInterrupt(
                    f"{(interrupted or ['SIGINT'])[0]} received: the workers were stopped"
                ) from error
            raise
        return cast(Result, load_data(handoff, result_types))


def _on_rank(fabric: Fabric, function: Callable[[Fabric, Job], Result], job: Job) -> Result:
    """Every rank: its device, its guard, its logging; then the function."""
    flair.device = fabric.device
    relaunched = "LOCAL_RANK" in os.environ and external_launch() is None and fabric.local_rank > 0
    if relaunched or multiprocessing.parent_process() is not None:
        exit_with_parent()  # a copy of the script, or a worker, must not outlive the process that started it
    with log_on_global_zero_only(fabric):
        return function(fabric, job)


@contextlib.contextmanager
def log_on_global_zero_only(fabric: Fabric) -> Iterator[None]:
    """Silence the ``flair`` logger on every rank but global rank 0 for the duration of a run."""
    was_disabled = log.disabled
    log.disabled = was_disabled or not fabric.is_global_zero
    try:
        yield
    finally:
        log.disabled = was_disabled


def _stop_and_reap(workers: set[multiprocessing.process.BaseProcess], grace_seconds: float = 2.0) -> int:
    """Kill the workers still running (after a short grace period) and collect every exit status, so that no
    ``<defunct>`` process is left behind. Returns how many had to be killed."""
    deadline = time.monotonic() + grace_seconds
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    killed = 0
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            killed += 1
        worker.join()
    return killed


def one_cpu_thread_after_fork() -> None:
    """A forked worker computes with one CPU thread (as torch's DataLoader workers do). GNU OpenMP, torch's CPU
    thread pool, is not fork-safe: in a worker forked after its parent ran one parallel CPU operation (an earlier
    run, an evaluation, any sizeable tensor operation in the notebook), the first parallel operation waits forever
    for threads that exist only in the parent. Spawned workers and script launches keep their threads."""
    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)


def _run_in_worker(
    fabric: Fabric,
    function: Callable[[Fabric, Any], Any],
    job: Any,
    handoff: Path,
    preemption: signal.Signals | None = None,
) -> None:
    """One spawned or forked rank: unpack the job, run it; global rank 0 writes its result to ``handoff``.

    Signals are held from the start: a Ctrl-C during set-up stops every rank at the first agreement point."""
    forget_inherited_interrupts()
    if not isinstance(job, bytes):  # inherited: a forked worker
        one_cpu_thread_after_fork()
    with graceful_interrupts(lambda signal_name: None, lambda signal_name: None, preemption):
        flair.device = fabric.device  # before the job is rebuilt: flair models move to flair.device when made
        if isinstance(job, bytes):
            cuda_devices = [fabric.device.index] if fabric.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda_devices):  # rebuilding a model draws random initial weights
                job = transport.loads(job)
        result = _on_rank(fabric, function, job)
        if fabric.is_global_zero:
            save_private(result, handoff)
