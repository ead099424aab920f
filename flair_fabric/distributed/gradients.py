"""DDP's gradient average, taken after the backward passes instead of during the last one.

With ``mini_batch_chunk_size="auto"`` every backward pass of a step runs without gradient synchronisation, so that a
rank that runs out of memory in a forward or backward pass leaves no collective half done
(:mod:`flair_fabric.training.out_of_memory`). Once the ranks agreed that every pass fitted,
:func:`average_gradients` does what DDP's reducer does at the end of a synchronised backward pass: each gradient is
divided by the number of processes and summed over them, in buckets of about 25 MB (DDP's default bucket size), and
a parameter that got no gradient on any rank keeps none (DDP's ``find_unused_parameters``), while one that got a
gradient on some rank gets the average on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed

BUCKET_BYTES = 25 * 2**20


def _buckets(parameters: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters in consecutive groups of one dtype and device, each of at most ``BUCKET_BYTES`` (or one
    parameter)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for parameter in parameters:
        bytes_ = parameter.numel() * parameter.element_size()
        last = buckets[-1] if buckets else None
        if (
            last is None
            or size + bytes_ > BUCKET_BYTES
            or (last[0].dtype, last[0].device)
            != (
                parameter.dtype,
                parameter.device,
            )
        ):
            buckets.append([parameter])
            size = bytes_
        else:
            last.append(parameter)
            size += bytes_
    return buckets


def average_gradients(parameters: list[torch.nn.Parameter], learned_anywhere: list[bool], world_size: int) -> None:
    """Every rank: replace each parameter's gradient with its average over the ranks. ``learned_anywhere`` says, per
    parameter, whether any rank has a gradient for it (agreed on the host beforehand, so nothing is read back from the
    device here); the others keep none. One all-reduce per bucket on the default process group; none in one
    process."""
    if world_size == 1:
        return
    averaged = [parameter for parameter, learned in zip(parameters, learned_anywhere, strict=True) if learned]
    for bucket in _buckets(averaged):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]).div_(
            world_size
        )
        torch.distributed.all_reduce(flat)
        for parameter, part in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
            if parameter.grad is None:
                parameter.grad = part.view_as(parameter).clone()
            else:
                parameter.grad.copy_(part.view_as(parameter))
