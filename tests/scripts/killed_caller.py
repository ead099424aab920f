"""A user's script whose own process is killed (SIGKILL: no chance to clean up) while its spawned workers hang at the
start of epoch 3 where no signal reaches them (in native code, say): `python killed_caller.py OUT`. Each worker must
notice that the process that started it is gone, and exit (the SIGINT that torch has the kernel send a worker whose
parent died does not reach them)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair_fabric import FabricTrainer
from tests.plugin_support import FailAt
from tests.support import small_trec, tiny_text_classifier

OUT = Path(sys.argv[1])
HANG = [OUT / f"rank-{rank}-hangs" for rank in (0, 1)]


def die_once_both_ranks_hang() -> None:
    while not all(marker.exists() for marker in HANG):
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    threading.Thread(target=die_once_both_ranks_hang, daemon=True).start()
    trainer = FabricTrainer(model, corpus)
    trainer.train(
        OUT,
        max_epochs=10,
        mini_batch_size=4,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        collective_timeout=300,  # longer than the test waits
        plugins=[FailAt(epoch=3, rank=rank, how="hang", stall_seconds=300, marker=str(HANG[rank])) for rank in (0, 1)],
    )
