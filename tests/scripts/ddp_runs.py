"""A user's training script, driven by a JSON config: run as `python ddp_runs.py config.json` (Fabric relaunches it
once per extra device) or under `torchrun`. Every rank writes its weights and what train() returned."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
from flair.data import Dictionary

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair.trainers.plugins import (
    ClearmlLoggerPlugin,
    MetricHistoryPlugin,
    TensorboardLogger,
    TrainerPlugin,
)
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

from flair_fabric import FabricTrainer, LightningLoggerPlugin
from flair_fabric.strategies.sharded_state import held_bytes
from tests.plugin_support import FailAt, FakeClearmlTask, HookCounter, KillJobAt, ListeningSockets
from tests.support import (
    small_trec,
    small_wnut,
    tiny_sequence_tagger,
    tiny_text_classifier,
    tiny_transformer_classifier,
)


class Traces(TrainerPlugin):
    """On every rank: the learning rate of every step, a fingerprint of the weights at each epoch start, and what
    each evaluation decided."""

    def __init__(self) -> None:
        super().__init__()
        self.learning_rates: list[float] = []
        self.weights: list[float] = []
        self.evaluations: list[dict] = []
        self.held_bytes: list[int] = []
        self.batches: list[list[tuple[str, int]]] = []  # (text, tokens) of each sentence of each step

    @TrainerPlugin.hook
    def after_setup(self, **kw):
        fabric = self.trainer.fabric
        self.topology = {"node_rank": fabric.node_rank, "device": str(fabric.device)}

    @TrainerPlugin.hook
    def before_training_batch(self, batch, **kw):
        self.batches.append([(sentence.to_original_text(), len(sentence)) for sentence in batch])

    @TrainerPlugin.hook
    def after_training_batch(self, **kw):
        self.learning_rates.append(self.trainer.optimizer.param_groups[0]["lr"])

    @TrainerPlugin.hook
    def after_evaluation(self, current_model_is_best, validation_scores, **kw):
        self.evaluations.append({"best": current_model_is_best, "scores": [float(x) for x in validation_scores]})
        self.last_evaluated = {name: value.detach().clone() for name, value in self.model.state_dict().items()}

    @TrainerPlugin.hook
    def after_training_epoch(self, **kw):
        self.held_bytes.append(held_bytes(self.trainer.model, self.trainer.optimizer))

    @TrainerPlugin.hook
    def before_training_epoch(self, **kw):
        self.weights.append(sum(float(p.double().sum()) for p in self.model.parameters()))


def build(model: str, out: Path):
    if model == "text":
        corpus = small_trec(**CONFIG.get("corpus", {}))
        classifier = tiny_text_classifier(corpus, **CONFIG.get("model_options", {}))
        differ = CONFIG.get("differ_on_rank1") if os.environ.get("LOCAL_RANK") == "1" else None
        if differ == "corpus":  # e.g. a data file that changed between the processes' reads
            corpus = small_trec(**CONFIG.get("corpus", {}), seed=4)
        if differ == "labels":  # e.g. a label dictionary built by iterating a set
            labels = Dictionary(add_unk=False)
            for item in reversed(classifier.label_dictionary.get_items()):
                labels.add_item(item)
            classifier.label_dictionary = labels
        return classifier, corpus
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


def logger_plugins(run_dir: Path) -> tuple[list[TrainerPlugin], dict]:
    """flair's logger plugins, the Lightning bridge and a hook counter, each built on every rank (as a user's script
    does); the stand-in for ClearML records what reached it. (flair 0.15's WandbLogger cannot be attached to any
    trainer: it hooks an event that does not exist, 'after_training_setup'.)"""
    sys.modules.setdefault("clearml", types.ModuleType("clearml"))  # flair's ClearML plugin imports it first
    task, counter = FakeClearmlTask(), HookCounter()
    (run_dir / "tensorboard").mkdir(parents=True, exist_ok=True)  # flair's logger makes only the last folder
    plugins = [
        TensorboardLogger(log_dir=str(run_dir / "tensorboard")),
        ClearmlLoggerPlugin(task),
        LightningLoggerPlugin(
            [
                CSVLogger(str(run_dir / "csv"), name="", version=""),
                TensorBoardLogger(str(run_dir / "lightning_tensorboard"), name="", version=""),
            ]
        ),
        counter,
    ]
    return plugins, {"clearml": task.logger, "counter": counter, "plugins": plugins}


def logger_observations(seen: dict) -> dict:
    return {
        "clearml_scalars": seen["clearml"].scalars,
        "every_rank_calls": seen["counter"].every_rank_calls,
        "rank_zero_calls": seen["counter"].rank_zero_calls,
        "attached": {type(plugin).__name__: plugin.pluggable is not None for plugin in seen["plugins"]},
        # torch's SummaryWriter.close() drops its file writer
        "tensorboard_closed": [
            p.writer.file_writer is None for p in seen["plugins"] if isinstance(p, TensorboardLogger)
        ],
    }


CONFIG = json.loads(Path(sys.argv[1]).read_text())
OUT = Path(CONFIG["out"])
if CONFIG.get("per_node_out"):  # machines without a shared disk: each node writes under its own folder
    OUT = OUT / f"node{os.environ.get('GROUP_RANK', os.environ.get('SLURM_NODEID', '0'))}"

trainer = None
for run in CONFIG["runs"]:
    model, corpus = build(run.get("model", "text"), OUT)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = FabricTrainer(model, corpus)
    traces = Traces()
    kwargs = dict(run["kwargs"])
    kwargs["plugins"] = [MetricHistoryPlugin(), traces]
    seen: dict = {}
    for fail in run.get("fails", []):
        kwargs["plugins"].append(FailAt(**fail))
    if run.get("listening"):
        kwargs["plugins"].append(ListeningSockets(OUT / run["name"]))
    if run.get("kill_at_epoch"):
        kwargs["plugins"].append(KillJobAt(run["kill_at_epoch"]))
    if run.get("loggers"):
        extra, seen = logger_plugins(OUT / run["name"])
        kwargs["plugins"] += extra
    result = getattr(trainer, run.get("method", "train"))(OUT / run["name"], **kwargs)
    rank = trainer.global_rank
    results_dir = OUT / "results" / run["name"] if CONFIG.get("per_node_out") else OUT / run["name"]
    results_dir.mkdir(parents=True, exist_ok=True)
    weights = {
        "initial": initial,
        "final": model.state_dict(),
        "last_evaluated": getattr(traces, "last_evaluated", None),
    }
    torch.save(weights, results_dir / f"weights-rank{rank}.pt")
    summary = {
        "result": {k: (v if isinstance(v, (int, float)) else [float(x) for x in v]) for k, v in result.items()},
        "lr_trace": traces.learning_rates,
        "weight_trace": traces.weights,
        "evaluations": traces.evaluations,
        "held_bytes": traces.held_bytes,
        "batches": traces.batches,
        "world_size": trainer.world_size,
        "local_rank": trainer.local_rank,
        **traces.topology,
        "pid": os.getpid(),
        "training": model.training,  # flair's trainer leaves the model in eval mode
        "model_card": sorted(model.model_card) if model.model_card is not None else None,
        "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
        **(logger_observations(seen) if seen else {}),
    }
    (results_dir / f"summary-rank{rank}.json").write_text(json.dumps(summary))

if torch.distributed.is_initialized():
    torch.distributed.barrier()
