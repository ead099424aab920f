"""DDP as the benchmark workers run it on CPU: a communication hook that exchanges nothing (to time everything but
the all-reduce), the shim that lets flair's own ``multi_gpu=True`` build its DDP on CPU, and the gloo process group
of a rank that ``torch.multiprocessing`` started."""

# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as objects.

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import flair
import torch
from common import quiet_flair


def no_communication(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that exchanges nothing (timing only: the ranks' gradients then differ)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def cpu_ddp(
    module: torch.nn.Module, device_ids: Any = None, **kwargs: Any
) -> torch.nn.parallel.DistributedDataParallel:
    """The benchmark's only change to flair: ``device_ids=[None]`` (flair passes ``[flair.device.index]``, which is
    ``[None]`` on CPU and rejected by torch) becomes ``device_ids=None``. Every other argument is flair's own
    (``find_unused_parameters=True``)."""
    if device_ids is not None and all(d is None for d in device_ids):
        device_ids = None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **kwargs)


def cpu_ddp_without_communication(module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """:func:`cpu_ddp` with :func:`no_communication` registered (timing only)."""
    wrapped = cpu_ddp(module, **kwargs)
    wrapped.register_comm_hook(None, no_communication)
    return wrapped


@contextlib.contextmanager
def cpu_process_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """A gloo process group for a rank started by torch.multiprocessing, with flair on the CPU and quiet."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        quiet_flair()
        flair.device = torch.device("cpu")
        yield
    finally:
        torch.distributed.destroy_process_group()
