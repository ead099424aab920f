"""Test hosts: Linux network namespaces with their own interfaces, addresses and loopback, joined by a bridge.

Each host is a namespace with one interface (``ffeth0``) on a private test network (``10.213.<n>.0/24``) and, if
asked, a second one (``ffside``) on a network that does not reach the other hosts. Its hosts file is Debian's: the
machine's name resolves to ``127.0.1.1``, which makes gloo bind to loopback unless told which interface to use.
Everything is made by the test and removed by it (namespaces, links, the processes started in them), also when the
test fails. Needs root and ``ip``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..support import RunCrashed


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One test host: a network namespace, its address on the test network and its own folder (no shared disk)."""

    namespace: str
    address: str
    folder: Path
    started: list[subprocess.Popen] = field(default_factory=list)

    def start(
        self, command: list[str], env: dict[str, str], output: Path | None = None, **options: Any
    ) -> subprocess.Popen:
        """Start ``command`` inside this host (its own process group, ended by the fixture); its output is piped, or
        written to the file ``output`` (a long-running process whose pipe nobody reads would block on it)."""
        with output.open("w") if output is not None else contextlib.nullcontext(subprocess.PIPE) as stdout:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, *command],
                env=env,
                cwd=self.folder,
                start_new_session=True,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                text=True,
                **options,
            )
        self.started.append(process)
        return process

    def link_down(self) -> None:
        """Cut this host off the test network."""
        _ip("-n", self.namespace, "link", "set", "ffeth0", "down")

    def end_everything(self) -> None:
        """Kill what was started here, and every process left in the namespace (torchrun starts its workers in
        sessions of their own, out of reach of the process-group kill)."""
        for process in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True).stdout
        for pid in listed.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for process in self.started:
            with contextlib.suppress(Exception):
                process.communicate(timeout=10)


REQUIRED = "FLAIR_FABRIC_REQUIRE_HOSTS"
"""Set to 1 by .ci/run: there the hosts tests must run, and a machine that cannot make namespaces fails them."""


def skip_without_namespaces() -> None:
    """Skip (with the reason) where network namespaces cannot be made; fail instead where they are required."""
    reason = None
    if os.geteuid() != 0:
        reason = "test hosts are network namespaces: run as root (CI does)"
    elif shutil.which("ip") is None:
        reason = "test hosts need the `ip` command (iproute2; .ci/run installs it)"
    if reason is not None:
        if os.environ.get(REQUIRED) == "1":
            raise RunCrashed(f"{REQUIRED}=1 but the hosts tests cannot run: {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def hosts_on_a_network(folder: Path, count: int = 2, side_interfaces: bool = False) -> Iterator[list[Host]]:
    """``count`` hosts on a bridge of their own; removed with everything started in them when the block ends."""
    skip_without_namespaces()
    tag = f"ff{os.getpid() % 100000}"
    subnet = 213 + os.getpid() % 20
    switch = f"{tag}sw"
    namespaces = [switch]
    hosts: list[Host] = []
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "ffbr", "type", "bridge")
        _ip("-n", switch, "link", "set", "ffbr", "up")
        for index in range(count):
            name = f"{tag}h{index}"
            _ip("netns", "add", name)
            namespaces.append(name)
            if side_interfaces:  # first: a network that reaches nothing (its peer lies in a namespace of its own)
                side = f"{tag}s{index}"
                _ip("netns", "add", side)
                namespaces.append(side)
                _ip("link", "add", f"{tag}x{index}", "type", "veth", "peer", "name", f"{tag}y{index}")
                _ip("link", "set", f"{tag}x{index}", "netns", name)
                _ip("link", "set", f"{tag}y{index}", "netns", side)
                _ip("-n", name, "link", "set", f"{tag}x{index}", "name", "ffside")
                _ip("-n", name, "addr", "add", f"10.{subnet + 1}.9.{index + 1}/24", "dev", "ffside")
                _ip("-n", name, "link", "set", "ffside", "up")
            _ip("link", "add", f"{tag}v{index}", "type", "veth", "peer", "name", f"{tag}p{index}")
            _ip("link", "set", f"{tag}v{index}", "netns", name)
            _ip("link", "set", f"{tag}p{index}", "netns", switch)
            _ip("-n", name, "link", "set", f"{tag}v{index}", "name", "ffeth0")
            _ip("-n", switch, "link", "set", f"{tag}p{index}", "master", "ffbr")
            _ip("-n", switch, "link", "set", f"{tag}p{index}", "up")
            address = f"10.{subnet}.7.{index + 1}"
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "ffeth0")
            _ip("-n", name, "link", "set", "ffeth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            # Debian's /etc/hosts: the machine's own name resolves to a loopback address (ip netns exec mounts it)
            Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{name}/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
            host_folder = folder / f"host{index}"
            host_folder.mkdir(parents=True)
            hosts.append(Host(name, address, host_folder))
        yield hosts
    finally:
        for host in hosts:
            host.end_everything()
        for name in namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
