"""A user's training script, driven by a JSON config: run as `python ddp_runs.py config.json` (Fabric relaunches it
once per extra device) or under `torchrun`. Every rank writes its weights and what train() returned."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair.trainers.plugins import MetricHistoryPlugin, TrainerPlugin

from flair_fabric import FabricTrainer
from tests.support import (
    small_trec,
    small_wnut,
    tiny_sequence_tagger,
    tiny_text_classifier,
    tiny_transformer_classifier,
)


class LearningRateTrace(TrainerPlugin):
    """The learning rate after every optimizer step, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[float] = []

    @TrainerPlugin.hook
    def after_training_batch(self, **kw):
        self.trace.append(self.trainer.optimizer.param_groups[0]["lr"])


def build(model: str, out: Path):
    if model == "text":
        corpus = small_trec(**CONFIG.get("corpus", {}))
        return tiny_text_classifier(corpus), corpus
    if model == "tagger":
        corpus = small_wnut(out / f"wnut-{os.environ.get('LOCAL_RANK', '0')}")
        return tiny_sequence_tagger(corpus), corpus
    if model == "bert":
        corpus = small_trec(**CONFIG.get("corpus", {}))
        bert_dir = Path(CONFIG["bert_dir"])
        if not (bert_dir / "config.json").exists():
            raise SystemExit(f"the test prepares the tiny BERT in {bert_dir} before starting this script")
        return tiny_transformer_classifier(corpus, bert_dir), corpus
    raise ValueError(model)


CONFIG = json.loads(Path(sys.argv[1]).read_text())
OUT = Path(CONFIG["out"])

trainer = None
for run in CONFIG["runs"]:
    model, corpus = build(run.get("model", "text"), OUT)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = FabricTrainer(model, corpus)
    lr_trace = LearningRateTrace()
    kwargs = dict(run["kwargs"])
    kwargs["plugins"] = [MetricHistoryPlugin(), lr_trace]
    result = getattr(trainer, run.get("method", "train"))(OUT / run["name"], **kwargs)
    rank = trainer.global_rank
    torch.save({"initial": initial, "final": model.state_dict()}, OUT / run["name"] / f"weights-rank{rank}.pt")
    summary = {
        "result": {k: (v if isinstance(v, (int, float)) else [float(x) for x in v]) for k, v in result.items()},
        "lr_trace": lr_trace.trace,
        "world_size": trainer.world_size,
        "local_rank": trainer.local_rank,
        "pid": os.getpid(),
        "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
    }
    (OUT / run["name"] / f"summary-rank{rank}.json").write_text(json.dumps(summary))

assert trainer is not None and trainer.fabric is not None
trainer.fabric.barrier()
