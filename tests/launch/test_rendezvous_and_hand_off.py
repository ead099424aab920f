"""Hand-offs and checkpoints hold plain data in files only their owner can read; the rendezvous port is held from
the moment it is chosen and listens on loopback only; gloo and NCCL use the loopback interface on one machine, and a
run over several machines the addresses it was given."""

from __future__ import annotations

import fcntl
import os
import pickle
import socket
import struct
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed import TCPStore

import flair_fabric
from flair_fabric.launch import rendezvous, runner
from flair_fabric.launch.config import make_launch_config
from flair_fabric.launch.rendezvous import loopback_interface_only, loopback_rendezvous, torchrun_rendezvous
from flair_fabric.state.safe_loading import UnsafeFile, as_plain_data, checked_load, save_private

from ..plugin_support import listening_sockets_of_job
from ..support import run_on_ranks, small_trec, tiny_text_classifier


class _CreatesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def test_the_job_spawned_workers_read_is_a_private_file_whatever_the_umask(tmp_path: Path) -> None:
    from flair_fabric.launch import transport

    previous = os.umask(0)
    try:
        transport.dump_private({"job": [1, 2]}, tmp_path / "job.pkl")
    finally:
        os.umask(previous)
    assert (tmp_path / "job.pkl").stat().st_mode & 0o777 == 0o600
    with (tmp_path / "job.pkl").open("rb") as file:
        assert transport.load(file) == {"job": [1, 2]}


def test_a_hand_off_file_is_private_and_loads_as_data_only(tmp_path: Path) -> None:
    save_private({"weights": torch.ones(2), "score": 0.5}, tmp_path / "result.pt")
    assert (tmp_path / "result.pt").stat().st_mode & 0o777 == 0o600
    assert checked_load(tmp_path / "result.pt")["score"] == 0.5
    torch.save({"payload": _CreatesAFile(tmp_path / "code-ran")}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeFile, match=r"evil.pt does not hold plain data"):
        checked_load(tmp_path / "evil.pt")
    assert not (tmp_path / "code-ran").exists()


def test_model_card_values_become_plain_data() -> None:
    card = {"flair_version": torch.__version__, "sampler": object(), "plugins": [{"lr": 0.1}], 3: (1, None)}
    plain = as_plain_data(card)
    assert type(plain["flair_version"]) is str and isinstance(plain["sampler"], str)
    assert plain["plugins"] == [{"lr": 0.1}] and plain[3] == (1, None)


def test_the_rendezvous_port_is_held_from_the_start_and_listens_on_loopback_only() -> None:
    with loopback_rendezvous(timedelta(seconds=10), keep=False) as hosted:
        with socket.socket() as intruder, pytest.raises(OSError):  # no other program can take the port meanwhile
            intruder.bind(("127.0.0.1", hosted.port))
        assert hosted.listener.getsockname()[0] == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", hosted.port), timeout=5):
            pass


IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interfaces() -> set[str]:
    """The names of this machine's loopback interfaces, read from the kernel (IFF_LOOPBACK in their flags)."""
    folder = Path("/sys/class/net")
    if not folder.is_dir():
        pytest.skip("no /sys/class/net to read the network interfaces from")
    return {entry.name for entry in folder.iterdir() if int((entry / "flags").read_text(), 16) & 0x8}


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine on an interface other than loopback, if it has one."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return address
    return None


def _route_interface(address: str) -> str:
    """The interface that holds the source address the kernel picks for ``address``, as ``ip route get`` and ``ip
    addr`` say (the independent reference; for one of this machine's own addresses, the interface holding it)."""
    route = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True, text=True, check=True).stdout
    words = route.split()
    source = words[words.index("src") + 1]
    for line in subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True
    ).stdout.splitlines():
        fields = line.split()
        if fields[3].split("/")[0] == source:
            return fields[1]
    raise AssertionError(f"no interface holds {source}")


def _interfaces_set() -> list[str | None]:
    return [os.environ.get(name) for name in IFNAMES]


def test_a_one_machine_rendezvous_puts_gloo_and_nccl_on_the_loopback_interface_unless_the_user_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/security.md: gloo and NCCL sockets of every rank use the loopback interface (GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME = lo), unless the user set them; the environment is put back afterwards."""
    interfaces = loopback_interfaces()
    for name in IFNAMES:
        monkeypatch.delenv(name, raising=False)
    with loopback_rendezvous(timedelta(seconds=10), keep=False):
        chosen = _interfaces_set()
    assert chosen[0] == chosen[1] and chosen[0] in interfaces, chosen
    with loopback_interface_only():  # a one-machine run whose store torchrun's rank 0 hosts
        assert _interfaces_set() == chosen
    assert _interfaces_set() == [None, None]
    for name in IFNAMES:
        monkeypatch.setenv(name, "eth7")
    for block in (loopback_rendezvous(timedelta(seconds=10), keep=False), loopback_interface_only()):
        with block:
            assert _interfaces_set() == ["eth7", "eth7"], "the user's choice is kept"


@pytest.fixture
def torchrun_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TCPStore, str]]:
    """A stand-in for torchrun's agent store (on every interface, as torchrun's), announced to this process as
    global rank 0 of a torchrun attempt at ``MASTER_ADDR``: an address of this machine other than loopback where it
    has one. The stores rank 0 hosts are closed afterwards."""
    address = non_loopback_address() or "127.0.0.1"
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    environment = {"MASTER_ADDR": address, "MASTER_PORT": str(agent.port), "RANK": "0", "TORCHELASTIC_RUN_ID": "t3"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    for name in (*IFNAMES, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    kept = len(rendezvous._kept_for_this_process)
    yield agent, address
    while len(rendezvous._kept_for_this_process) > kept:
        hosted = rendezvous._kept_for_this_process.pop()
        hosted.listener.detach()  # the store owns the descriptor and closes it when it goes
        del hosted


def _listening_on(port: int) -> list[str]:
    return [address for pid, address in listening_sockets_of_job() if address.endswith(f":{port}")]


def test_one_node_torchrun_rank_0_hosts_the_attempts_store_on_loopback(torchrun_agent: tuple[TCPStore, str]) -> None:
    """docs/security.md: under a one-node torchrun, global rank 0 hosts a store of the attempt on loopback, announced
    through torchrun's store (whatever address torchrun's was given), and gloo and NCCL use the loopback interface."""
    agent, _ = torchrun_agent
    with torchrun_rendezvous(timedelta(seconds=10), single_node=True):
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        assert host == "127.0.0.1"
        assert agent.get("flair_fabric/t3/0/store").decode() == f"127.0.0.1:{port}"
        assert _listening_on(port) == [f"127.0.0.1:{port}"]
        chosen = _interfaces_set()
        assert chosen[0] == chosen[1] and chosen[0] in loopback_interfaces(), chosen


def test_torchrun_over_several_nodes_uses_the_address_it_was_given(torchrun_agent: tuple[TCPStore, str]) -> None:
    """docs/security.md: a multi-node run uses the addresses you give: rank 0's store of the attempt listens on
    MASTER_ADDR, and gloo and NCCL use the interface that reaches it, not loopback (docs/launching.md)."""
    agent, address = torchrun_agent
    facing = _route_interface(address)
    with torchrun_rendezvous(timedelta(seconds=10), single_node=False):
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        assert host == address and agent.get("flair_fabric/t3/0/store").decode() == f"{address}:{port}"
        assert _listening_on(port) == [f"{address}:{port}"]
        assert _interfaces_set() == [facing, facing] and facing not in loopback_interfaces()


def _what_the_ranks_would_see(config: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run the job runner with Fabric's launch replaced: the environment the processes would start in, and the
    sockets this process listens on meanwhile (no process is started)."""
    seen: dict[str, Any] = {}

    def launch(fabric: Any, function: Any) -> None:
        seen.update({name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", *IFNAMES)})
        seen["listening"] = [address for pid, address in listening_sockets_of_job() if pid == os.getpid()]

    monkeypatch.setattr(Fabric, "launch", launch)
    run_on_ranks(config, lambda rank_fabric, argument: None, None)
    return seen


@pytest.mark.parametrize("launcher", ["script", "SLURM"])
def test_a_run_over_several_machines_uses_the_addresses_given(monkeypatch: pytest.MonkeyPatch, launcher: str) -> None:
    """docs/security.md: a multi-node run (num_nodes > 1, SLURM over several nodes) uses MASTER_ADDR/MASTER_PORT as
    given: no store on loopback is hosted, nothing is pinned to the loopback interface."""
    given = {"MASTER_ADDR": "10.20.30.40", "MASTER_PORT": "29517"}
    if launcher == "SLURM":
        given |= {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": "0",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_JOB_NAME": "train",
        }
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    for name in IFNAMES:
        monkeypatch.delenv(name, raising=False)
    before = [address for pid, address in listening_sockets_of_job() if pid == os.getpid()]
    config = make_launch_config(
        accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", precision=None, use_amp=False
    )
    seen = _what_the_ranks_would_see(config, monkeypatch)
    assert (seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("10.20.30.40", "29517")
    facing = _route_interface("10.20.30.40")  # the interface of the route to the main address
    assert [seen[name] for name in IFNAMES] == [facing, facing] and facing not in loopback_interfaces()
    assert seen["listening"] == before, "no store may be hosted for a run over several machines"
    # docs/launching.md: the user's choice of interface is never overridden
    for name in IFNAMES:
        monkeypatch.setenv(name, "eth7")
    config = make_launch_config(
        accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", precision=None, use_amp=False
    )
    kept = _what_the_ranks_would_see(config, monkeypatch)
    assert [kept[name] for name in IFNAMES] == ["eth7", "eth7"]
    for name in IFNAMES:
        monkeypatch.delenv(name)
    # the same path on one machine does host its store on loopback and pins the interface (the contrast)
    for name in given:
        monkeypatch.delenv(name)
    one_machine = make_launch_config(
        accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", precision=None, use_amp=False
    )
    seen = _what_the_ranks_would_see(one_machine, monkeypatch)
    assert seen["MASTER_ADDR"] == "127.0.0.1" and f"127.0.0.1:{seen['MASTER_PORT']}" in seen["listening"]
    assert seen[IFNAMES[0]] in loopback_interfaces()


@pytest.mark.multiprocess
def test_the_result_forked_workers_hand_back_is_loaded_as_data_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/security.md: the caller reads global rank 0's hand-off with torch.load(weights_only=True) and an
    allow-list: a hand-off file that holds code (here written by rank 0 in place of its result) is refused, and the
    code in it never runs."""
    marker = tmp_path / "code-ran"

    def hand_back_code(data: Any, path: Path) -> None:  # forked workers inherit it
        save_private({"result": data, "payload": _CreatesAFile(marker)}, path)

    monkeypatch.setattr(runner, "save_private", hand_back_code)
    # docs/security.md: the hand-off is a file only its owner can read, in a folder only its owner can open (the
    # runner's own, as the caller finds it before loading)
    modes: list[tuple[int, int]] = []
    load_data = runner.load_data

    def noted_load(handoff: Path, allowed: Any) -> Any:
        modes.append((handoff.stat().st_mode & 0o777, handoff.parent.stat().st_mode & 0o777))
        return load_data(handoff, allowed)

    monkeypatch.setattr(runner, "load_data", noted_load)
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    try:
        with pytest.raises(pickle.UnpicklingError, match=r"Weights only load failed"):
            flair_fabric.evaluate(
                model,
                corpus.test,
                model.label_type,
                mini_batch_size=4,
                accelerator="cpu",
                devices=2,
                strategy="ddp_fork",
            )
    finally:
        assert not marker.exists(), "unpickling the hand-off ran the code in it"
    assert modes == [(0o600, 0o700)]
