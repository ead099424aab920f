"""A user's training script, driven by a JSON config: run as `python ddp_runs.py config.json` (Fabric relaunches it
once per extra device) or under `torchrun`. Every rank writes its weights and what train() returned."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import flair.nn
import torch
from flair.data import Dictionary, Sentence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair.trainers.plugins import (
    ClearmlLoggerPlugin,
    MetricHistoryPlugin,
    TensorboardLogger,
    TrainerPlugin,
)
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from torch.distributed.tensor import DTensor

import flair_fabric
from flair_fabric import FabricTrainer, LightningLoggerPlugin
from flair_fabric.strategies.sharded_state import held_bytes
from tests.plugin_support import FailAt, FakeClearmlTask, HookCounter, KillJobAt, ListeningSockets
from tests.support import (
    counting_saves,
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
        # what self.trainer reports inside hooks: hook -> the distinct [global_rank, local_rank, world_size,
        # is_global_zero] seen there
        self.in_hooks: dict[str, list[list]] = {}
        self.batch_loss_records: list[tuple[int, float]] = []  # (step, value) of every train/batch_loss record
        self.gradient_norms: list[float] = []  # every train/gradient_norm record
        self.counted_bytes: list[int] = []  # parameters and optimizer state this rank holds, counted here

    def _note_topology(self, hook: str) -> None:
        t = self.trainer
        seen = [t.global_rank, t.local_rank, t.world_size, t.is_global_zero]
        if seen not in self.in_hooks.setdefault(hook, []):
            self.in_hooks[hook].append(seen)

    @TrainerPlugin.hook
    def after_setup(self, **kw):
        fabric = self.trainer.fabric
        self.topology = {"node_rank": fabric.node_rank, "device": str(fabric.device)}
        self._note_topology("after_setup")

    @TrainerPlugin.hook
    def before_training_batch(self, batch, **kw):
        self.batches.append([(sentence.to_original_text(), len(sentence)) for sentence in batch])

    @TrainerPlugin.hook
    def after_training_batch(self, **kw):
        self.learning_rates.append(self.trainer.optimizer.param_groups[0]["lr"])
        self._note_topology("after_training_batch")

    @TrainerPlugin.hook
    def metric_recorded(self, record):
        if str(record.name) == "train/batch_loss":
            self.batch_loss_records.append((record.global_step, float(record.value)))
        if str(record.name) == "train/gradient_norm":
            self.gradient_norms.append(float(record.value))

    @TrainerPlugin.hook
    def after_evaluation(self, current_model_is_best, validation_scores, **kw):
        self.evaluations.append({"best": current_model_is_best, "scores": [float(x) for x in validation_scores]})
        self.last_evaluated = {name: value.detach().clone() for name, value in self.model.state_dict().items()}

    @TrainerPlugin.hook
    def after_training_epoch(self, **kw):
        self.held_bytes.append(held_bytes(self.trainer.model, self.trainer.optimizer))
        self.counted_bytes.append(counted_bytes(self.trainer.model, self.trainer.optimizer))
        self._note_topology("after_training_epoch")

    @TrainerPlugin.hook
    def before_training_epoch(self, **kw):
        self.weights.append(sum(float(p.double().sum()) for p in self.model.parameters()))


class RankZeroReturnValue(TrainerPlugin):
    """Adds a return value on global rank 0 only (as a plugin whose hook is rank_zero_only does)."""

    @TrainerPlugin.hook
    def after_training(self, **kw):
        if self.trainer.is_global_zero:
            self.trainer.return_values["added_on_rank_zero"] = 1.0


class NotesPort(TrainerPlugin):
    """The rendezvous port this rank's run uses (MASTER_PORT at set-up)."""

    @TrainerPlugin.hook
    def after_setup(self, **kw):
        self.port = os.environ.get("MASTER_PORT")


def counted_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the parameters and the optimizer's state tensors this rank holds: a sharded tensor (DTensor)
    counts with its local shard."""
    tensors = [*model.parameters()]
    tensors += [
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
    ]
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    return sum(tensor.numel() * tensor.element_size() for tensor in local)


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
    state = TensorboardState([plugin for plugin in plugins if isinstance(plugin, TensorboardLogger)])
    return [*plugins, state], {"clearml": task.logger, "counter": counter, "plugins": plugins, "state": state}


class TensorboardState(TrainerPlugin):
    """On every rank, at set-up (after_setup): whether each flair TensorboardLogger's event file is closed."""

    def __init__(self, loggers: list[TensorboardLogger]) -> None:
        super().__init__()
        self.loggers = loggers
        self.closed_at_setup: list[bool] = []

    @TrainerPlugin.hook
    def after_setup(self, **kw):
        self.closed_at_setup = [logger.writer.file_writer is None for logger in self.loggers]


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
        "tensorboard_closed_at_setup": seen["state"].closed_at_setup,
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
    flair_save = flair.nn.Model.save
    if run.get("count_saves"):  # every model file written, by which rank: "<rank> <file>" lines in <run>/saves.txt
        flair.nn.Model.save = counting_saves(OUT / run["name"] / "saves.txt", flair_save)
    if run.get("loggers"):
        extra, seen = logger_plugins(OUT / run["name"])
        kwargs["plugins"] += extra
    if run.get("rank_zero_return"):
        kwargs["plugins"].append(RankZeroReturnValue())
    port = NotesPort() if run.get("note_port") else None
    if port is not None:
        kwargs["plugins"].append(port)
    counter = HookCounter() if run.get("counter") else None  # a rank_zero_only hook beside an every-rank one
    if counter is not None:
        kwargs["plugins"].append(counter)
    result = getattr(trainer, run.get("method", "train"))(OUT / run["name"], **kwargs)
    flair.nn.Model.save = flair_save
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
        "in_hooks": traces.in_hooks,
        "is_global_zero_after": trainer.is_global_zero,
        "batch_loss_records": traces.batch_loss_records,
        "gradient_norms": traces.gradient_norms,
        "counted_bytes": traces.counted_bytes,
        **({"hook_counts": [counter.every_rank_calls, counter.rank_zero_calls]} if counter is not None else {}),
        **({"master_port": port.port} if port is not None else {}),
        **(logger_observations(seen) if seen else {}),
    }
    (results_dir / f"summary-rank{rank}.json").write_text(json.dumps(summary))

if CONFIG.get("predict") is not None:  # flair_fabric.predict in the same processes after training (the last model)
    label_type = model.label_type
    texts = [sentence.to_original_text() for sentence in corpus.train][:11]
    ours, reference = [Sentence(text) for text in texts], [Sentence(text) for text in texts]
    flair_fabric.predict(model, ours, mini_batch_size=2, **CONFIG["predict"])  # the launch arguments of the run
    model.predict(reference, mini_batch_size=2)  # flair's own, in this process

    def shown(sentences):
        return [[(label.value, round(label.score, 6)) for label in s.get_labels(label_type)] for s in sentences]

    results = OUT / "results" if CONFIG.get("per_node_out") else OUT
    labels = {"ours": shown(ours), "flair": shown(reference)}
    (results / f"predicted-rank{trainer.global_rank}.json").write_text(json.dumps(labels))

if torch.distributed.is_initialized():
    torch.distributed.barrier()
