"""Gradient compression for DDP, by choice: a DDP communication hook registered on the wrapped model.

``"bf16"`` and ``"fp16"`` halve the bytes all-reduced: each bucket is divided by the world size, cast down, summed and
cast back, as PyTorch's ``fp16_compress_hook`` does, but dividing before the cast (PyTorch's casts first: a gradient
beyond float16's range overflows there even where the average fits). PyTorch's ``bf16_compress_hook`` refuses every
backend but NCCL, while gloo sums bf16 as well, so the hook here serves both types on every backend.
``"powersgd"`` is PyTorch's PowerSGD hook, one bucket after the other (:func:`ordered_powersgd_hook`): a low-rank
approximation of every large gradient matrix, with error feedback (Vogels et al., 2019). All three change the
gradients a little, so results are no longer bit-equal to exact DDP: docs/ddp-communication.md has the measured
trade-off.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import inspect
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

GradientCompression = Literal["bf16", "fp16", "powersgd"]
COMPRESSIONS: tuple[str, ...] = get_args(GradientCompression)

POWERSGD_DEFAULTS: dict[str, Any] = {
    "matrix_approximation_rank": 1,
    "start_powerSGD_iter": 10,  # PyTorch's default (1000) would leave a short fine-tuning run uncompressed
    "min_compression_rate": 2,
    "use_error_feedback": True,
    "warm_start": True,
}


def checked_compression(
    compression: GradientCompression | None, powersgd_options: dict[str, Any] | None
) -> dict[str, Any]:
    """The PowerSGD options to use (defaults filled in), or a clear error about either argument."""
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(
            f"gradient_compression={compression!r} is not valid: pass None (exact, the default) or one of"
            f" {', '.join(repr(c) for c in COMPRESSIONS)}."
        )
    if powersgd_options and compression != "powersgd":
        raise ValueError("powersgd_options is given but gradient_compression is not 'powersgd': pass both or neither.")
    options = {**POWERSGD_DEFAULTS, **(powersgd_options or {})}
    accepted = set(inspect.signature(powerSGD_hook.PowerSGDState).parameters) - {"process_group"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"powersgd_options: unknown option(s) {unknown}; see torch's PowerSGDState.")
    if options["start_powerSGD_iter"] < 2 and (options["use_error_feedback"] or options["warm_start"]):
        raise ValueError("powersgd_options: start_powerSGD_iter must be at least 2 with error feedback or warm start.")
    return options


def half_precision_hook(dtype: torch.dtype, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook (its state is ``dtype``): all-reduce the bucket's average in ``dtype``, written back
    in place. The bucket is divided by the world size before the cast (in place, as DDP's own all-reduce hook does;
    the result overwrites it)."""
    group = dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.div_(dist.get_world_size(group)).to(dtype)

    def decompress(future: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(future.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


@dataclass
class OrderedPowerSGDState:
    """PyTorch's PowerSGD state, and the future of the bucket whose collectives were started last."""

    powersgd: powerSGD_hook.PowerSGDState
    previous: torch.futures.Future[torch.Tensor] | None = None


def ordered_powersgd_hook(state: OrderedPowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook``, one bucket after the other. It all-reduces a bucket twice, the second time from a
    callback of the first; with several buckets in flight the ranks can then start their collectives in different
    orders (gloo: "Received data size doesn't match expected size", or a hang). A bucket starts once the previous
    bucket's collectives have ended; backward still runs meanwhile."""
    if state.previous is not None:
        state.previous.wait()
    state.previous = powerSGD_hook.powerSGD_hook(state.powersgd, bucket)
    return state.previous


def register_compression(
    module: DistributedDataParallel, compression: GradientCompression | None, powersgd_options: dict[str, Any]
) -> None:
    """Register the communication hook for ``compression`` on ``module`` (nothing for exact all-reduce)."""
    if compression in ("bf16", "fp16"):
        dtype = torch.bfloat16 if compression == "bf16" else torch.float16
        module.register_comm_hook(dtype, half_precision_hook)
    elif compression == "powersgd":
        state = OrderedPowerSGDState(powerSGD_hook.PowerSGDState(process_group=None, **powersgd_options))
        module.register_comm_hook(state, ordered_powersgd_hook)
