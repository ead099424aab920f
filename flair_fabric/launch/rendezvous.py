"""The rendezvous of a one-machine run: hosted by the process that starts the others, on loopback only.

PyTorch's rendezvous store (a ``TCPStore``) has no authentication, and the one ``init_process_group`` starts on
rank 0 listens on every interface. For a run whose processes all live on this machine and are started here (the
script relaunch, spawned or forked workers), the starting process hosts the store itself instead: on a socket it
binds to ``127.0.0.1`` and holds from the moment the port is chosen (so no other program can take the port while the
workers import, or ``ddp_spawn`` would fail with ``EADDRINUSE``), and every rank connects to it as a client (the
same arrangement as under torchrun's agent, ``TORCHELASTIC_USE_AGENT_STORE``). gloo and NCCL are told to use the
loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless the user set them). Under SLURM on one
node task 0 hosts it on loopback; under torchrun global rank 0 hosts one per attempt (:func:`torchrun_rendezvous`).
Runs on several machines keep the addresses they were given (see ``docs/security.md``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from flair_fabric.launch.environment import environment_restored

log = logging.getLogger("flair")

LOOPBACK = "127.0.0.1"
_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if it has one."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


def interface_towards(host: str) -> str | None:
    """The name of the network interface through which this machine reaches ``host`` (the route the kernel picks for
    it), or ``None`` where that cannot be found (no IPv4 route, an address on no interface, not Linux)."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP "connect" sends nothing: the kernel only chooses route and source
            source = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            if _ipv4_address(name) == source:
                return name
    except OSError:
        return None
    return None


def _ipv4_address(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (Linux ``SIOCGIFADDR``), or ``None``."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
            request = struct.pack("256s", interface.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(query.fileno(), 0x8915, request)[20:24])
    except (OSError, ImportError):
        return None


@contextmanager
def interface_facing(main_address: str) -> Iterator[None]:
    """gloo and NCCL on the interface that reaches ``main_address`` (several machines), unless the user chose one
    (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``). Left to themselves they take the address this machine's name
    resolves to, which is a loopback address on many systems (Debian's ``127.0.1.1`` line in ``/etc/hosts``): the
    other machines then cannot connect."""
    interface = interface_towards(main_address)
    with environment_restored("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
            log.info(
                f"collectives on {os.environ['GLOO_SOCKET_IFNAME']} (gloo) / {os.environ['NCCL_SOCKET_IFNAME']} (NCCL):"
                f" the interface that reaches {main_address}"
            )
        yield


@dataclass
class HostedStore:
    """A rendezvous store this process hosts, and the listening socket it serves on."""

    listener: socket.socket
    store: TCPStore

    @property
    def port(self) -> int:
        """The port the store listens on (on loopback)."""
        return int(self.listener.getsockname()[1])


def host_store(timeout: timedelta, port: int = 0, address: str = LOOPBACK) -> HostedStore:
    """Start a rendezvous store server on a port bound now (``0``: any free one) of ``address`` (loopback by
    default); the ranks connect to it as clients."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, port))
    listener.listen(128)
    store = TCPStore(
        address,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=listener.fileno(),
    )
    return HostedStore(listener, store)


_kept_for_this_process: list[HostedStore] = []


@contextmanager
def loopback_rendezvous(
    timeout: timedelta, *, keep: bool, port: int = 0, host: bool = True
) -> Iterator[HostedStore | None]:
    """Inside the block the processes of the run meet at a store on loopback and talk over the loopback interface.

    ``host``: this process hosts the store (on ``port``, ``0`` for any free one); otherwise it only connects to the one
    another process of this machine hosts on ``port``. ``keep``: the store outlives the block (this process is rank 0,
    whose process group goes on using it); otherwise it closes with the block. The environment is put back after."""
    hosted = host_store(timeout, port) if host else None
    interface = loopback_interface()
    with environment_restored(*_VARIABLES):
        chosen_port = hosted.port if hosted is not None else port
        os.environ.update(
            {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(chosen_port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        )
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        try:
            yield hosted
        finally:
            if hosted is not None and keep:
                _kept_for_this_process.append(hosted)
            elif hosted is not None:
                hosted.listener.close()


@contextmanager
def torchrun_rendezvous(timeout: timedelta, *, single_node: bool) -> Iterator[None]:
    """Under torchrun: a store of this attempt's own, hosted by global rank 0 and announced through torchrun's agent
    store, which every attempt shares. (Keys of an earlier attempt left in the agent's store would send a restarted
    rank to a dead peer: gloo's "Connection refused" after ``--max-restarts``.) On one node it listens on loopback
    and the collectives use the loopback interface; on several nodes on ``MASTER_ADDR``, and the collectives use the
    interface that reaches it (see :func:`interface_facing`)."""
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = (
        f"flair_fabric/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    address = LOOPBACK if single_node else socket.gethostbyname(os.environ["MASTER_ADDR"])
    if int(os.environ["RANK"]) == 0:
        hosted = host_store(timeout, address=address)
        _kept_for_this_process.append(hosted)  # the process group uses it for the rest of this process
        agent.set(f"{attempt}/store", f"{address}:{hosted.port}")
    host, port = agent.get(f"{attempt}/store").decode().rsplit(":", 1)  # waits for rank 0
    with environment_restored(*_VARIABLES):
        os.environ.update({"MASTER_ADDR": host, "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "True"})
        with loopback_interface_only() if single_node else interface_facing(host):
            yield


@contextmanager
def loopback_interface_only() -> Iterator[None]:
    """gloo and NCCL on the loopback interface (a one-machine run whose store another program hosts)."""
    interface = loopback_interface()
    with environment_restored("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        yield
