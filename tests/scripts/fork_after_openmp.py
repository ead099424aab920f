"""A notebook's session: the process computes on several CPU threads first (GNU OpenMP starts its thread team),
then trains with forked workers: `python fork_after_openmp.py OUT DEVICES`. Prints the number of CPU threads the
workers computed with; a worker that used OpenMP's team would wait forever for threads that exist only here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer
from tests.support import small_trec, tiny_text_classifier


class ThreadCount(TrainerPlugin):
    @TrainerPlugin.hook
    def after_training_epoch(self, **kw: Any) -> None:
        self.trainer.return_values["worker_threads"] = torch.get_num_threads()


if __name__ == "__main__":
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    torch.log_softmax(torch.randn(512, 4096), dim=-1)  # a parallel region here, before the fork
    corpus = small_trec()
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    settings = {"accelerator": "cpu", "devices": devices, "strategy": "ddp_fork", "create_file_logs": False}
    result = trainer.train(out, max_epochs=1, mini_batch_size=4, plugins=[ThreadCount()], **settings)
    print(
        f"workers computed with {result.get('worker_threads')} thread(s); this process with {torch.get_num_threads()}"
    )
