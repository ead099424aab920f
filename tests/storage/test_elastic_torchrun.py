"""torchrun's elastic agent (``--nnodes=1:2 --max-restarts``, c10d rendezvous) on two network-namespace hosts
(tests/hosts) that share nothing but the run's bucket, served by moto on a third host: a host is lost mid-epoch, the
agent on the other restarts its worker alone, the host comes back and the job grows to 2 again; the run goes 2 -> 1
-> 2 processes and ends at the weights of an uninterrupted one-process run with the same global_batch_size."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flair_fabric import FabricTrainer

from ..hosts.network import Host, hosts_on_a_network
from ..hosts.test_hosts import ENV
from ..storage_server import BUCKET
from ..support import SCRIPTS, RunHung, expect_success, small_trec, state_dict_difference, tiny_text_classifier
from .test_hosts_and_a_bucket import MAKE_BUCKET, S3_PORT, _environment

pytestmark = pytest.mark.multiprocess

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RENDEZVOUS_PORT = 29670
RUN: dict[str, Any] = {
    "max_epochs": 5,
    "learning_rate": 0.5,
    "global_batch_size": 8,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "accelerator": "cpu",
    "devices": "auto",
    "checkpoint_every_n_steps": 2,
    "keep_checkpoints": 20,  # every checkpoint stays: a restart from an older one than the newest would show
    "collective_timeout": 20,
}
READ = "import sys, fsspec; sys.stdout.write(fsspec.filesystem('s3').cat_file(sys.argv[1]).decode())"


def _steps(host: Host) -> list[dict[str, int]]:
    """The steps this host's workers logged, in order (one worker per attempt)."""
    log = host.folder / "steps.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _wait_for(condition: Callable[[], bool], what: str, agents: list[subprocess.Popen], within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RunHung(f"{what}: not within {within} s")
        if all(agent.poll() is not None for agent in agents):
            raise AssertionError(f"{what}: every agent ended first")
        time.sleep(0.2)


def _agent(host: Host, rendezvous: str, endpoint: str, hosts_rendezvous: bool) -> subprocess.Popen:
    """An elastic torchrun agent of one node on ``host``, with the host's own staging folder (nothing is shared but
    the bucket). ``--local-addr``: the address the other host reaches this one at (the host's name resolves to
    127.0.1.1); ``is_host``: torch's guess from that name would not find the rendezvous endpoint among its addresses."""
    elastic = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}"]
    elastic += ["--rdzv-id=elastic-bucket", f"--local-addr={host.address}", "--max-restarts=3"]
    elastic += [
        "--monitor-interval=0.2",
        f"--rdzv-conf=last_call_timeout=1,join_timeout=120,is_host={int(hosts_rendezvous)}",
    ]
    command = [TORCHRUN, *elastic, str(SCRIPTS / "elastic_training.py"), str(host.folder / "config.json")]
    # torch's shared rendezvous store hangs a node that joins a running job (pytorch/pytorch#135712): docs/elastic.md
    env = {**_environment(endpoint, host), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return host.start(command, env, output=host.folder / f"agent-{time.monotonic_ns()}.log")


def test_a_host_lost_and_back_under_torchruns_elastic_agent_ends_at_the_uninterrupted_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host A (hosting the rendezvous on its address) and host B train 5 epochs of 6 steps into the bucket on a third
    host, a checkpoint every 2 steps. After step 6 of the 2-node world, every process on B is SIGKILLed (a lost
    machine): A's agent restarts its worker alone (world 1), which continues from the bucket; after 7 steps of it B's
    agent starts again and the group restarts at world 2, which continues from the bucket. Each restart continues
    from the newest complete checkpoint (every checkpoint is kept, and at most 5 steps are done again: the 2 since the
    last checkpoint, the upload of the last one still running); the final weights equal an uninterrupted one-process
    run's (1e-5), and the bucket's loss.tsv has each epoch once."""
    corpus = small_trec(train_size=48)
    whole = tiny_text_classifier(corpus)
    monkeypatch.setenv("FLAIR_FABRIC_STAGING", str(tmp_path / "reference-staging"))
    reference = {**RUN, "devices": 1}
    reference.pop("checkpoint_every_n_steps")
    reference.pop("keep_checkpoints")
    FabricTrainer(whole, corpus).fine_tune(tmp_path / "whole", optimizer=torch.optim.SGD, **reference)

    url = f"s3://{BUCKET}/elastic"
    with hosts_on_a_network(tmp_path / "hosts", 3) as (a, b, store):
        endpoint = f"http://{store.address}:{S3_PORT}"
        store.start([sys.executable, "-m", "moto.server", "-H", store.address, "-p", str(S3_PORT)], ENV)
        made = a.start([sys.executable, "-c", MAKE_BUCKET, endpoint], _environment(endpoint, a))
        expect_success(made.wait(timeout=60), "making the bucket", made.communicate()[0])
        for host in (a, b):
            config = {"out": str(host.folder), "base_path": url, "kwargs": RUN, "step_seconds": 0.3}
            (host.folder / "config.json").write_text(json.dumps(config))
        rendezvous = f"{a.address}:{RENDEZVOUS_PORT}"
        agents = [_agent(a, rendezvous, endpoint, hosts_rendezvous=True)]
        time.sleep(1.0)  # A hosts the rendezvous store
        agents.append(_agent(b, rendezvous, endpoint, hosts_rendezvous=False))
        _wait_for(lambda: any(s["world"] == 2 and s["step"] >= 6 for s in _steps(a)), "2 hosts trained", agents)
        b.end_everything()  # the machine is lost: its agent, its worker, anything else it ran
        seen = len(_steps(a))
        alone = lambda: sum(s["world"] == 1 for s in _steps(a)[seen:]) >= 7  # noqa: E731
        _wait_for(alone, "the survivor trained alone", agents[:1])
        agents.append(_agent(b, rendezvous, endpoint, hosts_rendezvous=False))
        _wait_for(lambda: any(s["world"] == 2 for s in _steps(a)[seen:]), "the job grew to 2 again", agents)
        log = _steps(a)  # A trained in every attempt
        again = [
            log[i - 1]["step"] - log[i]["step"] + 1
            for i in range(1, len(log))
            if log[i]["world"] != log[i - 1]["world"]
        ]
        assert len(again) >= 2 and max(again) <= 5, f"steps done again at each restart: {again}"
        _wait_for(lambda: agents[0].poll() is not None, "the job ended", agents, within=240)
        agents[2].wait(timeout=60)
        logs = "\n".join(path.read_text()[-3000:] for host in (a, b) for path in sorted(host.folder.glob("agent-*")))
        assert [agent.returncode for agent in (agents[0], agents[2])] == [0, 0], logs
        read = a.start([sys.executable, "-c", READ, f"{url}/loss.tsv"], _environment(endpoint, a))
        rows, _ = read.communicate(timeout=60)
        expect_success(read.returncode, "reading loss.tsv from the bucket", rows)
        finals = [host.folder / "final.pt" for host in (a, b) if (host.folder / "final.pt").exists()]

    worlds = [step["world"] for step in _steps(a)]
    changes = [world for index, world in enumerate(worlds) if index == 0 or worlds[index - 1] != world]
    assert changes[-3:] == [2, 1, 2], changes
    assert len(finals) == 1, finals  # written by global rank 0 of the last attempt, on its own host
    assert state_dict_difference(torch.load(finals[0]), whole.state_dict()) <= 1e-5
    lines = rows.splitlines()
    assert [row.split("\t")[0] for row in lines[1:]] == ["1", "2", "3", "4", "5"], lines
