"""Whole weights in and out of a model sharded with PyTorch's composable FSDP (``fully_shard``).

:func:`full_state_dict` gives global rank 0 the plain tensors of every parameter and buffer (to write an ordinary flair
model file); :func:`load_full_state_dict` scatters global rank 0's tensors to the shards. Both are collectives.
:func:`read_distributed_checkpoint_whole` reads a sharded checkpoint whole (for a run that is not sharded).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module

from flair_fabric.state.safe_loading import load_data


def is_sharded(model: Module) -> bool:
    """Whether ``model`` has been sharded with ``fully_shard``."""
    return isinstance(model, FSDPModule)


def full_state_dict(model: Module) -> dict[str, torch.Tensor]:
    """The whole, plain state of a sharded ``model`` on global rank 0, on the CPU (``{}`` on the other ranks).

    A collective: every rank must call it.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)


def load_full_state_dict(model: Module, state: dict[str, torch.Tensor]) -> None:
    """Load global rank 0's whole ``state`` (the other ranks pass ``{}``) into the shards of ``model``.

    A collective: every rank must call it.
    """
    set_model_state_dict(
        model, cast(dict[str, Any], state), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: the local shard of a ``DTensor``, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` assembled on every rank (a collective), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def held_bytes(model: Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters and optimizer state this rank holds (shards count with their local size)."""
    tensors = [local_tensor(parameter) for parameter in model.parameters()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(local_tensor(value) for value in state.values() if isinstance(value, torch.Tensor))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def read_distributed_checkpoint_whole(path: Path) -> dict[str, Any]:
    """A PyTorch distributed checkpoint folder (``fabric.save`` under FSDP) read whole, as plain data (its parts were
    checked as data before any process started)."""
    with tempfile.TemporaryDirectory(prefix="flair-fabric-") as folder:  # 0o700
        whole = Path(folder) / "whole.pt"
        dcp_to_torch_save(path, whole)
        return cast(dict[str, Any], load_data(whole))
