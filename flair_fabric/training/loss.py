"""Train loss and throughput across ranks, kept on the device until someone reads them.

flair's losses are sums over data points. Each rank keeps the sum of its losses as a device tensor and the number
of data points as an int; one all-reduce at a log point or at the end of an epoch turns them into the
sample-weighted global mean, the same number on every rank. Nothing here synchronises inside the training step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flair_fabric.distributed.collectives import accumulator_dtype


@dataclass(frozen=True)
class GlobalLoss:
    """The all-reduced state of a :class:`LossTracker`."""

    mean: float
    data_points: int

    @classmethod
    def of(cls, loss_sum: float, data_points: float) -> GlobalLoss:
        """From the all-reduced loss sum and data point count."""
        total = round(data_points)
        return cls(mean=loss_sum / total if total > 0 else 0.0, data_points=total)


class LossTracker:
    """Sum of losses (device tensor) and count of data points on this rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss_sum = torch.zeros((), dtype=accumulator_dtype(device), device=device)
        self.data_points = 0

    def add(self, loss_sum: torch.Tensor, data_points: int) -> None:
        """Add a summed loss (any float tensor, detached here) over ``data_points`` data points."""
        self.loss_sum += loss_sum.detach().to(self.loss_sum.dtype)
        self.data_points += data_points

    def mean(self) -> torch.Tensor:
        """This rank's mean loss as a device tensor (no synchronisation)."""
        return self.loss_sum / max(self.data_points, 1)
