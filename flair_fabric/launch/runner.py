"""The one job runner: every job of flair-fabric (training, the language-model trainer, ``predict``, ``evaluate``)
runs through :func:`run_job`, which builds the Fabric, starts the processes, guards them, and hands the result back.

A :class:`Job` is what runs on every rank (``run_on_rank(fabric)``), what spawned or forked workers receive
(``for_workers()``), and what the caller does with rank 0's result afterwards (``hand_back(result)``). On every rank
the runner sets ``flair.device`` from Fabric (the local rank's device), keeps the ``flair`` logger quiet on all ranks
but global rank 0, turns a timed-out collective into an error that says where the rank was (the job's
:class:`~flair_fabric.distributed.stalls.Position`), and makes a copy of the script that rank 0 relaunched exit when
rank 0 is gone; when this process starts every other one, they meet at a store it hosts on loopback
(:mod:`flair_fabric.launch.rendezvous`), and copies it relaunched are killed if it raises.

With the script relaunch (``strategy="ddp"``) or under torchrun/SLURM the caller is itself a rank, so the function
simply runs in it. Spawned and forked workers (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) are separate
processes: spawned ones receive the job through :mod:`~flair_fabric.launch.transport` (flair models by their flair
state) through a private temporary file, forked ones inherit it, and rank 0's result comes back as plain data
through another one. (Not through Fabric's return queue: the launcher joins the workers before it reads the queue,
so a result larger than a pipe buffer would block rank 0 forever. Nor the job through the pipe that starts a spawned
worker: a job larger than its buffer blocks the caller until the worker reads it, forever where the worker exits
first, as in a script without ``if __name__ == "__main__":``, :mod:`~flair_fabric.launch.main_guard`.)
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
from abc import ABC, abstractmethod
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, cast

import flair
import torch
from lightning.fabric import Fabric
from torch.multiprocessing import ProcessExitedException

from flair_fabric.distributed.stalls import Position, explain_timeouts, prepare_patient_group
from flair_fabric.launch import transport
from flair_fabric.launch.config import LaunchConfig, build_fabric
from flair_fabric.launch.environment import environment_restored, external_launch, mark_process_group_as_own
from flair_fabric.launch.failures import (
    FORWARDED_SIGNAL,
    exit_with_parent,
    forget_inherited_interrupts,
    graceful_interrupts,
    stop_started_processes,
)
from flair_fabric.launch.main_guard import (
    IN_THE_CALLER,
    MARK_VARIABLE,
    MissingMainGuard,
    refuse_a_run_while_spawned,
    watch_for_a_missing_guard,
)
from flair_fabric.launch.rendezvous import (
    interface_facing,
    loopback_interface_only,
    loopback_rendezvous,
    torchrun_rendezvous,
)
from flair_fabric.state.policy import REQUEUE_EXIT_CODE
from flair_fabric.state.safe_loading import load_data, save_private
from flair_fabric.strategies import start_method, starts_processes_itself
from flair_fabric.strategies import starts_workers as strategy_starts_workers

log = logging.getLogger("flair")

PREEMPTED_RANKS_GRACE_SECONDS = 60.0
"""How long global rank 0 of a script relaunch waits for the ranks it started to exit with the requeue code after a
preemption (each writes its part of the checkpoint first, then ends alike) before it kills them."""


def starts_workers(fabric: Fabric) -> bool:
    """Whether ``fabric.launch`` starts spawned or forked workers instead of running in the calling process."""
    return strategy_starts_workers(fabric.strategy)


def starts_every_process_here(fabric: Fabric) -> bool:
    """Whether this process starts all other processes of the run, on this machine (relaunch, spawn, fork)."""
    return (
        starts_processes_itself(fabric.strategy)
        and fabric.world_size > 1
        and getattr(fabric.strategy, "num_nodes", 1) == 1
        and external_launch() is None
        and "LOCAL_RANK" not in os.environ  # not a copy the script relaunch started
    )


def _rendezvous(fabric: Fabric, timeout: timedelta) -> contextlib.AbstractContextManager[Any]:
    """Where the processes of a one-machine run meet: on loopback (see :mod:`flair_fabric.launch.rendezvous`)."""
    if starts_every_process_here(fabric):
        return loopback_rendezvous(timeout, keep=not starts_workers(fabric))
    launched = external_launch()
    if fabric.world_size == 1:
        return contextlib.nullcontext()
    if launched and launched.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return torchrun_rendezvous(timeout, single_node=launched.num_nodes == 1)
    if (launched.num_nodes if launched else getattr(fabric.strategy, "num_nodes", 1)) != 1:
        # several machines: the addresses the user gave, and the interface that reaches the main one
        return interface_facing(fabric.strategy.cluster_environment.main_address)  # type: ignore[attr-defined]
    if launched is None:
        return contextlib.nullcontext()
    if launched.launcher == "SLURM":  # task 0 hosts the store on the port SLURM's environment names
        port = fabric.strategy.cluster_environment.main_port  # type: ignore[attr-defined]
        return loopback_rendezvous(timeout, keep=True, port=port, host=os.environ.get("SLURM_PROCID") == "0")
    return loopback_interface_only()  # torchrun without its agent's store: its store is rank 0's own


class Job(ABC):
    """One job run on every rank by :func:`run_job`.

    ``run_on_rank(fabric)`` runs on every rank (in the caller itself under the script relaunch, torchrun or SLURM);
    spawned or forked workers run ``for_workers()`` instead (what a worker needs, without what stays with the caller),
    and global rank 0's result comes back to the caller through a private file, as plain data (``result_types``: the
    classes besides tensors and plain values it may hold); then the caller's ``hand_back(result)`` gives the caller's
    objects what the workers computed and returns what the entry point returns. ``position`` says where a rank is,
    for the error a timed-out collective raises."""

    result_types: ClassVar[tuple[type, ...]] = ()
    preemption_signal: signal.Signals | None = None
    """The signal that means "preempted" (training's ``requeue_signal``); the runner passes it on to workers."""

    def __init__(self) -> None:
        self.position = Position()

    @abstractmethod
    def run_on_rank(self, fabric: Fabric) -> Any:
        """The job's work on one rank."""

    def for_workers(self) -> Job:
        """What spawned or forked workers run (spawned ones receive it by its flair state)."""
        return self

    def hand_back(self, result: Any) -> Any:
        """In the caller, after the workers: give the caller's objects rank 0's ``result``; the entry point's return
        value."""
        return result

    def stopped(self) -> None:
        """In the caller, after a second interrupt stopped the workers at once (before ``KeyboardInterrupt``)."""
        return None


def run_job(job: Job, launch: LaunchConfig) -> Any:
    """Run ``job`` on every rank of the processes ``launch`` describes; the caller gets the job's result (rank 0's,
    after spawned or forked workers, handed back by the job).

    The one launch path of flair-fabric. When this process starts every other one, they meet at a store it hosts on
    loopback (:mod:`flair_fabric.launch.rendezvous`). Relaunched copies of the script are killed when this rank raises.
    With workers, a Ctrl-C (or SIGTERM) that reaches this process is passed on to them (they stop together at their
    next agreement point and save, and this process waits for them); a second one ends them at once, reaps them and
    raises ``KeyboardInterrupt``. Workers never outlive this call; workers that stopped for a preemption make it exit
    with :data:`~flair_fabric.state.policy.REQUEUE_EXIT_CODE`. A run started while a spawned worker imports the script
    again (no ``if __name__ == "__main__":``) raises :class:`~flair_fabric.launch.main_guard.MissingMainGuard`, there
    and in the caller."""
    refuse_a_run_while_spawned()
    fabric = build_fabric(launch)
    timeout = launch.collective_timeout
    with _rendezvous(fabric, timeout):
        if not starts_workers(fabric):
            if fabric.world_size > 1:
                atexit.unregister(destroy_process_group_at_exit)  # registered once, however many runs
                atexit.register(destroy_process_group_at_exit)
            try:
                return fabric.launch(functools.partial(_on_rank, job=job, timeout=timeout))
            except BaseException as error:
                # the relaunched ranks would wait for this one until their timeout; preempted ones exit by themselves
                preempted = isinstance(error, SystemExit) and error.code == REQUEUE_EXIT_CODE
                stop_started_processes(fabric, grace_seconds=PREEMPTED_RANKS_GRACE_SECONDS if preempted else 0.0)
                raise
        try:
            result = _run_in_workers(fabric, job, timeout)
        except KeyboardInterrupt:
            job.stopped()
            raise
        except ProcessExitedException as exited:
            if exited.exit_code == REQUEUE_EXIT_CODE:  # the workers were preempted and wrote their checkpoint
                raise SystemExit(REQUEUE_EXIT_CODE) from None
            raise
        return job.hand_back(result)


def destroy_process_group_at_exit() -> None:
    """A rank that is the script's own process (at exit), or a worker whose job is done, ends its process groups while
    Python is still whole: gloo's threads can otherwise abort the interpreter's finalization ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _run_in_workers(fabric: Fabric, job: Job, timeout: timedelta) -> Any:
    worker_job = job.for_workers()
    spawned = start_method(fabric.strategy) == "spawn"
    preemption_signal = job.preemption_signal
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
        payload: Job | Path = worker_job
        if spawned:  # by a file: the pipe that starts a worker then carries a small object, which never blocks it
            payload = Path(handoff_dir) / "job.pickle"
            transport.dump_private(worker_job, payload)
        missing_guard: Path | None = None
        try:
            held = graceful_interrupts(pass_on, pass_on_preemption, preemption_signal)
            with environment_restored("MASTER_PORT", MARK_VARIABLE), held:
                if spawned:
                    missing_guard = watch_for_a_missing_guard(Path(handoff_dir))
                run = functools.partial(
                    _run_in_worker, job=payload, handoff=handoff, preemption=preemption_signal, timeout=timeout
                )
                fabric.launch(run)
        except BaseException as error:
            stopped = _stop_and_reap(set(multiprocessing.active_children()) - existing)
            if missing_guard is not None and missing_guard.exists():
                raise MissingMainGuard(IN_THE_CALLER) from error
            if interrupted or isinstance(error, KeyboardInterrupt):
                log.warning(f"interrupted: {stopped} worker process(es) stopped")
                raise KeyboardInterrupt(
                    f"{(interrupted or ['SIGINT'])[0]} received: the workers were stopped"
                ) from error
            raise
        return load_data(handoff, job.result_types)


def _on_rank(fabric: Fabric, job: Job, timeout: timedelta) -> Any:
    """Every rank: its device, its guard, its logging, its stall diagnostics, the group rank 0's file work is waited
    for on; then the job."""
    flair.device = fabric.device
    relaunched = "LOCAL_RANK" in os.environ and external_launch() is None and fabric.local_rank > 0
    mark_process_group_as_own()
    if relaunched or multiprocessing.parent_process() is not None:
        exit_with_parent()  # a copy of the script, or a worker, must not outlive the process that started it
    with log_on_global_zero_only(fabric), explain_timeouts(fabric, job.position, timeout):
        # every job waits for rank 0's file work on it: made by every rank before the job (a rank 0 that fails early
        # leaves the others in a barrier that ends when its sockets close, not in the group's making)
        prepare_patient_group(fabric)
        return job.run_on_rank(fabric)


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
    job: Job | Path,
    handoff: Path,
    preemption: signal.Signals | None,
    timeout: timedelta,
) -> None:
    """One spawned or forked rank: unpack the job (a spawned one reads it from its file), run it; global rank 0
    writes its result to ``handoff``.

    Signals are held from the start: a Ctrl-C during set-up stops every rank at the first agreement point."""
    forget_inherited_interrupts()
    if not isinstance(job, Path):  # inherited: a forked worker
        one_cpu_thread_after_fork()
    with graceful_interrupts(lambda signal_name: None, lambda signal_name: None, preemption):
        flair.device = fabric.device  # before the job is rebuilt: flair models move to flair.device when made
        if isinstance(job, Path):
            cuda_devices = [fabric.device.index] if fabric.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda_devices):  # rebuilding a model draws random initial weights
                job = cast(Job, transport.load_file(job))
        result = _on_rank(fabric, job, timeout)
        if fabric.is_global_zero:
            save_private(result, handoff)
    destroy_process_group_at_exit()  # the worker ends next: its gloo threads must not outlive Python's finalization
