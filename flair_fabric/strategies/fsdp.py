"""Sharded data parallel training of flair models with PyTorch's composable FSDP (``fully_shard``).

:class:`FlairFSDPStrategy` is Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy` with a parallelize
function that knows flair models: every transformer layer of a flair ``TransformerEmbeddings`` becomes its own shard
unit and the rest of the model the root unit. Parameters, gradients and optimizer state are split across all ranks.
Unlike Fabric's ``FSDPStrategy`` (FSDP1), this runs on CPU with gloo as well as on GPUs.

FSDP shards a copy of the caller's model (:class:`ShardedCopy`), which keeps the caller's model an ordinary flair model.
The helpers below move whole weights in and out of a sharded model: :func:`full_state_dict` (global rank 0 gets the
plain tensors) and :func:`load_full_state_dict` (global rank 0's tensors are scattered to the shards).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, cast

import flair
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.wrappers import _FabricModule
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.nn import Module

from flair_fabric.distributed.stalls import DEFAULT_COLLECTIVE_TIMEOUT
from flair_fabric.state.adapters import checkpoint_like
from flair_fabric.state.model_state import copy_model
from flair_fabric.strategies.base import Prepared, SetUp, StartMethod, StartsProcesses, TrainingStrategy
from flair_fabric.strategies.sharded_state import full_state_dict, held_bytes, load_full_state_dict

log = logging.getLogger("flair")

ShardPolicy = Callable[[Module], bool]
"""Decides for each submodule whether it becomes a shard unit of its own (the whole model is always the root unit)."""


def transformer_layer_classes(model: Module) -> set[str]:
    """Class names of the transformer layers inside ``model``: what each Hugging Face model inside it declares in
    ``_no_split_modules`` (``BertLayer``, ``RobertaLayer``, ...)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_transformer_layers(model: Module) -> ShardPolicy:
    """The default policy: one shard unit per transformer layer (see :func:`transformer_layer_classes`)."""
    layers = transformer_layer_classes(model)
    return lambda module: type(module).__name__ in layers


class FlairFSDPStrategy(StartsProcesses, ModelParallelStrategy):
    """Fully sharded data parallel training (ZeRO-3 style) of a flair model; ``strategy="fsdp"`` uses the defaults.

    Args:
        policy: which submodules become shard units of their own; by default every transformer layer (each unit's
            parameters are gathered only while that unit computes). A set of module classes or a function
            ``module -> bool``.
        reshard_after_forward: free the gathered parameters after each unit's forward pass (least memory, default);
            ``False`` keeps them until the backward pass (one all-gather less per unit and step, ZeRO-2 style).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory (GPU runs only).
        mixed_precision: PyTorch's ``MixedPrecisionPolicy`` for the shards (e.g. bf16 parameters in compute,
            fp32 gradient reduction); usually ``precision="bf16-mixed"`` is all you need.
        start_method: ``"popen"`` (default) relaunches the script once per extra device; ``"spawn"`` and ``"fork"``
            start workers from inside ``train`` (the caller's model receives the trained weights).
        timeout: how long a collective waits for the other processes (default: 10 minutes).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; by default the one for the device.
    """

    NAMES: ClassVar[dict[str, dict[str, Any]]] = {"fsdp": {}}

    @classmethod
    def from_name(
        cls, name: str, *, interactive: bool, timeout: timedelta, accelerator: str, find_unused: Any
    ) -> FlairFSDPStrategy:
        """``strategy="fsdp"``: processes start as with ``"ddp"`` (forked workers in a notebook)."""
        return cls(start_method="fork" if interactive else "popen", timeout=timeout)

    def __init__(
        self,
        *,
        policy: ShardPolicy | set[type[Module]] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        mixed_precision: MixedPrecisionPolicy | None = None,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = DEFAULT_COLLECTIVE_TIMEOUT,
        process_group_backend: str | None = None,
    ) -> None:
        self.checked_start_method("FlairFSDPStrategy", start_method)
        if policy is not None and not callable(policy) and not isinstance(policy, set):
            raise ValueError(
                f"FlairFSDPStrategy(policy={policy!r}) is not valid: pass a set of module classes or a function"
                " module -> bool."
            )
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise ValueError(
                f"FlairFSDPStrategy(mixed_precision={mixed_precision!r}) is not valid: pass a"
                " torch.distributed.fsdp.MixedPrecisionPolicy, or use precision='bf16-mixed'."
            )
        super().__init__(
            parallelize_fn=self._shard,
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.mixed_precision = mixed_precision
        self.start_method: StartMethod = start_method

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.start_method)

    def setup_environment(self) -> None:
        """Pure data parallelism: one mesh dimension over all processes of all nodes."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def _policy_for(self, model: Module) -> ShardPolicy:
        if self.policy is None:
            return shard_transformer_layers(model)
        if isinstance(self.policy, set):
            classes = tuple(self.policy)
            return lambda module: isinstance(module, classes)
        return self.policy

    def _shard(self, model: Module, device_mesh: DeviceMesh) -> Module:
        """Apply ``fully_shard`` to the policy's units (innermost first), then to the whole model."""
        options: dict[str, Any] = {
            "mesh": device_mesh["data_parallel"],
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        if self.mixed_precision is not None:
            options["mp_policy"] = self.mixed_precision
        policy = self._policy_for(model)
        units = [module for module in model.modules() if module is not model and policy(module)]
        for unit in reversed(units):
            fully_shard(unit, **options)
        # the root keeps its parameters from forward to backward (they would be gathered again at once), as FSDP2
        # does by default; a step that learns nothing then gathers them once, however many passes it makes
        fully_shard(model, **{**options, "reshard_after_forward": False})
        # flair trains through forward_loss, not forward: the root unit's hooks must run around it
        register_fsdp_forward_method(model, "forward_loss")
        log.info(f"FSDP: {len(units)} shard unit(s) plus the root, over {device_mesh.size()} process(es)")
        return model


ModelT = TypeVar("ModelT", bound=flair.nn.Model)


class ShardedCopy(Generic[ModelT]):
    """A copy of the caller's model for FSDP to shard; the caller's model keeps its class, evaluates, and gets the
    trained weights back.

    ``fully_shard`` changes the module it is given in place (its class and its parameters), so FSDP shards a copy
    rebuilt from the model's flair state. While the copy trains, the caller's parameters live on the ``meta`` device
    and hold no memory. For evaluation (:meth:`gathered`) and at the end (:meth:`hand_back`) they get the copy's
    whole current weights on every rank. Evaluating the plain model keeps FSDP's hooks out of inference, where ranks
    predict different numbers of batches. If training raises, the caller's model keeps no weights: load the last
    model file written.
    """

    def __init__(self, model: ModelT) -> None:
        self.caller_model = model
        self.working_model = copy_model(model)
        self._slots = [
            (module, name, f"{module_name}.{name}" if module_name else name)
            for module_name, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False)
        ]
        self._release()

    def _release(self) -> None:
        """Move the caller's parameters to the meta device (shared parameters stay shared)."""
        replaced: dict[int, torch.nn.Parameter] = {}
        for module, name, _ in self._slots:
            current = getattr(module, name)
            if id(current) not in replaced:
                meta = torch.empty_like(current, device="meta")
                replaced[id(current)] = torch.nn.Parameter(meta, current.requires_grad)
            setattr(module, name, replaced[id(current)])

    def _fill(self, weights: dict[str, torch.Tensor]) -> None:
        """Give the caller's parameters and buffers ``weights`` (shared parameters stay shared)."""
        replaced: dict[int, torch.nn.Parameter] = {}
        for module, name, qualified in self._slots:
            current = getattr(module, name)
            if id(current) not in replaced:
                value = weights[qualified].detach().to(flair.device)  # where this rank computes
                replaced[id(current)] = torch.nn.Parameter(value, current.requires_grad)
            setattr(module, name, replaced[id(current)])
        for module_name, module in self.caller_model.named_modules():  # buffers too: a model built on the CPU
            for name, buffer in list(module.named_buffers(recurse=False)):  # keeps e.g. BERT's token_type_ids there
                qualified = f"{module_name}.{name}" if module_name else name
                value = weights.get(qualified, buffer)
                setattr(module, name, value.detach().to(flair.device))
        self.caller_model.train(self.working_model.training)

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)  # every rank gets every tensor
        return cast(dict[str, torch.Tensor], get_model_state_dict(self.working_model, options=options))

    @contextlib.contextmanager
    def gathered(self) -> Iterator[ModelT]:
        """The caller's model with the current whole weights on every rank, for evaluation; released afterwards.

        A collective: every rank must enter it.
        """
        self._fill(self._whole_weights())
        try:
            yield self.caller_model
        finally:
            self._release()

    def hand_back(self) -> ModelT:
        """Give the caller's model the whole trained weights on every rank and return it. A collective."""
        self._fill(self._whole_weights())
        return self.caller_model


FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def check_fsdp_launch(strategy: FlairFSDPStrategy, accelerator: str, precision: str) -> None:
    """The precisions and options FSDP supports here."""
    if precision not in FSDP_PRECISIONS:
        raise ValueError(
            f"strategy='fsdp' does not support precision={precision!r}: choose one of {', '.join(FSDP_PRECISIONS)}"
            " (for fp16 mixed precision pass FlairFSDPStrategy(mixed_precision=MixedPrecisionPolicy(...)))."
        )
    if strategy.cpu_offload and accelerator != "cuda":
        raise ValueError(
            f"FlairFSDPStrategy(cpu_offload=True) moves shards from the GPU to the CPU, but the accelerator is"
            f" {accelerator!r}: leave cpu_offload=False."
        )


class Sharded(TrainingStrategy):
    """FSDP: a copy of the caller's model is sharded and trained; the caller's model evaluates with the whole current
    weights and gets the trained ones at the end (see :class:`ShardedCopy`)."""

    shards_training_state = True
    gathers_in_forward = True
    reads_checkpoints_on_every_rank = True

    def __init__(self) -> None:
        self.copy: ShardedCopy[flair.nn.Model] | None = None

    def clip_gradients(
        self, fabric: Fabric, module: _FabricModule, optimizer: Any, max_norm: float
    ) -> torch.Tensor | None:
        """Fabric's clipping of the sharded gradients (the norm over every rank's shards)."""
        return fabric.clip_gradients(module, optimizer, max_norm=max_norm, error_if_nonfinite=False)

    def set_up(self, run: SetUp) -> Prepared:
        fabric, model, make_optimizer = run.fabric, run.model, run.make_optimizer
        self.copy = ShardedCopy(model)
        working = self.copy.working_model
        if checkpoint_like(model, working):  # the copy is rebuilt without the caller's gradient checkpointing
            log.info("peft: the sharded copy checkpoints its transformer's gradients too (non-reentrant)")
        module = fabric.setup_module(working)
        module.mark_forward_method("forward_loss")
        optimizer = cast(torch.optim.Optimizer, fabric.setup_optimizers(make_optimizer(working)))  # over the shards
        log.info(f"FSDP: this rank holds {held_bytes(working) / 2**20:.2f} MiB of parameters")
        return Prepared(module, optimizer, working)

    def model_for_inference(self, model: flair.nn.Model) -> contextlib.AbstractContextManager[flair.nn.Model]:
        assert self.copy is not None
        return self.copy.gathered()

    def caller_model(self, model: flair.nn.Model) -> flair.nn.Model:
        return self.copy.caller_model if self.copy is not None else model

    def hand_back(self, model: flair.nn.Model) -> flair.nn.Model:
        assert self.copy is not None
        return self.copy.hand_back()

    def whole_weights(self, model: flair.nn.Model) -> dict[str, torch.Tensor] | None:
        return full_state_dict(model)  # gathered to global rank 0

    def load_whole_weights(self, fabric: Fabric, model: flair.nn.Model, state: dict[str, torch.Tensor] | None) -> None:
        load_full_state_dict(model, state or {})  # scattered from global rank 0 into the shards

    def checkpoint_keys(self, model: flair.nn.Model) -> set[str] | None:
        return None  # a distributed checkpoint keeps every shard (Lightning filters no sharded checkpoint)

    def load_checkpoint(self, fabric: Fabric, path: Path, module: _FabricModule, optimizer: Any) -> None:
        fabric.load(path, {"model": module, "optimizer": optimizer}, weights_only=True)  # whole or sharded: Lightning
