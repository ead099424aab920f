"""What the one launch path sets up around a run, checked without starting any process: the rendezvous store waits
at most ``collective_timeout``, and a rank that is the script's own process tears its process group down at exit."""

from __future__ import annotations

import atexit
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
from lightning.fabric import Fabric

from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.launch import rendezvous
from flair_fabric.launch.runner import destroy_process_group_at_exit

from ..support import small_trec, tiny_text_classifier

SEVEN_SECONDS = timedelta(seconds=7)


class _Launched(Exception):
    """Fabric.launch was reached: the processes would start here."""


class _Store:
    """Stands in for torch's TCPStore: remembers how long it would wait, holds keys in memory."""

    timeouts: list[timedelta]
    keys: dict[str, bytes]

    def __init__(self, *args: Any, timeout: timedelta, **kwargs: Any) -> None:
        _Store.timeouts.append(timeout)

    def set(self, key: str, value: str) -> None:
        _Store.keys[key] = value.encode()

    def get(self, key: str) -> bytes:
        return _Store.keys[key]


TORCHRUN_RANK_0 = {  # rank 0 of a 2-process torchrun job on one node, first attempt
    "RANK": "0",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
    "TORCHELASTIC_RUN_ID": "test",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}

SLURM_TASK_0 = {  # task 0 of a 2-task SLURM job on one node (srun --ntasks-per-node=2)
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "flair-fabric-test",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29998",
}


@pytest.fixture
def launch_stopped(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Train up to the point where the processes would start (stores are stand-ins, ``Fabric.launch`` raises)."""
    _Store.timeouts, _Store.keys = [], {}
    kept: list[Any] = []
    monkeypatch.setattr(rendezvous, "TCPStore", _Store)
    monkeypatch.setattr(rendezvous, "_kept_for_this_process", kept)

    def launch(self: Fabric, *args: Any, **kwargs: Any) -> Any:
        raise _Launched

    monkeypatch.setattr(Fabric, "launch", launch)
    for name in ("LOCAL_RANK", *SLURM_TASK_0, *TORCHRUN_RANK_0):
        monkeypatch.delenv(name, raising=False)

    def train(base_path: Path, **kwargs: Any) -> None:
        corpus = small_trec()
        with pytest.raises(_Launched):
            FabricTrainer(tiny_text_classifier(corpus), corpus).train(
                base_path, max_epochs=1, accelerator="cpu", devices=2, **kwargs
            )

    yield train
    for hosted in kept:
        hosted.listener.close()


@pytest.mark.parametrize(
    ("environment", "arguments"),
    [
        ({}, {"strategy": "ddp", "collective_timeout": 7}),
        ({}, {"strategy": "ddp_fork", "collective_timeout": SEVEN_SECONDS}),
        ({}, {"strategy": "ddp_spawn", "collective_timeout": 7.0}),
        ({}, {"strategy": FlairDDPStrategy(timeout=SEVEN_SECONDS)}),
        (TORCHRUN_RANK_0, {"strategy": "ddp", "collective_timeout": 7}),
        (SLURM_TASK_0, {"strategy": "ddp", "collective_timeout": 7}),
    ],
    ids=["script-relaunch", "fork", "spawn", "strategy-object", "torchrun", "slurm"],
)
def test_the_rendezvous_waits_at_most_the_collective_timeout(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    launch_stopped: Callable[..., None],
    environment: dict[str, str],
    arguments: dict[str, Any],
) -> None:
    """``collective_timeout`` (or a strategy object's ``timeout=``) bounds the rendezvous: every store the run
    hosts or connects to waits 7 s for the other ranks, not the 10-minute default."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    launch_stopped(tmp_path, **arguments)
    stores = 2 if environment is TORCHRUN_RANK_0 else 1  # under torchrun: its agent's store and the one rank 0 hosts
    assert _Store.timeouts == [SEVEN_SECONDS] * stores


@pytest.mark.parametrize(
    "environment", [{}, TORCHRUN_RANK_0, SLURM_TASK_0], ids=["script-relaunch", "torchrun", "slurm"]
)
def test_a_rank_that_is_the_scripts_own_process_destroys_its_process_group_at_exit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    launch_stopped: Callable[..., None],
    environment: dict[str, str],
) -> None:
    """Before a rank that runs in the script's own process starts training, it registers an exit hook, and that hook
    destroys an initialised process group."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    registered: list[Callable[..., Any]] = []
    register = atexit.register

    def recording_register(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        registered.append(function)
        return register(function, *args, **kwargs)

    monkeypatch.setattr(atexit, "register", recording_register)
    launch_stopped(tmp_path, strategy="ddp")
    monkeypatch.setattr(atexit, "register", register)
    assert destroy_process_group_at_exit in registered, "no exit hook tears the process group down"

    for name in environment:  # torchrun's or SLURM's variables would send the process group to their store
        monkeypatch.delenv(name)
    with socket.socket() as probe:  # a free port for a process group of one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        for function in registered:
            if function is destroy_process_group_at_exit:
                function()
        assert not torch.distributed.is_initialized(), "the exit hook leaves the process group standing"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
