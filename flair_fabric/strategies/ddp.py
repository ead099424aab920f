"""Data parallel training (DDP, and one device): :class:`FlairDDPStrategy` and its part in the loop.

flair models often hold parameters that never receive a gradient (the pooler of a transformer, a word-embedding
table behind a frozen layer, ...). DDP with ``find_unused_parameters=False`` then fails with "Expected to have
finished reduction in the prior iteration", while ``find_unused_parameters=True`` walks the autograd graph on every
step. :class:`FlairDDPStrategy` decides once per run: before wrapping, one probe step finds out whether the model
has such parameters, and only then pays for the search.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, ClassVar, Literal, cast

import flair
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from flair_fabric.distributed.stalls import DEFAULT_COLLECTIVE_TIMEOUT
from flair_fabric.state.adapters import adapter_parameters, non_reentrant_checkpointing
from flair_fabric.strategies.base import Prepared, SetUp, StartMethod, StartsProcesses, TrainingStrategy
from flair_fabric.strategies.compression import GradientCompression, checked_compression, register_compression
from flair_fabric.strategies.probing import parameters_without_gradient

log = logging.getLogger("flair")

FindUnused = bool | Literal["auto"]


class FlairDDPStrategy(StartsProcesses, DDPStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` with ``find_unused_parameters="auto"``.

    Args:
        find_unused_parameters: ``"auto"`` (default) probes the model once before wrapping and turns DDP's search for
            unused parameters on only if some parameter got no gradient; ``True``/``False`` force it.
        gradient_compression: ``None`` (default) all-reduces exact fp32 gradients; ``"bf16"``/``"fp16"`` send them
            in half precision, ``"powersgd"`` as low-rank approximations (PyTorch's DDP communication hooks). Less
            traffic, slightly different results: see docs/ddp-communication.md.
        powersgd_options: With ``"powersgd"``: arguments of torch's ``PowerSGDState`` over flair-fabric's
            defaults (rank 1, compression from step 10, error feedback, warm start).
        start_method: ``"popen"`` (default) relaunches the script once per extra device; ``"spawn"`` and ``"fork"``
            start worker processes from inside ``train`` (the caller's model receives the trained weights).
        **kwargs: Any other :class:`DDPStrategy` argument (``timeout``, 10 minutes by default;
            ``process_group_backend``; DDP options such as ``static_graph``).
    """

    NAMES: ClassVar[dict[str, dict[str, Any]]] = {
        "ddp": {"start_method": "popen"},
        "ddp_spawn": {"start_method": "spawn"},
        "ddp_fork": {"start_method": "fork"},
        "ddp_notebook": {"start_method": "fork"},
    }

    @classmethod
    def from_name(
        cls, name: str, *, interactive: bool, timeout: timedelta, accelerator: str, find_unused: FindUnused
    ) -> FlairDDPStrategy:
        """The strategy ``strategy=name`` means."""
        return cls(**cls.NAMES[name], timeout=timeout, find_unused_parameters=find_unused)

    def __init__(
        self,
        *,
        find_unused_parameters: FindUnused = "auto",
        gradient_compression: GradientCompression | None = None,
        powersgd_options: dict[str, Any] | None = None,
        start_method: StartMethod = "popen",
        **kwargs: Any,
    ) -> None:
        self.checked_start_method("FlairDDPStrategy", start_method)
        if find_unused_parameters not in (True, False, "auto"):
            raise ValueError(
                f"find_unused_parameters={find_unused_parameters!r} is not valid: pass True, False or 'auto'."
            )
        self.powersgd_options = checked_compression(gradient_compression, powersgd_options)
        kwargs.setdefault("timeout", DEFAULT_COLLECTIVE_TIMEOUT)
        kwargs.setdefault("gradient_as_bucket_view", True)  # gradients live in DDP's buckets: no copy per step
        super().__init__(start_method=start_method, **kwargs)
        self.find_unused_parameters: FindUnused = find_unused_parameters
        self.passes_synchronise = True
        """``False`` with ``mini_batch_chunk_size="auto"``: no forward or backward pass may run a collective (no
        buffer broadcast either), because a pass that runs out of memory on one rank must leave none half done."""
        self.gradient_compression = gradient_compression
        self.start_method: StartMethod = start_method

    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP once ``find_unused_parameters`` is decided."""
        if self.find_unused_parameters == "auto":
            raise RuntimeError(
                "FlairDDPStrategy.find_unused_parameters is still 'auto': call resolve_unused_parameters() before"
                " fabric.setup_module()."
            )
        if self.gradient_compression == "powersgd" and self.find_unused_parameters:
            raise ValueError(
                "gradient_compression='powersgd' with find_unused_parameters=True (the probe found parameters without"
                " a gradient, or it was forced): the ranks' PowerSGD collectives fall out of step (seen on gloo). Use"
                " 'bf16' or 'fp16', or let every trainable parameter get a gradient (freeze the others)."
            )
        self._ddp_kwargs = {**self._ddp_kwargs, "find_unused_parameters": self.find_unused_parameters}
        if not self.passes_synchronise:  # DDP broadcasts buffers in a forward pass that follows a synchronised one
            self._ddp_kwargs["broadcast_buffers"] = False
        wrapped = super().setup_module(module)
        register_compression(wrapped, self.gradient_compression, self.powersgd_options)
        return wrapped


def resolve_unused_parameters(fabric: Fabric, model: flair.nn.Model, probe_batch: list) -> None:
    """Decide ``find_unused_parameters`` for a :class:`FlairDDPStrategy` set to ``"auto"``; no-op otherwise.

    Every rank probes; the answer is all-reduced so that all ranks wrap the model the same way.
    """
    strategy = fabric.strategy
    if not isinstance(strategy, FlairDDPStrategy) or strategy.find_unused_parameters != "auto":
        return
    unused = parameters_without_gradient(model, probe_batch)
    frozen = freeze_adapter_weights_without_gradient(fabric, model, unused)
    unused = [name for name in unused if name not in frozen]
    vote = torch.tensor(float(bool(unused)), device=fabric.device)
    votes = cast(torch.Tensor, fabric.all_reduce(vote, reduce_op="sum"))
    strategy.find_unused_parameters = bool(votes.item() > 0)
    if unused:
        shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
        log.info(f"DDP: {len(unused)} parameter(s) get no gradient ({shown}): find_unused_parameters=True")
    else:
        log.info("DDP: every parameter gets a gradient: find_unused_parameters=False")


def freeze_adapter_weights_without_gradient(fabric: Fabric, model: flair.nn.Model, unused: list[str]) -> set[str]:
    """The probe's rule for peft adapters: a LoRA weight that got no gradient on any rank (its layer never reaches
    the loss, e.g. a transformer's pooler, which flair never uses) can never get one, so it is frozen with a warning
    naming it, rather than turning DDP's search for unused parameters on. Returns the names frozen."""
    weights = adapter_parameters(model)
    if not weights:
        return set()
    got_gradient = torch.tensor([float(name not in unused) for name, _ in weights], device=fabric.device)
    if fabric.world_size > 1:  # every rank freezes the same weights
        got_gradient = cast(torch.Tensor, fabric.all_reduce(got_gradient, reduce_op="sum"))
    frozen = {name for (name, _), count in zip(weights, got_gradient.tolist(), strict=True) if count == 0}
    for name, parameter in weights:
        if name in frozen:
            parameter.requires_grad_(False)
    if frozen:
        shown = ", ".join(sorted(frozen)[:6]) + (" ..." if len(frozen) > 6 else "")
        log.warning(
            f"peft: {len(frozen)} adapter weight(s) get no gradient, their layers never reach flair's loss ({shown}):"
            " they are frozen and stay as initialised. Leave these modules out of target_modules."
        )
    return frozen


class DataParallel(TrainingStrategy):
    """DDP (or one device): the model is placed, probed for unused parameters, wrapped; then the optimizer."""

    def __init__(self, compresses_gradients: bool = False) -> None:
        self.compresses_gradients = compresses_gradients

    def check_run(self, *, reduces_vocabulary: bool, mini_batch_chunk_size: int | str | None) -> None:
        super().check_run(reduces_vocabulary=reduces_vocabulary, mini_batch_chunk_size=mini_batch_chunk_size)
        if mini_batch_chunk_size == "auto" and self.compresses_gradients:
            raise ValueError(
                "mini_batch_chunk_size='auto' sums the ranks' gradients itself, outside DDP's communication, so"
                " DDP's gradient_compression hook would never run: pass a fixed mini_batch_chunk_size with"
                " gradient_compression, or leave compression off."
            )

    def set_up(self, run: SetUp) -> Prepared:
        fabric, model, make_optimizer = run.fabric, run.model, run.make_optimizer
        fabric.to_device(model)
        optimizer = make_optimizer(model)
        run.before_wrapping(optimizer)  # flair's vocabulary reduction, on every rank before DDP sees the parameters
        if non_reentrant_checkpointing(model):
            log.info("peft: the transformer's gradient checkpointing is made non-reentrant (DDP-safe)")
        resolve_unused_parameters(fabric, model, run.probe_batch)
        module = fabric.setup_module(model)
        module.mark_forward_method("forward_loss")
        return Prepared(module, cast(torch.optim.Optimizer, fabric.setup_optimizers(optimizer)), model)
