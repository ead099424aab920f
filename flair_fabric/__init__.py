"""flair-fabric: train flair models on many devices and machines with Lightning Fabric."""

import os

# Before flair is imported: flair asks torch.cuda.is_available() when it is imported, which without the NVML-based
# check initialises the CUDA driver, and workers forked afterwards (ddp_fork, ddp_notebook) cannot use the GPU.
# Lightning sets the same variable when it is imported (lightning/fabric/__init__.py), but flair comes first here.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from flair_fabric.evaluation.api import evaluate
from flair_fabric.language_model.trainer import FabricLanguageModelTrainer
from flair_fabric.plugins.lightning_loggers import LightningLoggerPlugin
from flair_fabric.plugins.rank_zero import GlobalZeroPlugin, rank_zero_only
from flair_fabric.prediction.api import PredictionSummary, predict
from flair_fabric.strategies.ddp import FlairDDPStrategy
from flair_fabric.strategies.fsdp import FlairFSDPStrategy
from flair_fabric.trainer import FabricTrainer

__all__ = [
    "FabricLanguageModelTrainer",
    "FabricTrainer",
    "FlairDDPStrategy",
    "FlairFSDPStrategy",
    "GlobalZeroPlugin",
    "LightningLoggerPlugin",
    "PredictionSummary",
    "evaluate",
    "predict",
    "rank_zero_only",
]
__version__ = "0.1.0"
