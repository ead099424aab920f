"""A user's script that trains one short epoch on every rank it runs as (under torchrun, or relaunched by Fabric) and
writes, per rank, what the rank ran with: the rendezvous and network variables, and the sockets its process listens
on once every rank has met: `python launch_environment.py OUT` or `torchrun ... launch_environment.py OUT`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer
from tests.plugin_support import listening_sockets_of_job
from tests.support import small_trec, tiny_text_classifier

VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")


class WhatTheRankRunsWith(TrainerPlugin):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        if epoch != 1:
            return
        seen = {
            "pid": os.getpid(),
            "environment": {name: os.environ.get(name) for name in VARIABLES},
            "listening": [address for pid, address in listening_sockets_of_job() if pid == os.getpid()],
        }
        (self.out / f"environment-rank{self.trainer.global_rank}.json").write_text(json.dumps(seen))


OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
corpus = small_trec()
FabricTrainer(tiny_text_classifier(corpus), corpus).train(
    OUT / "run", max_epochs=1, mini_batch_size=8, accelerator="cpu", devices=2, plugins=[WhatTheRankRunsWith(OUT)]
)
