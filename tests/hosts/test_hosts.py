"""Several machines for real: hosts in network namespaces (tests/hosts/network.py), each with its own address, its own
loopback, its own folder and a hosts file that resolves its name to 127.0.1.1; torchrun on each, as on a cluster."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers import ModelTrainer

from ..support import (
    REPO,
    SCRIPTS,
    RunCrashed,
    RunHung,
    expect_success,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
)
from .network import REQUIRED, Host, hosts_on_a_network, skip_without_namespaces

pytestmark = pytest.mark.multiprocess

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PORT = 29611
UNION = {"mini_batch_size": 4, "shuffle": False, "learning_rate": 0.1, "create_file_logs": False}
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _start(
    host: Host, nodes: int, node: int, master: str, kwargs: dict[str, Any], env: dict | None = None, **extra: Any
) -> Any:
    config = host.folder / f"config-{time.monotonic_ns()}.json"
    config.write_text(json.dumps({"out": str(host.folder), "kwargs": kwargs, **extra}))
    torchrun = [TORCHRUN, f"--nnodes={nodes}", "--nproc_per_node=1", f"--node_rank={node}"]
    command = [*torchrun, f"--master_addr={master}", f"--master_port={PORT}", str(SCRIPTS / "host_training.py")]
    return host.start([*command, str(config)], env or ENV)


def _finish(processes: list[Any], timeout: float = 180) -> list[tuple[int, str]]:
    finished = []
    for process in processes:
        output, _ = process.communicate(timeout=timeout)
        finished.append((process.returncode, output))
    return finished


def _union_weights(epochs: int, folder: Path) -> dict[str, torch.Tensor]:
    """flair's own trainer in one process on the union of the two hosts' batches (the reference)."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    kwargs = {**UNION, "mini_batch_size": 8, "max_epochs": epochs, "save_final_model": False}
    ModelTrainer(model, corpus).train(folder / f"union-{epochs}", **kwargs)
    return model.state_dict()


def _expect_success(finished: list[tuple[int, str]]) -> None:
    for node, (code, output) in enumerate(finished):
        expect_success(code, f"the job on host {node}", output)


def _listening(host: Host) -> list[tuple[str, int]]:
    """What the host's processes listened on while they trained (every rank's view of its namespace)."""
    found = set()
    for path in (host.folder / "results").glob("listening-rank*.json"):
        for entry in json.loads(path.read_text()):
            address, port = entry.rsplit(":", 1)
            found.add((address, int(port)))
    assert found, f"no listening sockets recorded on {host.namespace}"
    return sorted(found)


def _is_loopback(address: str) -> bool:
    if ":" in address:  # /proc/net/tcp6 words
        return address.replace(":", "") == "0" * 31 + "1"
    return ipaddress.ip_address(address).is_loopback


def test_two_hosts_train_like_one_process_on_the_union_and_resume_from_host_0s_checkpoint(tmp_path: Path) -> None:
    """torchrun on two hosts whose names resolve to 127.0.1.1 and that have a second interface which reaches nothing:
    the collectives use the interface that reaches the master; the weights equal one process on the union; only host
    0's folder gets the files; each host listens only on its test address (and torchrun's agent store on its port);
    a second job resumes from host 0's step checkpoint (host 1 has none) to the weights of a longer union run."""
    with hosts_on_a_network(tmp_path, 2, side_interfaces=True) as hosts:
        master = hosts[0].address
        first = {**UNION, "max_epochs": 2, "devices": 1, "num_nodes": 2, "strategy": "ddp", "collective_timeout": 30}
        first["checkpoint_every_n_steps"] = 4
        outcomes = _finish([_start(host, 2, node, master, first) for node, host in enumerate(hosts)])
        assert "collectives on ffeth0 (gloo) / ffeth0 (NCCL): the interface that reaches" in outcomes[0][1]
        _expect_success(outcomes)

        weights = [torch.load(host.folder / "results" / f"weights-rank{i}.pt") for i, host in enumerate(hosts)]
        assert state_dict_difference(weights[0], weights[1]) == 0.0
        assert state_dict_difference(weights[0], _union_weights(2, tmp_path)) < 1e-5
        assert {path.name for path in (hosts[0].folder / "run").iterdir()} >= {"loss.tsv", "checkpoints"}
        assert not (hosts[1].folder / "run").exists() or not list((hosts[1].folder / "run").iterdir())

        for host in hosts:  # only the test address; on host 0 also torchrun's own agent store (all interfaces)
            for address, port in _listening(host):
                assert address == host.address or (host is hosts[0] and port == PORT), (host.namespace, address, port)

        second = {**first, "max_epochs": 3, "resume_from": "auto"}
        outcomes = _finish([_start(host, 2, node, master, second) for node, host in enumerate(hosts)])
        _expect_success(outcomes)
        assert "resumed from" in outcomes[0][1]
        resumed = torch.load(hosts[0].folder / "results" / "weights-rank0.pt")
        assert state_dict_difference(resumed, _union_weights(3, tmp_path)) < 1e-5


@pytest.mark.parametrize("start", ["script relaunch", "ddp_spawn", "ddp_fork", "torchrun --nnodes=1"])
def test_a_one_machine_job_listens_on_loopback_only(tmp_path: Path, start: str) -> None:
    """Inside a host with an address on a network, every one-machine start method listens on loopback only (torchrun's
    own agent store aside: torch's store takes no address to bind to)."""
    with hosts_on_a_network(tmp_path, 1) as (host,):
        kwargs = {**UNION, "max_epochs": 1, "devices": 2, "collective_timeout": 30}
        config = host.folder / "config.json"
        if start == "torchrun --nnodes=1":
            config.write_text(json.dumps({"out": str(host.folder), "kwargs": {**kwargs, "strategy": "ddp"}}))
            torchrun = [TORCHRUN, "--nnodes=1", "--nproc_per_node=2", f"--master_port={PORT}"]
            process = host.start([*torchrun, str(SCRIPTS / "host_training.py"), str(config)], ENV)
        else:
            strategy = "ddp" if start == "script relaunch" else start
            config.write_text(json.dumps({"out": str(host.folder), "kwargs": {**kwargs, "strategy": strategy}}))
            process = host.start([sys.executable, str(SCRIPTS / "host_training.py"), str(config)], ENV)
        _expect_success(_finish([process]))
        listening = _listening(host)
        outside = [
            (a, p) for a, p in listening if not _is_loopback(a) and not (start.startswith("torchrun") and p == PORT)
        ]
        assert not outside, f"{start} listens beyond loopback: {outside}"
        assert any(_is_loopback(address) for address, _ in listening), "the job's own store and pairs are on loopback"


def test_the_hosts_are_removed_with_what_they_started(tmp_path: Path) -> None:
    """The fixture leaves no namespace, link or process behind, also when the block fails."""
    with pytest.raises(RuntimeError, match="the test failed"), hosts_on_a_network(tmp_path, 2) as hosts:
        sleeper = hosts[1].start(["sleep", "600"], ENV)
        names = [host.namespace for host in hosts]
        raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_a_lost_host_ends_the_job_within_the_collective_timeout_and_host_0_resumes_alone(tmp_path: Path) -> None:
    """Host 1's link goes down after step 10 (of 12, mid-epoch 2): host 0's rank ends within collective_timeout plus a
    margin with an error that says where it waited, and nothing of the job is left running; host 0 alone then resumes
    from its last step checkpoint (another world size) to the weights of one process on the union of the batches."""
    timeout = 8
    with hosts_on_a_network(tmp_path, 2) as hosts:
        kwargs = {**UNION, "max_epochs": 2, "devices": 1, "num_nodes": 2, "strategy": "ddp"}
        kwargs |= {"collective_timeout": timeout, "checkpoint_every_n_steps": 3}
        master = hosts[0].address
        started = [_start(host, 2, node, master, kwargs, kill_at=10, kill_node=1) for node, host in enumerate(hosts)]
        try:
            code, output = _finish(started[:1], timeout=timeout * 10)[0]
        except subprocess.TimeoutExpired:
            raise RunHung(f"host 0's job still runs {timeout * 10} s after host 1 was lost") from None
        ended = time.time()
        assert code != 0
        lost = float((hosts[1].folder / "results" / "link-down.txt").read_text())
        # docs/launching.md: the collective timeout, then the job's end (torchrun stopping its agent: measured 2-3 s)
        assert ended - lost < timeout + 6, f"host 0's job ended {ended - lost:.1f} s after host 1 was lost"
        assert f"waited longer than collective_timeout ({timeout} s)" in output, output[-4000:]
        assert re.search(r"global rank 0 of 2 waited .* in epoch 2, step \d+", output), output[-4000:]
        hosts[1].end_everything()
        leftover = subprocess.run(["ip", "netns", "pids", hosts[0].namespace], capture_output=True, text=True).stdout
        assert not leftover.split(), f"processes left on host 0: {leftover}"

        alone = {**UNION, "mini_batch_size": 8, "max_epochs": 2, "devices": 1, "resume_from": "auto"}
        config = hosts[0].folder / "alone.json"
        config.write_text(json.dumps({"out": str(hosts[0].folder), "kwargs": alone}))
        finished = _finish([hosts[0].start([sys.executable, str(SCRIPTS / "host_training.py"), str(config)], ENV)])
        _expect_success(finished)
        output = finished[0][1]
        assert "resuming a checkpoint of 2 process(es) on 1" in output and "after step 3 of epoch 2" in output
        resumed = torch.load(hosts[0].folder / "results" / "weights-rank0.pt")
        assert state_dict_difference(resumed, _union_weights(2, tmp_path)) < 1e-5


@pytest.mark.parametrize("required", ["1", None])
def test_where_the_hosts_tests_are_required_they_fail_rather_than_skip(
    monkeypatch: pytest.MonkeyPatch, required: str | None
) -> None:
    """CI (.ci/run) sets FLAIR_FABRIC_REQUIRE_HOSTS=1: a machine there that cannot make namespaces fails the hosts
    tests; elsewhere they are skipped with the reason."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    if required is None:
        monkeypatch.delenv(REQUIRED, raising=False)
        with pytest.raises(pytest.skip.Exception, match="run as root"):
            skip_without_namespaces()
    else:
        monkeypatch.setenv(REQUIRED, required)
        with pytest.raises(RunCrashed, match="FLAIR_FABRIC_REQUIRE_HOSTS=1 but the hosts tests cannot run"):
            skip_without_namespaces()


def test_ci_requires_the_hosts_tests() -> None:
    assert f"{REQUIRED}=1 make test" in (REPO / ".ci" / "run").read_text()
