"""flair-fabric: train flair models on many devices and machines with Lightning Fabric.

The public names are imported on first use, so that ``python -m flair_fabric --help`` answers without importing
torch, flair and Lightning.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Before flair is imported: flair asks torch.cuda.is_available() when it is imported, which without the NVML-based
# check initialises the CUDA driver, and workers forked afterwards (ddp_fork, ddp_notebook) cannot use the GPU.
# Lightning sets the same variable when it is imported (lightning/fabric/__init__.py), but flair comes first here.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

__version__ = "0.1.0"

_PUBLIC = {
    "FabricLanguageModelTrainer": "flair_fabric.language_model.trainer",
    "FabricTrainer": "flair_fabric.trainer",
    "FlairDDPStrategy": "flair_fabric.strategies.ddp",
    "FlairFSDPStrategy": "flair_fabric.strategies.fsdp",
    "GlobalZeroPlugin": "flair_fabric.plugins.rank_zero",
    "LightningLoggerPlugin": "flair_fabric.plugins.lightning_loggers",
    "MLflowTracker": "flair_fabric.plugins.trackers",
    "PredictionSummary": "flair_fabric.prediction.api",
    "evaluate": "flair_fabric.evaluation.api",
    "predict": "flair_fabric.prediction.api",
    "WandbTracker": "flair_fabric.plugins.trackers",
    "rank_zero_only": "flair_fabric.plugins.rank_zero",
}
__all__ = [
    "FabricLanguageModelTrainer",
    "FabricTrainer",
    "FlairDDPStrategy",
    "FlairFSDPStrategy",
    "GlobalZeroPlugin",
    "LightningLoggerPlugin",
    "MLflowTracker",
    "PredictionSummary",
    "WandbTracker",
    "evaluate",
    "predict",
    "rank_zero_only",
]

if TYPE_CHECKING:
    from flair_fabric.evaluation.api import evaluate
    from flair_fabric.language_model.trainer import FabricLanguageModelTrainer
    from flair_fabric.plugins.lightning_loggers import LightningLoggerPlugin
    from flair_fabric.plugins.rank_zero import GlobalZeroPlugin, rank_zero_only
    from flair_fabric.plugins.trackers import MLflowTracker, WandbTracker
    from flair_fabric.prediction.api import PredictionSummary, predict
    from flair_fabric.strategies.ddp import FlairDDPStrategy
    from flair_fabric.strategies.fsdp import FlairFSDPStrategy
    from flair_fabric.trainer import FabricTrainer


def __getattr__(name: str) -> Any:
    """The public names, imported when first asked for."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'flair_fabric' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
