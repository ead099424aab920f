"""Collectives flair-fabric adds to Fabric's: Python objects to global rank 0, and "did any rank flag?"."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed
from lightning.fabric import Fabric


def accumulator_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it, for sums that must not lose data points."""
    return torch.float32 if device.type == "mps" else torch.float64


def gather_to_global_zero(fabric: Fabric, value: Any) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on global rank 0 (``None`` elsewhere). A collective."""
    if fabric.world_size == 1:
        return [value]
    gathered: list[Any] | None = [None] * fabric.world_size if fabric.is_global_zero else None
    torch.distributed.gather_object(value, gathered, dst=0)
    return gathered


def any_rank(fabric: Fabric, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: one all-reduce, the same answer on every rank (none in one process)."""
    if fabric.world_size == 1:
        return flag
    vote = torch.tensor(float(flag), device=fabric.device)
    return bool(cast(torch.Tensor, fabric.all_reduce(vote, reduce_op="sum")).item() > 0)
