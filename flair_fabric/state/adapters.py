"""flair models whose transformer embeddings carry peft adapters (``TransformerEmbeddings(..., peft_config=...)``).

flair 0.15.1 builds the adapters but does not save their configuration (``to_params`` leaves ``peft_config`` out), so
its own ``load`` of such a model fails on the adapters' state keys (flairNLP/flair#3623, fixed upstream by PR #3627,
not released). This module fixes that in flair-fabric's layer, without changing flair:

- :func:`with_adapter_configs` puts each adapter's configuration into the model's flair state, as flair's fix does,
  so that flair's own ``from_params`` rebuilds the adapters (a model moved to spawned workers, FSDP's working copy);
- :func:`merged_weights` gives the weights of the plain transformer with the LoRA adapters merged into it (what
  peft's ``merge_and_unload`` computes): model files written with them load with stock flair, without peft;
- :func:`weights_from_merged` turns such a file's weights back into weights of the adapted model (the base holds the
  merged weights, the LoRA ``B`` matrices are zero), so the run can load its own ``best-model.pt``;
- :func:`trainable_keys` and :func:`load_model_state` keep checkpoints of the adapters' size (the frozen base comes
  from the model's own source when a run resumes).

peft is imported only when a model already holds adapters (``sys.modules``): without peft nothing here imports it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from flair.embeddings import TransformerEmbeddings

ADAPTER = "default"
"""The adapter flair's ``get_peft_model`` creates (peft's default name)."""
PEFT_PREFIX = "base_model.model."
"""Where peft puts the wrapped transformer in the adapted model's state keys."""
MERGED_BASE = "_flair_fabric_base_holds_merged_weights"
"""Set on adapted embeddings whose base layers were given merged weights (:func:`weights_from_merged`): from then on
their adapters alone no longer give the model (``save_adapters``, :mod:`flair_fabric.state.adapter_files`)."""


def _peft_model_class() -> type | None:
    peft = sys.modules.get("peft")
    return getattr(peft, "PeftModel", None) if peft is not None else None


def adapted_embeddings(model: torch.nn.Module) -> Iterator[tuple[str, TransformerEmbeddings]]:
    """``(name, embeddings)`` of every transformer embeddings inside ``model`` whose transformer carries adapters."""
    peft_model = _peft_model_class()
    if peft_model is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, TransformerEmbeddings) and isinstance(getattr(module, "model", None), peft_model):
            yield name, module


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds transformer embeddings with peft adapters."""
    return next(adapted_embeddings(model), None) is not None


def merged_bases(model: torch.nn.Module) -> list[str]:
    """The names of the adapted embeddings of ``model`` whose base holds merged weights (:data:`MERGED_BASE`)."""
    return [name for name, embeddings in adapted_embeddings(model) if getattr(embeddings, MERGED_BASE, False)]


def mark_merged_bases(model: torch.nn.Module, names: list[str]) -> None:
    """Mark the adapted embeddings ``names`` of ``model`` (:data:`MERGED_BASE`): a model given the weights of one
    whose base held merged weights (the caller's, after workers) holds them too."""
    for name, embeddings in adapted_embeddings(model):
        if name in names:
            setattr(embeddings, MERGED_BASE, True)


def _lora_layers(embeddings: TransformerEmbeddings) -> Iterator[tuple[str, Any]]:
    """``(name inside the peft model, layer)`` of each adapter layer; refuses what cannot be merged here."""
    from peft.tuners.lora import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    for name, layer in embeddings.model.named_modules():
        if isinstance(layer, ModulesToSaveWrapper) or (
            isinstance(layer, BaseTunerLayer) and not isinstance(layer, Linear)
        ):
            raise ValueError(
                f"peft_config: the adapter layer {name} ({type(layer).__name__}) is not a LoRA Linear layer;"
                " flair-fabric trains LoRA adapters on Linear layers (target_modules such as ['query', 'value']) and"
                " no modules_to_save: choose such a LoraConfig."
            )
        if isinstance(layer, Linear):
            if ADAPTER not in layer.lora_A or set(layer.lora_A) != {ADAPTER}:
                raise ValueError(f"peft_config: {name} holds adapters {sorted(layer.lora_A)}; expected only 'default'.")
            if layer.use_dora.get(ADAPTER) or getattr(layer, "lora_bias", {}).get(ADAPTER):
                raise ValueError(
                    f"peft_config: {name} uses DoRA or a LoRA bias, which flair-fabric cannot merge into a flair model"
                    " file: use a plain LoraConfig (use_dora=False, lora_bias=False)."
                )
            yield name, layer


def check_adapters(model: torch.nn.Module) -> None:
    """Refuse, before anything starts, adapters whose model files flair-fabric cannot write (a clear ValueError)."""
    for _, embeddings in adapted_embeddings(model):
        list(_lora_layers(embeddings))


# --- the adapters' configuration in a flair state ---------------------------------------------------------------------


def _embedding_params(state: Any) -> Iterator[dict[str, Any]]:
    """Every transformer embeddings' parameters inside a flair state, depth first."""
    if isinstance(state, dict):
        if str(state.get("__cls__", "")).startswith("Transformer") and "config_state_dict" in state:
            yield state
        for value in state.values():
            yield from _embedding_params(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _embedding_params(value)


def with_adapter_configs(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``model._get_state_dict()``) with each adapted embeddings' ``peft_config`` in its parameters, as
    flair's fix (PR #3627) saves it: flair's own ``load`` then rebuilds the adapters and their weights load."""
    adapted = dict(adapted_embeddings(model))
    if not adapted:
        return state
    embeddings = [module for module in model.modules() if isinstance(module, TransformerEmbeddings)]
    params = list(_embedding_params(state))
    if len(params) != len(embeddings) or any(p.get("name") != e.name for p, e in zip(params, embeddings, strict=False)):
        raise ValueError(
            f"{type(model).__name__}: its flair state holds {len(params)} transformer embeddings, the model"
            f" {len(embeddings)}: flair-fabric cannot tell which carries which adapter."
        )
    adapted_ids = {id(module) for module in adapted.values()}
    for found, module in zip(params, embeddings, strict=True):
        if id(module) in adapted_ids:
            found["peft_config"] = copy.deepcopy(module.model.peft_config[ADAPTER])
    return state


# --- merged weights for plain flair model files -----------------------------------------------------------------------


def merged_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` as stock flair builds it when loading: each adapted transformer replaced by its base
    with the LoRA adapters merged in (``W + scaling * B @ A``, peft's ``merge_and_unload``). ``weights``: the whole
    weights to use (a sharded model's, gathered), else ``model.state_dict()``."""
    state = dict(weights if weights is not None else model.state_dict())
    for name, embeddings in adapted_embeddings(model):
        inner = f"{name}.model." if name else "model."
        for layer_name, layer in _lora_layers(embeddings):
            key = f"{inner}{layer_name}"
            lora_a = state.pop(f"{key}.lora_A.{ADAPTER}.weight")
            lora_b = state.pop(f"{key}.lora_B.{ADAPTER}.weight")
            base = state[f"{key}.base_layer.weight"]
            delta = lora_b.float() @ lora_a.float()
            delta = (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[ADAPTER]
            state[f"{key}.base_layer.weight"] = (base.float() + delta.to(base.device)).to(base.dtype)
            for stored in [k for k in state if k.startswith(f"{key}.base_layer.")]:
                state[f"{key}.{stored.removeprefix(f'{key}.base_layer.')}"] = state.pop(stored)
        for stored in [k for k in state if k.startswith(f"{inner}{PEFT_PREFIX}")]:
            state[f"{inner}{stored.removeprefix(f'{inner}{PEFT_PREFIX}')}"] = state.pop(stored)
    return state


def weights_from_merged(
    model: torch.nn.Module, merged: dict[str, torch.Tensor], current: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Weights for the adapted ``model`` that compute what the merged weights ``merged`` (a model file written with
    :func:`merged_weights`) compute: each base layer holds the merged weight, each LoRA ``B`` is zero and each LoRA
    ``A`` keeps its ``current`` value (the model's whole weights), so training can go on from there. Each adapted
    embeddings of ``model`` is marked (:data:`MERGED_BASE`): its base no longer holds the pretrained weights."""
    state = dict(merged)
    for name, embeddings in adapted_embeddings(model):
        setattr(embeddings, MERGED_BASE, True)
        inner = f"{name}.model." if name else "model."
        for stored in [k for k in state if k.startswith(inner)]:
            state[f"{inner}{PEFT_PREFIX}{stored.removeprefix(inner)}"] = state.pop(stored)
        for layer_name, _ in _lora_layers(embeddings):
            key = f"{inner}{layer_name}"
            for stored in [k for k in state if k.startswith(f"{key}.")]:
                state[f"{key}.base_layer.{stored.removeprefix(f'{key}.')}"] = state.pop(stored)
            state[f"{key}.lora_A.{ADAPTER}.weight"] = current[f"{key}.lora_A.{ADAPTER}.weight"]
            state[f"{key}.lora_B.{ADAPTER}.weight"] = torch.zeros_like(current[f"{key}.lora_B.{ADAPTER}.weight"])
    return state


# --- checkpoints of the adapters' size --------------------------------------------------------------------------------


def _frozen_base(model: torch.nn.Module) -> set[str]:
    """The names of the frozen parameters that are not adapter weights (an adapter weight the DDP probe froze is
    still the adapters', so a checkpoint of one number of processes resumes on another)."""
    prefixes = tuple(f"{name}." if name else "" for name, _ in adapted_embeddings(model))
    return {
        name
        for name, parameter in model.named_parameters()
        if not parameter.requires_grad and not (name.startswith(prefixes) and ".lora_" in name)
    }


def trainable_keys(model: torch.nn.Module) -> set[str] | None:
    """The state keys a checkpoint of ``model`` keeps: its adapters' and other trainable weights and its buffers,
    leaving out the frozen base; ``None`` (everything) for a model without adapters."""
    if not has_adapters(model):
        return None
    frozen = _frozen_base(model)
    return {key for key in model.state_dict() if key not in frozen}


def load_model_state(model: torch.nn.Module, stored: dict[str, Any]) -> None:
    """Load a checkpoint's model state into ``model``: everything, or for a model with adapters at least all but the
    frozen base (which stays as the model was built, from its own source). Anything else missing, or anything
    unexpected, raises as ``load_state_dict`` does."""
    missing = set(model.state_dict()) - set(stored)
    if has_adapters(model) and missing and missing <= _frozen_base(model) and set(stored) <= set(model.state_dict()):
        model.load_state_dict(stored, strict=False)
    else:
        model.load_state_dict(stored)


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every trainable LoRA weight of ``model``'s adapters, in the model's order."""
    prefixes = tuple(f"{name}." if name else "" for name, _ in adapted_embeddings(model))
    return [
        (name, parameter)
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and name.startswith(prefixes) and ".lora_" in name
    ]


def non_reentrant_checkpointing(model: torch.nn.Module) -> list[str]:
    """Make the gradient checkpointing of every adapted transformer that has it on (peft's
    ``prepare_model_for_kbit_training`` turns it on, reentrant by transformers' default) non-reentrant: a reentrant
    backward under DDP marks adapter weights ready twice where DDP searches for unused parameters (peft#313). Returns
    the names of the embeddings changed."""
    changed = []
    for name, embeddings in adapted_embeddings(model):
        base = embeddings.model.get_base_model()
        if getattr(base, "is_gradient_checkpointing", False):
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            changed.append(name)
    return changed


def checkpoint_like(source: torch.nn.Module, copy_of_source: torch.nn.Module) -> list[str]:
    """Turn on, non-reentrant, the gradient checkpointing of each adapted transformer in ``copy_of_source`` whose
    counterpart in ``source`` has it on (a copy rebuilt from the flair state, FSDP's, is built without it). Returns
    the names of the embeddings changed."""
    on = {
        name
        for name, embeddings in adapted_embeddings(source)
        if getattr(embeddings.model.get_base_model(), "is_gradient_checkpointing", False)
    }
    changed = []
    for name, embeddings in adapted_embeddings(copy_of_source):
        if name in on:
            base = embeddings.model.get_base_model()
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            changed.append(name)
    return changed
