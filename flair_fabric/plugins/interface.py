"""What a plugin may use of :class:`~flair_fabric.FabricTrainer`, beyond what flair's ``ModelTrainer`` offers every
plugin (``model``, ``corpus``, ``optimizer``, ``dispatch``, ``return_values``, ``context_stack``).

Inside a hook, ``self.trainer`` satisfies :class:`DistributedTrainer`: the run's topology, Fabric for collectives,
the optimizer steps each rank runs per epoch, and model files written once and read back on every rank. These are
the only members flair-fabric's own fixed flair plugins use; nothing else of the trainer is meant for plugins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning.fabric import Fabric


@runtime_checkable
class DistributedTrainer(Protocol):
    """The plugin-facing part of a trainer that runs on several processes."""

    @property
    def fabric(self) -> Fabric | None:
        """The run's Fabric (collectives: ``all_reduce``, ``broadcast``, ``barrier``); ``None`` outside a run."""

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes of the run."""

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""

    @property
    def world_size(self) -> int:
        """The number of processes of the run."""

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0, the process that writes logs and model files."""

    @property
    def steps_per_epoch(self) -> int:
        """The optimizer steps each rank runs per epoch (the same on every rank)."""

    def save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        """Write the model being trained to ``model_file`` once, from global rank 0 (every rank must call it)."""

    def load_model(self, model_file: str | Path) -> bool:
        """Load ``model_file``'s weights into the model on every rank (read on global rank 0 only); whether the
        file existed. Every rank must call it."""
