"""torchrun's elastic agent (``--nnodes=1:2 --max-restarts``, c10d rendezvous) with the run in a bucket: a node dies
mid-run, the agent restarts the survivor alone, the node comes back and the job grows to 2 again; the run goes 2 -> 1
-> 2 processes and ends at the weights of an uninterrupted one-process run with the same global_batch_size."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from flair_fabric import FabricTrainer

from ..storage_server import BUCKET, S3Server
from ..support import (
    REPO,
    SCRIPTS,
    RunHung,
    free_port,
    kill_with_descendants,
    script_env,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
)

pytestmark = pytest.mark.multiprocess

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RUN: dict[str, Any] = {
    "max_epochs": 5,
    "learning_rate": 0.5,
    "global_batch_size": 8,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "accelerator": "cpu",
    "devices": "auto",
    "checkpoint_every_n_steps": 2,
    "collective_timeout": 20,
}


def _steps(log: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _wait_for(condition: Callable[[], bool], what: str, agents: list[subprocess.Popen], within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RunHung(f"{what}: not within {within} s")
        if all(agent.poll() is not None for agent in agents):
            raise AssertionError(f"{what}: every agent ended first")
        time.sleep(0.2)


def _agent(config: Path, port: int, staging: Path, out: Path, hosts_rendezvous: bool) -> subprocess.Popen:
    """An elastic torchrun agent of one node (its own staging folder: no folder is shared), in its own session; one
    agent hosts the rendezvous store (on one machine both addresses match the endpoint: ``is_host`` says which)."""
    elastic = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    elastic += ["--rdzv-id=elastic-bucket", "--local-addr=127.0.0.1", "--max-restarts=3", "--monitor-interval=0.2"]
    elastic += [f"--rdzv-conf=last_call_timeout=1,join_timeout=120,is_host={int(hosts_rendezvous)}"]
    command = [TORCHRUN, *elastic, str(SCRIPTS / "elastic_training.py"), str(config)]
    output = (out / f"agent-{time.monotonic_ns()}.log").open("w")
    # torch's shared rendezvous store hangs a node that joins a running job (pytorch/pytorch#135712): docs/elastic.md
    env = script_env(FLAIR_FABRIC_STAGING=str(staging), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_node_lost_and_back_under_torchruns_elastic_agent_ends_at_the_uninterrupted_weights(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agents A (hosting the rendezvous) and B train 5 epochs of 6 steps into the bucket, a checkpoint every 2 steps.
    After step 6 of the 2-node world, B is SIGKILLed (agent and worker): A's agent restarts its worker alone (world 1),
    which continues from the bucket; after 3 steps of it B's agent starts again and A's agent restarts the group at
    world 2, which continues from the bucket. The final weights equal an uninterrupted one-process run's (1e-5), and
    the bucket's loss.tsv has each epoch once."""
    corpus = small_trec(train_size=48)
    whole = tiny_text_classifier(corpus)
    monkeypatch.setenv("FLAIR_FABRIC_STAGING", str(tmp_path / "reference-staging"))
    reference = {**RUN, "devices": 1}
    reference.pop("checkpoint_every_n_steps")
    FabricTrainer(whole, corpus).fine_tune(tmp_path / "whole", optimizer=torch.optim.SGD, **reference)

    out = tmp_path / "elastic"
    out.mkdir()
    url = f"s3://{BUCKET}/elastic"
    config = out / "config.json"
    config.write_text(json.dumps({"out": str(out), "base_path": url, "kwargs": RUN, "step_seconds": 0.3}))
    log = out / "steps.jsonl"
    port = free_port()
    agents = [_agent(config, port, tmp_path / "staging-a", out, hosts_rendezvous=True)]
    try:
        time.sleep(1.0)  # A hosts the rendezvous store
        agents.append(_agent(config, port, tmp_path / "staging-b", out, hosts_rendezvous=False))
        _wait_for(lambda: any(s["world"] == 2 and s["step"] >= 6 for s in _steps(log)), "2 nodes trained", agents)
        kill_with_descendants(agents[1].pid)
        agents[1].wait()
        seen = len(_steps(log))
        alone = lambda: sum(s["world"] == 1 for s in _steps(log)[seen:]) >= 3  # noqa: E731
        _wait_for(alone, "the survivor trained alone", agents[:1])
        agents.append(_agent(config, port, tmp_path / "staging-b", out, hosts_rendezvous=False))
        _wait_for(lambda: agents[0].poll() is not None, "the job ended", agents, within=240)
        agents[2].wait(timeout=60)
    finally:
        for agent in agents:
            kill_with_descendants(agent.pid)
    logs = "\n".join(path.read_text()[-3000:] for path in sorted(out.glob("agent-*.log")))
    assert [agent.returncode for agent in (agents[0], agents[2])] == [0, 0], logs
    worlds = [step["world"] for step in _steps(log) if step["rank"] == 0]
    changes = [world for index, world in enumerate(worlds) if index == 0 or worlds[index - 1] != world]
    assert changes[-3:] == [2, 1, 2], changes
    final = torch.load(out / "final.pt")
    assert state_dict_difference(final, whole.state_dict()) <= 1e-5
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    rows = fs.cat_file(f"{url}/loss.tsv").decode().splitlines()
    assert [row.split("\t")[0] for row in rows[1:]] == ["1", "2", "3", "4", "5"], rows
