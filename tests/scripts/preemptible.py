"""A user's training script for the preemption tests: `python preemptible.py config.json` (forked workers inside,
or started by torchrun). Global rank 0 writes the trained weights to `<out>/weights.pt`.

config: {"out": ..., "kwargs": {...fine_tune arguments...}, "preempt_at": step (global rank 0 sends SIGUSR1 to the
job's process group after that step), "fail_once_at": step (rank 1 raises there unless <out>/failed-once exists,
which it then creates), "always_fail_at": step (rank 1 raises there every time), "record": true (every rank appends
each step it trained to `<out>/steps-rank<r>`, writes the code it exits with to `<out>/exit-rank<r>`, and global rank 0
of a script relaunch writes the exit codes of the ranks it started to `<out>/relaunched-exits.json`)}"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer
from tests.support import small_trec, tiny_text_classifier

CONFIG = json.loads(Path(sys.argv[1]).read_text())
OUT = Path(CONFIG["out"])


class Disturb(TrainerPlugin):
    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, **kw: object) -> None:
        rank = self.trainer.global_rank
        if CONFIG.get("record"):
            with (OUT / f"steps-rank{rank}").open("a") as stream:
                stream.write(f"{batch_count}\n")
        if batch_count == CONFIG.get("preempt_at") and rank == 0:
            os.killpg(os.getpgrp(), signal.SIGUSR1)
        if batch_count == CONFIG.get("always_fail_at") and rank == 1:
            raise RuntimeError(f"injected failure on rank 1 at step {batch_count}")
        marker = OUT / "failed-once"
        if batch_count == CONFIG.get("fail_once_at") and rank == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure on rank 1 at step {batch_count}, once")


if __name__ == "__main__":
    corpus = small_trec()
    model = tiny_text_classifier(corpus, dropout=0.3)
    trainer = FabricTrainer(model, corpus)
    try:
        trainer.fine_tune(OUT / "run", plugins=[Disturb()], **CONFIG["kwargs"])
    except SystemExit as exited:
        if CONFIG.get("record"):
            (OUT / f"exit-rank{trainer.global_rank}").write_text(str(exited.code))
            started = getattr(trainer.fabric.strategy.launcher, "procs", []) if trainer.fabric else []
            if started:  # the ranks the script relaunch started: how they ended
                codes = [process.wait(timeout=120) for process in started]
                (OUT / "relaunched-exits.json").write_text(json.dumps(codes))
        raise
    if trainer.is_global_zero:
        torch.save(model.state_dict(), OUT / "weights.pt")
