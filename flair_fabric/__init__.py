"""flair-fabric: train flair models on many devices and machines with Lightning Fabric."""

from flair_fabric.lightning_loggers import LightningLoggerPlugin
from flair_fabric.plugin_api import GlobalZeroPlugin, rank_zero_only
from flair_fabric.scoring import evaluate
from flair_fabric.sharding import FlairFSDPStrategy
from flair_fabric.strategies import FlairDDPStrategy
from flair_fabric.trainer import FabricTrainer

__all__ = [
    "FabricTrainer",
    "FlairDDPStrategy",
    "FlairFSDPStrategy",
    "GlobalZeroPlugin",
    "LightningLoggerPlugin",
    "evaluate",
    "rank_zero_only",
]
__version__ = "0.1.0"
