"""A training script as a user runs it on each machine of a cluster (tests/hosts): ``torchrun ... host_training.py
<config.json>``. Trains the tiny TREC classifier with FabricTrainer on the processes torchrun started; every rank
writes, under ``results/`` of its own folder, the sockets listening in its host while it trained and its final
weights. Config: ``{"out": folder, "kwargs": train arguments, "kill_at": step, "kill_node": node, "base_path": where
the run goes (default: ``<out>/run``)}`` (that node's link goes down after that step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import TrainerPlugin

import flair_fabric  # noqa: F401  (first, as the docs advise)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flair_fabric import FabricTrainer
from tests.support import small_trec, tiny_text_classifier


def listening_sockets() -> list[str]:
    """The TCP sockets listening in this network namespace, as ``address:port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            if width == 4:
                text = ".".join(str(b) for b in raw[::-1])
            else:
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                text = ":".join(b.hex() for b in words)
            found.append(f"{text}:{int(port, 16)}")
    return sorted(found)


class Observe(TrainerPlugin):
    """At the second step: the listening sockets; at ``kill_at``: this host's link goes down."""

    def __init__(self, results: Path, kill_at: int | None) -> None:
        super().__init__()
        self.results, self.kill_at = results, kill_at

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: Any) -> None:
        rank = self.trainer.global_rank
        if batch_count == 2:
            (self.results / f"listening-rank{rank}.json").write_text(json.dumps(listening_sockets()))
        if batch_count == self.kill_at:  # this host falls off the network: its peers hear nothing more from it
            (self.results / "link-down.txt").write_text(repr(time.time()))  # when (the hosts share one clock)
            subprocess.run(["ip", "link", "set", "ffeth0", "down"], check=True)


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Path(config["out"])
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    trainer = FabricTrainer(model, corpus)
    kill_at = config.get("kill_at") if os.environ.get("GROUP_RANK", "0") == str(config.get("kill_node", -1)) else None
    base_path = config.get("base_path", str(out / "run"))  # a URL: the run in a bucket (docs/storage.md)
    trainer.train(base_path, plugins=[Observe(results, kill_at)], accelerator="cpu", **config["kwargs"])
    torch.save(model.state_dict(), results / f"weights-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
