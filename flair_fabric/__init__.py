"""flair-fabric: train flair models on many devices and machines with Lightning Fabric."""

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
