"""Python objects moved between ranks (the tensor collectives are Fabric's)."""

from __future__ import annotations

from typing import Any

import torch.distributed
from lightning.fabric import Fabric


def gather_to_global_zero(fabric: Fabric, value: Any) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on global rank 0 (``None`` elsewhere). A collective."""
    if fabric.world_size == 1:
        return [value]
    gathered: list[Any] | None = [None] * fabric.world_size if fabric.is_global_zero else None
    torch.distributed.gather_object(value, gathered, dst=0)
    return gathered
