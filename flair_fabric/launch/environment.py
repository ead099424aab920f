"""Where this process runs: started by torchrun or SLURM, inside a notebook, with CUDA already initialised.

Detection goes through Fabric's own cluster environments (``TorchElasticEnvironment``, ``SLURMEnvironment``), so a
script started by ``torchrun`` or ``srun`` is recognised exactly as Fabric will recognise it. The one exception is
MPI: Fabric asks ``mpi4py`` in every process, which initialises MPI, and where Open MPI is installed without a
launcher to start its daemon (a container image with ``mpi4py`` and no ``ssh``/``rsh``) that
aborts the whole process. :func:`cluster_environment` asks MPI only when an MPI launcher started the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from flair_fabric.launch.ray_train import RayEnvironment, ray_world

# What mpirun / mpiexec (Open MPI, MPICH and Intel MPI through PMI or PMIx, MVAPICH) put into each process it starts.
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class ExternalLaunch:
    """Processes started by a launcher outside Python: how many per node, on how many nodes."""

    launcher: str
    devices: int
    num_nodes: int
    description: str


def external_launch() -> ExternalLaunch | None:
    """The launcher that started this process (Ray Train, torchrun or SLURM), or ``None`` for an ordinary script.
    Ray first: a Ray cluster started inside a SLURM job has SLURM's variables in every worker."""
    ray = ray_world()
    if ray is not None:
        return ExternalLaunch("Ray", ray.local_world_size, ray.num_nodes, ray.described())
    if SLURMEnvironment.detect():
        tasks = int(os.environ["SLURM_NTASKS"])
        nodes = int(os.environ.get("SLURM_NNODES", "1"))
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        devices = int(per_node) if per_node.isdigit() else tasks // nodes
        described = f"SLURM started {tasks} task(s) on {nodes} node(s) (--ntasks-per-node={devices})"
        return ExternalLaunch("SLURM", devices, nodes, described)
    if TorchElasticEnvironment.detect():
        world_size = int(os.environ["WORLD_SIZE"])
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nodes = max(world_size // devices, 1)
        described = f"torchrun started {world_size} process(es), {devices} per node (--nproc_per_node={devices})"
        return ExternalLaunch("torchrun", devices, nodes, described)
    return None


_own_process_group: list[weakref.ref] = []
"""The default process group a run of flair-fabric made in this process, by a weak reference: a strong one would keep
a destroyed group alive, and a forked worker that drops its copy would wait for ever in gloo's destructor, joining
threads that did not survive the fork."""


def mark_process_group_as_own() -> None:
    """Remember the default process group as one a run of this process made (a later run of the same script, on the
    same ranks, goes on in it)."""
    _own_process_group[:] = [weakref.ref(torch.distributed.group.WORLD)] if torch.distributed.is_initialized() else []


def foreign_process_group_size() -> int | None:
    """The number of processes of a default process group this process is in already that no run of flair-fabric
    made (Ray Train's, another engine's, the script's own), or ``None`` where there is none."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if _own_process_group and _own_process_group[0]() is torch.distributed.group.WORLD:
        return None
    return int(torch.distributed.get_world_size())


def started_by_mpi_launcher() -> bool:
    """Whether ``mpirun``/``mpiexec`` started this process (one of :data:`MPI_LAUNCHER_VARIABLES` is set)."""
    return any(name in os.environ for name in MPI_LAUNCHER_VARIABLES)


def cluster_environment() -> ClusterEnvironment:
    """The cluster environment Fabric would choose (torchrun, SLURM, LSF, MPI, else Lightning's own), in Fabric's
    order, except that MPI is asked only when an MPI launcher started this process: ``MPIEnvironment.detect()``
    initialises MPI, which aborts the process where Open MPI cannot start its daemon. Inside a Ray Train worker:
    :class:`~flair_fabric.launch.ray_train.RayEnvironment` (Fabric has none for Ray)."""
    if RayEnvironment.detect():
        return RayEnvironment()
    for environment in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment):
        if environment.detect():
            return environment()
    if started_by_mpi_launcher() and MPIEnvironment.detect():
        return MPIEnvironment()
    return LightningEnvironment()


def use_this_ranks_gpu() -> None:
    """In a rank started by a launcher (``LOCAL_RANK`` set: the script relaunch, torchrun, SLURM through Lightning's
    environment): point flair's default device at this rank's GPU before the script builds its model, so that not
    every rank builds it on cuda:0 first (a context and a model copy on GPU 0 per rank). Only flair's default is
    changed; a device the user chose is kept. Fabric sets the device for training itself."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None or not local_rank.isdigit() or not torch.cuda.is_available():
        return
    import flair

    if flair.device.type == "cuda" and flair.device.index in (None, 0):
        flair.device = torch.device("cuda", int(local_rank) % max(torch.cuda.device_count(), 1))


def restarted_by_torchrun() -> bool:
    """Whether torchrun restarted the workers after a failure (``--max-restarts``): ``TORCHELASTIC_RESTART_COUNT``."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def is_or_starts_global_zero() -> bool:
    """Whether this process is (or, before a launch, starts) global rank 0: an ordinary script, or the process
    torchrun or SLURM started as rank 0."""
    launch = external_launch()
    if launch is None:
        return True
    rank = os.environ.get("SLURM_PROCID") if launch.launcher == "SLURM" else os.environ.get("RANK")
    return rank in (None, "0")


def is_interactive() -> bool:
    """Whether Python runs interactively (a notebook or a REPL), where a script cannot be relaunched."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel or was forked from one (its output goes to a notebook)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def cuda_is_initialized() -> bool:
    """Whether this process has already initialised CUDA (after which it cannot fork workers that use it)."""
    return torch.cuda.is_initialized()


CUDA_SUCCESS = 0


def cuda_driver_initialized() -> bool:
    """Whether this process has initialised the CUDA driver (``cuInit``), which ``torch.cuda.is_initialized()`` does
    not tell: without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, ``torch.cuda.is_available()`` (``import flair`` asks it)
    calls cudaGetDeviceCount, which initialises the driver, and workers forked afterwards cannot use the GPU. Asked
    through the driver API, without loading or initialising anything: a driver library not
    yet loaded into this process (``RTLD_NOLOAD``) was not initialised, and ``cuDeviceGetCount`` fails with
    CUDA_ERROR_NOT_INITIALIZED until ``cuInit`` ran."""
    if torch.version.cuda is None or not hasattr(os, "RTLD_NOLOAD"):
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(driver.cuDeviceGetCount(ctypes.byref(count))) == CUDA_SUCCESS


@contextmanager
def environment_restored(*names: str) -> Iterator[None]:
    """Put the named environment variables back as they were on exit.

    Fabric's in-process launcher (spawn, fork) writes the port it picked into the caller's ``MASTER_PORT``; left
    there, every later run and every subprocess of the caller would reuse that port, and two of them would collide.
    """
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _BannerOfGlobalZeroOnly(logging.Filter):
    """Lets Lightning's "Initializing distributed: GLOBAL_RANK: r, MEMBER: ..." line through for rank 0 only (every
    rank prints it, on stderr, which a notebook shows in red)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith("Initializing distributed: GLOBAL_RANK:") or "GLOBAL_RANK: 0," in message


def quiet_lightning_banner() -> None:
    """Install :class:`_BannerOfGlobalZeroOnly` on Lightning's logger (once per process; workers inherit it or
    install it when they import flair-fabric)."""
    logger = logging.getLogger("lightning.fabric.utilities.distributed")
    if not any(isinstance(existing, _BannerOfGlobalZeroOnly) for existing in logger.filters):
        logger.addFilter(_BannerOfGlobalZeroOnly())
