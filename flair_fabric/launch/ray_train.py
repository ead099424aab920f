"""Ray Train as an engine: a training function that ``ray.train.torch.TorchTrainer`` runs in each of its workers
calls ``FabricTrainer(...).fine_tune(...)`` as a script would, and the run takes its ranks, its world and its process
group from Ray (nothing is relaunched).

Ray is asked only where it is already imported (a Ray Train worker imported it before the training function ran), so
that a run without the ``[ray]`` extra never imports it. :class:`RayEnvironment` is the cluster environment Fabric
gets there: ranks from ``ray.train.get_context()``, the main address and port from the variables Ray set before it
made the process group (``MASTER_ADDR``, ``MASTER_PORT``), and ``creates_processes_externally``: Ray started the
processes, Fabric starts none.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment

from flair_fabric.state.safe_loading import UnsafeFile
from flair_fabric.state.training_state import newest_checkpoint, read_progress

RAY_EXTRA = 'pip install "flair-fabric[ray]"'
"""How to install Ray Train with flair-fabric (the ``[ray]`` extra)."""


class RayNotInstalled(ImportError):
    """A Ray engine was asked for where Ray Train is not installed."""


def require_ray_train(what: str) -> Any:
    """Import and return ``ray.train`` for ``what`` (e.g. ``"--engine ray"``), or raise :class:`RayNotInstalled`
    naming the ``[ray]`` extra, before anything starts."""
    try:
        import ray.train
    except ImportError as missing:
        raise RayNotInstalled(f"{what} needs Ray Train, which is not installed here ({missing}): {RAY_EXTRA}") from None
    return ray.train


def ray_train_context() -> Any | None:
    """Ray Train's context where this process runs a Ray Train worker's training function, else ``None``. Imports
    nothing: outside a process that imported Ray, Ray is not asked."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray.train

        return ray.train.get_context()
    except Exception:  # not in a Ray Train worker (Ray raises RuntimeError), or an older Ray without the context
        return None


@dataclass(frozen=True)
class RayWorld:
    """The processes Ray Train started for this run, as this worker sees them."""

    world_size: int
    local_world_size: int
    global_rank: int
    local_rank: int
    node_rank: int

    @property
    def num_nodes(self) -> int:
        """Nodes of the world: Ray places the same number of workers on each node (checked)."""
        return max(self.world_size // self.local_world_size, 1)

    def described(self) -> str:
        """What Ray started, for errors that compare it with the arguments."""
        return (
            f"Ray Train started {self.world_size} worker process(es), {self.local_world_size} on this node"
            f" (ScalingConfig(num_workers={self.world_size}))"
        )


def ray_world() -> RayWorld | None:
    """The world of the Ray Train worker this process is, else ``None``."""
    context = ray_train_context()
    if context is None:
        return None
    world = RayWorld(
        world_size=int(context.get_world_size()),
        local_world_size=int(context.get_local_world_size()),
        global_rank=int(context.get_world_rank()),
        local_rank=int(context.get_local_rank()),
        node_rank=int(context.get_node_rank()),
    )
    if world.world_size % world.local_world_size:
        raise ValueError(
            f"{world.described()}: Ray placed its workers unevenly on the nodes ({world.local_world_size} here of"
            f" {world.world_size}), which one number of devices per node cannot describe: place them evenly, e.g."
            " ScalingConfig(placement_strategy='STRICT_PACK') on one node, or resources_per_worker that fill a node."
        )
    return world


class RayEnvironment(ClusterEnvironment):
    """Fabric's cluster environment inside a Ray Train worker: the ranks and the world are Ray's (asked each time,
    never cached: Ray may restart the workers on another world), the processes exist already."""

    @property
    def creates_processes_externally(self) -> bool:
        """Ray started every process: Fabric must not relaunch or spawn any."""
        return True

    @property
    def main_address(self) -> str:
        """The address Ray made the process group at (``MASTER_ADDR``, set by Ray's ``TorchConfig``)."""
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        """The port Ray made the process group at (``MASTER_PORT``)."""
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        """Whether this process runs a Ray Train worker's training function."""
        return ray_train_context() is not None

    def world_size(self) -> int:
        return int(_context().get_world_size())

    def set_world_size(self, size: int) -> None:
        """Ray's world is what it is; Fabric's count of devices x nodes is checked against it before launch."""

    def global_rank(self) -> int:
        return int(_context().get_world_rank())

    def set_global_rank(self, rank: int) -> None:
        """Ray's rank is what it is."""

    def local_rank(self) -> int:
        return int(_context().get_local_rank())

    def node_rank(self) -> int:
        return int(_context().get_node_rank())


def _context() -> Any:
    context = ray_train_context()
    if context is None:
        raise RuntimeError("RayEnvironment is used outside a Ray Train worker's training function")
    return context


def ray_checkpoint_folder() -> Path | None:
    """The newest checkpoint Ray Train holds for this run (``ray.train.get_checkpoint()``: after Ray restarted the
    workers, or given as ``TorchTrainer(resume_from_checkpoint=...)``), as a local folder; ``None`` outside Ray or
    where there is none. In Ray's storage when that is a local folder, else downloaded by Ray."""
    if ray_train_context() is None:
        return None
    import pyarrow.fs
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem) and Path(checkpoint.path).is_dir():
        return Path(checkpoint.path)
    return Path(checkpoint.to_directory())


def ray_run() -> str:
    """The Ray Train run this worker trains, the same on each of its attempts: where Ray keeps it
    (``RunConfig(storage_path=..., name=...)``, the storage's type and path); ``""`` outside Ray. Ray itself continues
    a run of the same storage_path and name from the checkpoints it committed."""
    if ray_train_context() is None:
        return ""
    try:
        import ray.train

        storage = ray.train.get_context().get_storage()
        return f"{storage.storage_filesystem.type_name}://{storage.experiment_fs_path}"
    except Exception:  # a Ray Train without its storage context
        return ""


def resume_under_ray(resume_from: Any, base_path: Path) -> Any:
    """``resume_from`` for a run in a Ray Train worker: ``None`` (the default: Ray restarted the workers) and
    ``"auto"`` mean the newest complete checkpoint, Ray's or ``base_path``'s own. Ray commits a reported checkpoint
    only when its controller has collected the report of every worker: when a worker is lost soon after a save, the
    newest complete checkpoint is in ``base_path`` and Ray's is an older one, or there is none yet. A restart is
    recognised by ``base_path``'s newest checkpoint: this Ray run wrote it (:func:`ray_run`). Elsewhere, or for another
    ``resume_from``: ``resume_from`` as given."""
    if resume_from not in (None, "auto"):
        return resume_from
    own = newest_checkpoint(base_path)
    reported = ray_checkpoint_folder()
    if reported is None:
        restarted = resume_from is None and own is not None and _written_by(own, ray_run())
        return "auto" if restarted else resume_from
    if own is not None and _steps(own) >= _steps(reported):
        return "auto"  # base_path's newest (resume_from='auto' finds it)
    return reported


def _written_by(folder: Path, run: str) -> bool:
    """Whether the Ray Train run ``run`` (``""``: none) wrote the checkpoint in ``folder``."""
    try:
        return bool(run) and read_progress(folder).ray_run == run
    except UnsafeFile:
        return False


def _steps(folder: Path) -> int:
    """The optimizer steps a checkpoint was taken after (-1 where its record does not read)."""
    try:
        return read_progress(folder).batch_count
    except UnsafeFile:
        return -1
