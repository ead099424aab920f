"""What crosses between host and device when the ranks agree at a log point (Lockstep.agree): the flags and counts
are packed on the host and cross in one non-waiting copy; the result is read back once (one process: the loss sum
only, and nothing at all without device values).

On CPU host and device are the same memory, so the crossings are followed, not timed: a TorchFunctionMode tracks
which tensors stand for device tensors (the device values given to ``agree``, what is moved to ``fabric.device``,
what the collective returns and what is computed from them) and counts every copy from the host into them
(``.to(device)``, a tensor built with ``device=``, an element written from a Python number) and every read-back
from them to the host (``item``, ``tolist``, ``float()`` ...). The collective is a stand-in for the other rank.
What this cannot see: whether a copy really overlaps on a GPU (it checks the ``non_blocking`` request) and syncs that
go through no tensor call; the GPU check counts those with ``torch.cuda.set_sync_debug_mode``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from flair_fabric.distributed.lockstep import Lockstep

READ_BACKS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}
DEVICE = torch.device("cpu")  # the stand-in fabric's device


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def _is_device(value: Any) -> bool:
    return isinstance(value, (torch.device, str)) and torch.device(value) == DEVICE


class _Crossings(TorchFunctionMode):
    """Follows the device side's tensors and counts host-to-device copies and device-to-host read-backs."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive, so ids stay unique)
        self.to_device: list[tuple[str, bool]] = []  # (how, non_blocking)
        self.read_backs: list[str] = []
        self.paused = False

    def mark(self, value: Any) -> None:
        for tensor in _tensors(value):
            self._device[id(tensor)] = tensor

    def on_device(self, value: Any) -> bool:
        return any(id(tensor) in self._device for tensor in _tensors(value))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.paused:
            return result
        name = getattr(func, "__name__", str(func))
        from_device = self.on_device(args) or self.on_device(kwargs)
        targets_device = any(_is_device(value) for value in (*args[1:], kwargs.get("device")))
        if name in READ_BACKS and from_device:
            self.read_backs.append(name)
        elif name in ("to", "copy_") and targets_device and not from_device:
            self.to_device.append((name, bool(kwargs.get("non_blocking", False))))
            self.mark(result)
        elif name == "copy_" and self.on_device(args[0]) and not self.on_device(args[1:]):
            self.to_device.append((name, bool(kwargs.get("non_blocking", False))))
        elif name == "__setitem__" and self.on_device(args[0]) and not self.on_device(args[2:]):
            self.to_device.append(("element written from the host", False))
        elif _is_device(kwargs.get("device")):
            # built on the device: from host data a copy (torch.tensor), an allocation otherwise (torch.zeros)
            if name in ("tensor", "as_tensor", "scalar_tensor", "full", "from_numpy"):
                self.to_device.append((f"torch.{name}(device=...)", False))
            self.mark(result)
        elif from_device:
            self.mark(result)
        return result


@dataclass
class _StandInFabric:
    """The parts of Fabric that Lockstep uses; the collective adds what a second rank holds (its own values, no
    flags), counted and outside the tracking."""

    crossings: _Crossings
    world_size: int
    global_rank: int = 0
    device: torch.device = DEVICE
    collectives: list[int] = field(default_factory=list)

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        assert reduce_op == "sum"
        self.crossings.paused = True
        try:
            self.collectives.append(tensor.numel())
            other = tensor.clone()
            other[: Lockstep.SLOTS * self.world_size] = 0.0  # the other rank holds no flags
            summed = tensor + other
        finally:
            self.crossings.paused = False
        self.crossings.mark(summed)
        return summed

    def broadcast(self, value: Any, src: int = 0) -> Any:
        return value


def _agree(world_size: int, *values: torch.Tensor | float, checkpoint: bool = False) -> tuple[Any, Any, Any]:
    crossings = _Crossings()
    fabric = _StandInFabric(crossings, world_size)
    lockstep = Lockstep(fabric)  # type: ignore[arg-type]
    if checkpoint:
        lockstep.request_checkpoint()
    crossings.mark([value for value in values if isinstance(value, torch.Tensor)])
    with crossings:
        agreed = lockstep.agree(*values)
    return agreed, crossings, fabric


def _loss_sum() -> torch.Tensor:
    """A loss sum as the run keeps it: a float64 tensor on the device, with autograd history left behind."""
    return torch.tensor(12.5, dtype=torch.float64)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_step_agreement_of_two_ranks_packs_the_host_values_into_one_non_waiting_copy_and_reads_back_once(
    checkpoint: bool,
) -> None:
    """A log point (the loss sum on the device, the data point count and the flags on the host): one collective,
    exactly one copy to the device and it does not wait, one read-back; the sums are right."""
    agreed, crossings, fabric = _agree(2, _loss_sum(), 7.0, checkpoint=checkpoint)
    assert agreed.values == [25.0, 14.0] and agreed.checkpoint is checkpoint
    assert len(fabric.collectives) == 1, "one collective per agreement"
    assert len(crossings.to_device) == 1, f"the host values must cross to the device once: {crossings.to_device}"
    assert all(non_blocking for _, non_blocking in crossings.to_device), f"a waiting copy: {crossings.to_device}"
    assert len(crossings.read_backs) == 1, f"read-backs: {crossings.read_backs}"


def test_step_agreement_of_two_ranks_without_values_crosses_once_each_way() -> None:
    """Between log points (flags only): one non-waiting copy to the device, one read-back."""
    agreed, crossings, fabric = _agree(2)
    assert agreed.values == [] and len(fabric.collectives) == 1
    assert len(crossings.to_device) == 1 and all(non_blocking for _, non_blocking in crossings.to_device)
    assert len(crossings.read_backs) == 1, f"read-backs: {crossings.read_backs}"


def test_step_agreement_in_one_process_reads_back_the_loss_sum_only() -> None:
    """One process: no collective; the loss sum is the one read-back and nothing goes to the device; without
    device values nothing crosses at all."""
    agreed, crossings, fabric = _agree(1, _loss_sum(), 7.0)
    assert agreed.values == [12.5, 7.0] and not fabric.collectives
    assert crossings.read_backs and len(crossings.read_backs) == 1, f"read-backs: {crossings.read_backs}"
    assert not crossings.to_device, crossings.to_device
    agreed, crossings, fabric = _agree(1, 3.0, 7.0)
    assert agreed.values == [3.0, 7.0]
    assert not crossings.read_backs and not crossings.to_device, (crossings.read_backs, crossings.to_device)
