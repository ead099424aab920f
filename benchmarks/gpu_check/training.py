"""What the checks share: the data, the models, the training call, and measuring (memory, warnings, settings)."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .context import Context
from .settings import CUBLAS_WORKSPACE, DETERMINISTIC_SETTINGS, SEED, Sizes

if TYPE_CHECKING:
    from flair.data import Corpus
    from flair.models import TextClassifier


# --- data, models, training calls -----------------------------------------------------------------------------------


def trec(sizes: Sizes) -> Corpus:
    """A seeded TREC split of the given sizes."""
    from flair_fabric.datasets import trec_corpus

    return trec_corpus(train_size=sizes.train, dev_size=sizes.dev, test_size=sizes.test, seed=SEED)


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


# --- numbers --------------------------------------------------------------------------------------------------------


def relative_difference(a: float, b: float) -> float:
    """``|a - b|`` relative to the larger of the two."""
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def all_finite(values: list[float]) -> bool:
    """Whether every value is finite."""
    return all(math.isfinite(value) for value in values)


def fmt(values: list[float]) -> str:
    """Losses for a reason text."""
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


# --- measuring ------------------------------------------------------------------------------------------------------


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
